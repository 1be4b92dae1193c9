"""The README and docs/ stay true to the tree: short README, links that resolve, paths that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "infra").rglob("README.md"))]
TOPICS = [
    "pipeline", "configuration", "data", "training", "recovery", "caching", "registry", "cluster",
    "scaling", "experiments", "plugins", "benchmarks", "architecture", "troubleshooting",
]  # fmt: skip
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A project path named in prose or code: flyscale/train/loop.py, tasks/train.py, configs/quick.yaml ...
PATH = re.compile(r"(?<![\w./-])((?:flyscale|plugins|tasks|workflows|configs|benchmarks|tests|infra)/[\w./*-]*[\w*])")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", page.read_text(), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def test_the_readme_fits_on_a_few_screens_and_links_every_topic():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for topic in TOPICS:
        assert (REPO / "docs" / f"{topic}.md").is_file(), f"docs/{topic}.md is missing"
        assert f"docs/{topic}.md" in readme, f"the README does not link docs/{topic}.md"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_resolves(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert broken == [], f"{page.relative_to(REPO)}: broken links {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_project_path_named_exists(page):
    """A module moved or renamed leaves no stale path behind in the docs."""
    text = page.read_text()
    named = {m.rstrip(".") for m in PATH.findall(text)}
    missing = sorted(p for p in named if not (REPO / p).exists() and "*" not in p and "<" not in p)
    assert missing == [], f"{page.relative_to(REPO)} names paths that do not exist: {missing}"
