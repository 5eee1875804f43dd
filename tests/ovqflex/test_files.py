"""``write_atomic``: the file is replaced whole, synced first, and a failed write changes nothing."""
import os

import pytest

import ovqflex.files as files
from ovqflex.files import write_atomic


def test_the_file_is_replaced_whole_after_its_bytes_are_synced(tmp_path, monkeypatch):
    path = tmp_path / "report.json"
    path.write_text("old")
    events = []
    fsync, replace = os.fsync, os.replace

    def logged_fsync(fd):
        events.append("fsync")
        fsync(fd)

    def logged_replace(src, dst):
        events.append(("replace", src.read_text()))
        replace(src, dst)

    monkeypatch.setattr(files.os, "fsync", logged_fsync)
    monkeypatch.setattr(files.os, "replace", logged_replace)
    write_atomic(path, "new text\n")
    assert events == ["fsync", ("replace", "new text\n")]
    assert path.read_text() == "new text\n" and [p.name for p in tmp_path.iterdir()] == ["report.json"]


def _full_disk(src, dst):
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("fail", ["encode", "rename"])
def test_a_failed_write_leaves_the_file_as_it_was_and_no_temporary_file(tmp_path, monkeypatch, fail):
    """Text the encoding cannot write (a lone surrogate), or a rename that fails."""
    path = tmp_path / "spec.json"
    path.write_text("old")
    if fail == "rename":
        monkeypatch.setattr(files.os, "replace", _full_disk)
    with pytest.raises(UnicodeEncodeError if fail == "encode" else OSError):
        write_atomic(path, "new \udc80" if fail == "encode" else "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["spec.json"]
