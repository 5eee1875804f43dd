"""README.md and docs/*.md: every relative link names a file of the repository, and every ``#anchor`` a
heading of its target (GitHub's heading ids), so that moving a section between pages cannot leave a
dangling link. Which flags the pages' commands show is checked in tests/ovqflex/test_cli.py."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]


def heading_ids(text: str) -> set[str]:
    """GitHub's ids of a page's headings: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``
    (outside fenced code blocks)."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.+)$", prose, flags=re.M)}


def links(text: str) -> list[str]:
    """The targets of a page's markdown links and images that are not web addresses."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", prose) if not re.match(r"[a-z]+://|mailto:", t)]


def test_heading_ids_follow_github():
    text = "# Precision, and what runs\n## `icr` at the `cpu` scale\n## A length warm-up on the gpu scale's task\n"
    assert heading_ids(text) == {"precision-and-what-runs", "icr-at-the-cpu-scale",
                                 "a-length-warm-up-on-the-gpu-scales-task"}


@pytest.mark.parametrize("page", PAGES)
def test_every_link_of_a_page_resolves(page):
    path = ROOT / page
    checked = 0
    for target in links(path.read_text()):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{page} links to {target}: no file {dest.relative_to(ROOT)}"
        if anchor:
            assert anchor in heading_ids(dest.read_text()), f"{page} links to {target}: no such heading"
        checked += 1
    if page == "README.md":
        assert checked >= 10  # the README links its docs pages and its own sections
