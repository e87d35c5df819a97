"""The README and docs/: short README, no internal references, every repository path they name exists, and the
README's first bash block is the install and test commands CI runs. Reads text only (no torch)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
INSTALL = 'python3 -m venv .venv && . .venv/bin/activate && pip install -c constraints.txt -e ".[test]"'
TEST_COMMAND = "python -m pytest -q"
README_MAX_LINES = 200

INTERNAL = [re.compile(p, re.IGNORECASE) for p in
            (r"\bissue \d", r"\bsessions?\b", r"DESIGN\.md", r"\.\./shared", r"\bthe brief\b")]
REPO_DIRS = ("examples", "data", "docs", "experiments", "llmsim", "tests")
# a repository path inside code: starts with one of the top-level folders, runs to a space or a quote
REPO_PATH = re.compile(r"(?<![\w./-])(?:%s)/[^\s`'\"()\[\]{},;]*" % "|".join(REPO_DIRS))
INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every ``` block."""
    return re.findall(r"^```([^\n]*)\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def _code_spans(text: str) -> list[str]:
    spans = [body for _, body in _fenced_blocks(text)]
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return spans + INLINE_CODE.findall(prose)


def _repo_paths(text: str) -> set[str]:
    """Repository paths named inside code (backticks or fenced blocks), as written from the repository root."""
    paths = set()
    for span in _code_spans(text):
        for path in REPO_PATH.findall(span):
            path = path.rstrip(".:")
            if "*" in path or "<" in path:
                continue
            paths.add(path)
    return paths


def _link_targets(text: str) -> set[str]:
    """Relative link targets (files, not web addresses or anchors), without their #anchor."""
    targets = set()
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        target = target.split("#", 1)[0]
        if target and "*" not in target and "<" not in target:
            targets.add(target)
    return targets


@pytest.fixture(autouse=True)
def _quiet_transformers():
    """conftest.py's fixture of this name imports transformers; text checks need nothing of it."""
    yield


def _anchors(page: Path) -> set[str]:
    """The #anchors GitHub gives the page's headings (outside code blocks)."""
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", prose, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_docs_exist():
    names = {p.name for p in DOCS}
    for name in ("user-guide.md", "how-it-predicts.md", "validation.md", "gpu-kit.md", "speed.md",
                 "architecture.md", "deepspeed-memory.md"):
        assert name in names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_internal_references(page):
    found = [(n, line.strip()) for n, line in enumerate(page.read_text().splitlines(), 1)
             for pattern in INTERNAL if pattern.search(line)]
    assert not found, f"internal references in {page.name}: {found}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_exist(page):
    text = page.read_text()
    missing = sorted(p for p in _repo_paths(text) if not (ROOT / p).exists())
    missing += sorted(t for t in _link_targets(text) if not (page.parent / t).exists())
    assert not missing, f"{page.name} names paths that are not in the repository: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_link_anchors_exist(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or "#" not in target:
            continue
        path, anchor = target.split("#", 1)
        linked = (page.parent / path) if path else page
        if linked.suffix == ".md" and linked.exists() and anchor not in _anchors(linked):
            broken.append(target)
    assert not broken, f"{page.name} links to headings that do not exist: {broken}"


def test_readme_opens_with_install_and_test_commands():
    text = README.read_text()
    blocks = [body for info, body in _fenced_blocks(text) if info.strip() == "bash"]
    assert blocks, "README.md has no bash block"
    lines = [line.strip() for line in blocks[0].splitlines()]
    assert any(line.startswith(INSTALL) for line in lines), "the first bash block lacks the install command"
    assert TEST_COMMAND in lines, "the first bash block lacks the test command CI runs"
    # right after the title and at most one sentence
    before = text[:text.index("```bash")].strip().splitlines()
    assert before[0] == "# llmsim" and len([line for line in before[1:] if line.strip()]) <= 1


def test_path_finder_sees_every_form():
    """The checks above are only as good as the path finder: code spans, fenced blocks and links."""
    text = ("`examples/a.json`, `python experiments/b.py --x`\n```bash\nllmsim --ds-config examples/c.json\n```\n"
            "[d](docs/d.md#part) ![e](figures/e.png) [web](https://x.org/y) `data/*.csv` `llmsim.module`\n")
    assert _repo_paths(text) == {"examples/a.json", "experiments/b.py", "examples/c.json"}
    assert _link_targets(text) == {"docs/d.md", "figures/e.png"}
