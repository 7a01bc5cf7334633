"""docs/: the design in the repository. Every relative link resolves, and nothing cites a design file that is not here."""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")
PAGES = ("README.md", "architecture.md", "row-life.md", "runtime-and-kernels.md", "fidelity.md", "evaluation.md",
         "environment.md", "cli.md", "results.md", "extending.md", "kvpress.md", "scaling.md")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_docs_has_its_pages_and_the_readme_links_them():
    assert sorted(p.name for p in (ROOT / "docs").glob("*.md")) == sorted(PAGES)
    readme = (ROOT / "README.md").read_text()
    for page in PAGES:
        assert f"docs/{page}" in readme, page


def test_every_relative_link_in_docs_and_the_readme_resolves():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target, anchor in LINK.findall(path.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            resolved = (path.parent / target).resolve()
            assert resolved.exists(), f"{path.relative_to(ROOT)} links to {target}, which does not exist"
            if anchor and resolved.suffix == ".md":
                anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", resolved.read_text(), re.M)}
                assert anchor[1:] in anchors, f"{path.relative_to(ROOT)}: no heading {anchor} in {target}"


def test_nothing_tracked_cites_design_files_outside_the_repository():
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the tracked files are unknown")
    tracked = [name for name in listed.stdout.split() if (ROOT / name).exists()]  # a deletion not yet committed
    cited = []
    for name in tracked:
        if name.endswith((".py", ".md", ".toml")) and name != "tests/test_docs.py":
            text = (ROOT / name).read_text(errors="replace")
            cited += [f"{name}: {m}" for m in re.findall(r"\b(?:DESIGN|FACTS|STYLE)\.md\b", text)]
    assert cited == []
