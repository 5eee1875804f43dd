"""README.md and docs/*.md stay true to the repository: every relative link names a file of it, and every
``#anchor`` a heading of its target (GitHub's heading ids), so that moving a section between pages
cannot leave a dangling link; every ``ovqflex CMD --flag`` a page shows is a flag of CMD; and every file and
``FILE.py::NAME`` a page, or the code's docstrings and comments, cite exists."""
import functools
import pathlib
import re

import pytest

from ovqflex.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", flags=re.S | re.M)


def heading_ids(text: str) -> set[str]:
    """GitHub's ids of a page's headings: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``
    (outside fenced code blocks)."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.+)$", FENCED.sub("", text), flags=re.M)}


@functools.cache
def page_ids(path: pathlib.Path) -> frozenset[str]:
    """:func:`heading_ids` of the page at ``path``, read once however many links point into it."""
    return frozenset(heading_ids(path.read_text()))


def links(text: str) -> list[str]:
    """The targets of a page's markdown links and images that are not web addresses."""
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", FENCED.sub("", text)) if not re.match(r"[a-z]+://|mailto:", t)]


def command_lines(text: str) -> list[str]:
    """The command lines a page shows: each line of its fenced blocks (with ``\\`` continuations joined)
    and each inline code span (which may wrap over lines), split at ``&&``."""
    lines = [ln for block in FENCED.findall(text) for ln in block.replace("\\\n", " ").splitlines()]
    spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", FENCED.sub("", text))]
    return [part for line in lines + spans for part in line.split("&&")]


def test_heading_ids_follow_github():
    text = "# Precision, and what runs\n## `icr` at the `cpu` scale\n## A length warm-up on the gpu scale's task\n"
    assert heading_ids(text) == {"precision-and-what-runs", "icr-at-the-cpu-scale",
                                 "a-length-warm-up-on-the-gpu-scales-task"}


def test_command_lines_join_wrapped_spans_and_continued_lines():
    text = ("Run `ovqflex eval DIR\n--lengths 64` and:\n\n```bash\novqflex viz ovq \\\n    --view token\n"
            "pip install -e . && ovqflex train --out r\n```\n")
    assert command_lines(text) == ["ovqflex viz ovq      --view token", "pip install -e . ", " ovqflex train --out r",
                                   "ovqflex eval DIR --lengths 64"]


@pytest.mark.parametrize("page", PAGES)
def test_every_link_of_a_page_resolves(page):
    path = ROOT / page
    checked = 0
    for target in links(path.read_text()):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{page} links to {target}: no file {dest.relative_to(ROOT)}"
        if anchor:
            assert anchor in page_ids(dest), f"{page} links to {target}: no such heading"
        checked += 1
    if page == "README.md":
        assert checked >= 10  # the README links its docs pages and its own sections


@pytest.mark.parametrize("page", PAGES)
def test_every_flag_a_page_shows_exists(page):
    """Each ``ovqflex CMD ... --flag`` a page shows (command lines, the command table, commands quoted with
    their figures) is a flag of CMD."""
    commands = build_parser()._subparsers._group_actions[0].choices
    shown = {}
    for line in command_lines((ROOT / page).read_text()):
        for command, rest in re.findall(r"\bovqflex (\w+)(.*)", line):
            shown.setdefault(command, set()).update(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest))
    assert set(shown) <= set(commands), f"{page} shows unknown commands {sorted(set(shown) - set(commands))}"
    if page == "README.md":
        assert {"viz", "profile", "demo", "train", "experiment", "eval"} <= set(shown)
        assert {"--view", "--format", "--query", "--mode", "--opt", "--trace"} <= shown["viz"] | shown["profile"]
    for command, flags in shown.items():
        missing = flags - set(commands[command]._option_string_actions)
        assert not missing, f"{page} shows ovqflex {command} {sorted(missing)}"


# the repository's code: where a page's FILE.py::NAME citations point
SOURCES = sorted(p.relative_to(ROOT).as_posix() for d in ("ovqflex", "recurrences", "masks", "tests", "tools")
                 for p in (ROOT / d).rglob("*.py"))
NAMED_FILE = re.compile(r"(?<![\w/.])((?:ovqflex|recurrences|masks|tests|tools|profiles|docs)/[\w/.\-]+"
                        r"\.(?:py|toml|sh|md))")
CITED = re.compile(r"(?<![\w/.])([\w/.\-]*\.py)::(\w+)")


def unwrapped(text: str) -> str:
    """A page's text with names wrapped after an underscore (``test_a_long_\\nname``) joined."""
    return re.sub(r"_\n\s*", "_", text)


def cited_files(cited: str) -> list[str]:
    """The files of the repository a citation's path may mean: the path from the root, else every source file
    whose path ends with it (``ops/test_ovq.py``; ``rec/`` is the short form of ``recurrences/`` in
    docs/design.md's tables)."""
    path = re.sub(r"^rec/", "recurrences/", cited)
    return [path] if (ROOT / path).is_file() else [s for s in SOURCES if s.endswith("/" + path)]


def defines(path: pathlib.Path, name: str) -> bool:
    """Whether the module at ``path`` defines ``name``: a function, class or method, or a module-level name."""
    return re.search(rf"^\s*(?:async def|def|class) {name}\b|^{name}\b\s*(?::|=)", path.read_text(), re.M) is not None


def test_citations_are_unwrapped_and_resolved():
    text = "kept by `tests/ovqflex/ops/test_vq.py::test_a_\n  b` and `ops/test_ovq.py::test_bad_arguments`."
    assert CITED.findall(unwrapped(text)) == [("tests/ovqflex/ops/test_vq.py", "test_a_b"),
                                              ("ops/test_ovq.py", "test_bad_arguments")]
    assert cited_files("ops/test_ovq.py") == ["tests/ovqflex/ops/test_ovq.py"]
    assert cited_files("rec/vla.py") == ["recurrences/vla.py"]
    assert set(cited_files("test_kvm.py")) == {"tests/ovqflex/ops/test_kvm.py", "tests/ovqflex/layers/test_kvm.py"}
    assert defines(ROOT / "tests/test_docs.py", "defines") and defines(ROOT / "tests/test_docs.py", "SOURCES")
    assert not defines(ROOT / "tests/test_docs.py", "fines")


@pytest.mark.parametrize("page", PAGES)
def test_every_file_and_name_a_page_cites_exists(page):
    """Each repository file a page names exists, and each ``FILE.py::NAME`` it cites (a test that keeps a claim,
    the code that does a thing) is defined in that file: a moved or renamed test cannot leave a page citing it.
    docs/adding-a-method.md names the files of its example method ``mym``, which a reader writes."""
    text = unwrapped((ROOT / page).read_text())
    wrong = [f"names {path}: no such file" for path in NAMED_FILE.findall(text)
             if not (ROOT / path).exists() and "mym" not in path]
    for path, name in CITED.findall(text):
        files = cited_files(path)
        if not files:
            wrong.append(f"cites {path}::{name}: no file of the repository is {path} or ends with it")
        elif not any(defines(ROOT / f, name) for f in files):
            wrong.append(f"cites {path}::{name}: not defined in {files}")
    assert not wrong, f"{page}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("package", ["ovqflex", "recurrences", "masks", "tools", "tests"])
def test_every_file_and_name_the_code_cites_exists(package):
    """The same of the code's docstrings and comments: each repository file a source file names exists, and
    each ``FILE.py::NAME`` the library and tools cite is defined there (the tests' citations are left out: some
    are node ids of the test files a test writes)."""
    wrong = []
    for source in (s for s in SOURCES if s.startswith(package + "/") and s != "tests/test_docs.py"):
        text = unwrapped((ROOT / source).read_text())
        wrong += [f"{source} names {path}: no such file" for path in NAMED_FILE.findall(text)
                  if not (ROOT / path).exists()]
        for path, name in CITED.findall(text) if package != "tests" else ():
            files = cited_files(path)
            if not any(defines(ROOT / f, name) for f in files):
                wrong.append(f"{source} cites {path}::{name}: not defined in {files or 'any file'}")
    assert not wrong, "\n".join(wrong)
