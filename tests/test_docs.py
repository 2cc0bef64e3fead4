"""The documentation a clone carries: every relative link in README.md and docs/ points inside the repository at a
file that exists (a link to a file outside the repository breaks for everyone who clones it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_resolve_inside_the_repository(doc: Path) -> None:
    bad = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+://|mailto:|#", target):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        if REPO not in path.parents and path != REPO or not path.exists():
            bad.append(target)
    assert not bad, f"{doc.name}: links outside the repository or to missing files: {bad}"


def test_the_design_document_is_in_the_repository_and_linked_from_the_readme() -> None:
    assert (REPO / "docs" / "architecture.md").exists()
    assert "](docs/architecture.md)" in (REPO / "README.md").read_text()
