"""The code, ``--help`` and docs cite the project's own design document (U10).

Every ``§N`` / ``§N.M`` citation in the package, README.md, docs/*.md and docs/results/*.md must
name a section heading of docs/design.md, and nothing may cite the SPEC that users do not have.
Every relative link of the Markdown pages resolves, and docs/ keeps dated pages under docs/results/.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITATION = re.compile(r"§\s?(\d+(?:\.\d+)?)(?:\s?[-–]\s?(\d+(?:\.\d+)?))?")


def _texts():
    files = (sorted((ROOT / "src" / "sparda").rglob("*.py")) + [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
             + sorted((ROOT / "docs" / "results").glob("*.md")))
    assert len(files) > 20
    return [(path.relative_to(ROOT), path.read_text(encoding="utf-8")) for path in files]


def _design_sections() -> set[str]:
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", text, flags=re.M))


def test_design_sections_are_numbered():
    sections = _design_sections()
    assert {"1", "3", "3.1", "3.4", "3.6", "4", "5", "6", "8"} <= sections


def test_no_spec_citations():
    found = [f"{path}:{text[:m.start()].count(chr(10)) + 1}"
             for path, text in _texts() for m in re.finditer(r"\bSPEC\b", text)]
    assert not found, found


def test_every_citation_names_a_design_section():
    sections = _design_sections()
    bad, seen = [], 0
    for path, text in _texts():
        for m in CITATION.finditer(text):
            seen += 1
            for number in filter(None, m.groups()):
                if number.rstrip(".") not in sections:
                    bad.append(f"{path}:{text[:m.start()].count(chr(10)) + 1}: §{number}")
    assert seen > 100 and not bad, bad  # about 280 citations today


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)")


def test_relative_markdown_links_resolve():
    pages = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
    bad, seen = [], 0
    for page in pages:
        text = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), page.read_text(encoding="utf-8"), flags=re.S)
        for m in LINK.finditer(text):
            target = m.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue
            seen += 1
            if not (page.parent / target.split("#")[0]).exists():
                bad.append(f"{page.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}: {target}")
    assert seen > 100 and not bad, bad


def test_dated_pages_live_under_results():
    dated = [str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*")
             if re.search(r"20\d\d-\d\d-\d\d", p.name) and (ROOT / "docs" / "results") not in p.parents]
    assert not dated, dated


def _indexed_modules() -> set[str]:
    """Module paths named in docs/architecture.md's "Every module" table: ``dir/name.py``, and
    a bare ``name.py`` after it in the same cell in that directory."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Every module", 1)[1].split("\n## ", 1)[0]
    named = set()
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        folder = ""
        for token in re.findall(r"`([^`]+\.py)`", line.split(" | ")[0]):
            if "/" in token:
                folder = token.rsplit("/", 1)[0] + "/"
                named.add(token)
            else:
                named.add(folder + token)
    return named


def test_architecture_lists_every_module():
    """Every module of the package (``__init__`` files aside) has a row, and every row names
    a module that exists."""
    package = ROOT / "src" / "sparda"
    modules = {str(p.relative_to(package)) for p in package.rglob("*.py") if p.name != "__init__.py"}
    named = _indexed_modules() - {"kernels/__init__.py"}
    assert not modules - named, f"modules missing from docs/architecture.md: {sorted(modules - named)}"
    assert not named - modules, f"docs/architecture.md names modules that do not exist: {sorted(named - modules)}"
