"""README.md and docs/*.md stay true to the repository: every relative link names a file of it, and every
``#anchor`` a heading of its target (GitHub's heading ids), so that moving a section between pages
cannot leave a dangling link; and every ``ovqflex CMD --flag`` a page shows is a flag of CMD."""
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
