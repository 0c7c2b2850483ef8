"""The user documentation holds together: README's contents list is its headings, every link between README,
docs/BENCHMARKS.md and docs/DESIGN.md reaches a heading or a file that exists, and the user text names
machines by what they are (no issue numbers, no "this VM" or "the GPU box")."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/BENCHMARKS.md", "docs/DESIGN.md")
USER_DOCS = ("README.md", "docs/BENCHMARKS.md")


def headings(text: str) -> list[tuple[int, str]]:
    """(level, title) of every Markdown heading outside fenced code blocks."""
    found, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^(#{1,6}) (.+)", line)):
            found.append((len(m.group(1)), m.group(2).strip()))
    return found


def slug(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    for _, title in headings(text):
        s = slug(title)
        seen[s] = seen.get(s, 0) + 1
    return {s if n == 1 else f"{s}-{i}" for s, n in seen.items() for i in range(n)} | set(seen)


def test_the_contents_list_is_the_readmes_headings() -> None:
    text = (REPO / "README.md").read_text()
    listed = text.split("\n## Contents\n", 1)[1].split("\n## ", 1)[0]
    entries = re.findall(r"^( *)- \[(.+)\]\(#([^)]+)\)$", listed, re.M)
    wanted = [(lvl, t) for lvl, t in headings(text) if lvl in (2, 3) and t != "Contents"]
    assert [(2 + len(indent) // 2, title) for indent, title, _ in entries] == wanted, (
        "README's Contents differ from its ## and ### headings"
    )
    assert all(anchor == slug(title) for _, title, anchor in entries)


@pytest.mark.parametrize("doc", DOCS)
def test_every_link_reaches_a_heading_or_a_file(doc: str) -> None:
    path = REPO / doc
    broken = []
    for target, anchor in re.findall(r"\]\(([^)\s#]*)(?:#([^)\s]+))?\)", path.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        linked = (path.parent / target).resolve() if target else path
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and anchor not in anchors(linked.read_text()):
            broken.append(f"{target}#{anchor}: no such heading")
    assert broken == [], f"{doc}: {broken}"


@pytest.mark.parametrize("doc", USER_DOCS)
def test_user_text_names_machines_not_issues_or_sessions(doc: str) -> None:
    text = (REPO / doc).read_text()
    said = re.findall(r"\bissues? \d+|\bthis VM\b|\bthe VM\b|\bGPU box\b|\bthis session\b", text, re.I)
    assert said == [], f"{doc}: {said}"
