"""Every ``§N.M`` cited in code and docs names a heading of the spec, with the right title.

A citation such as ``spec §7.4 "Commit protocol"`` must resolve to a heading ``7.4`` of
``spec/ldformat.md``; when a quoted title follows, it must be that heading's title (or the
title of its parent section, for citations like ``§10 "Deltas"``). Within the spec itself,
``section N.M`` references must resolve too.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "spec" / "ldformat.md"
CITATION = re.compile(r"§\s?(\d+(?:\.\d+)*)(?:,?\s+\"([^\"]+)\")?")
SECTION_REF = re.compile(r"\bsections?\s+(\d+(?:\.\d+)*)")
HEADING = re.compile(r"^#{2,4}\s+(\d+(?:\.\d+)*)\.?\s+(.*?)\s*$")


def spec_headings() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in SPEC.read_text(encoding="utf-8").splitlines():
        m = HEADING.match(line)
        if m:
            out[m.group(1)] = m.group(2).strip("` ")
    return out


def cited_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "spec").glob("*.md"))]
    for folder in ("ldformat", "ldtools", "tests", "benchmarks", "examples", "docs"):
        base = ROOT / folder
        if base.is_dir():
            files += sorted(p for p in base.rglob("*") if p.suffix in (".py", ".md") and p.is_file())
    return [f for f in files if f != Path(__file__).resolve()]


def _title_matches(cited: str, number: str, headings: dict[str, str]) -> bool:
    want = cited.strip().strip("`").lower()
    candidates = [headings.get(number, "")]
    candidates += [t for n, t in headings.items() if n.startswith(number + ".")]  # a parent cited by a child's title
    return any(want == c.strip("`").lower() or want in c.strip("`").lower() for c in candidates)


def test_spec_has_numbered_headings() -> None:
    headings = spec_headings()
    assert {"7.4", "15", "18"} <= set(headings), sorted(headings)


def test_every_citation_resolves() -> None:
    headings = spec_headings()
    bad: list[str] = []
    for path in cited_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for lineno, line in enumerate(text.splitlines(), 1):
            for m in CITATION.finditer(line):
                number, title = m.group(1), m.group(2)
                where = f"{path.relative_to(ROOT)}:{lineno}: §{number}"
                if number not in headings:
                    bad.append(f"{where}: no such heading")
                elif title is not None and not _title_matches(title, number, headings):
                    bad.append(f"{where}: cited as {title!r}, the heading is {headings[number]!r}")
    assert not bad, "\n".join(bad)


def test_section_references_inside_the_spec_resolve() -> None:
    headings = spec_headings()
    bad = []
    for lineno, line in enumerate(SPEC.read_text(encoding="utf-8").splitlines(), 1):
        for m in SECTION_REF.finditer(line):
            if m.group(1).rstrip(".") not in headings:
                bad.append(f"spec/ldformat.md:{lineno}: section {m.group(1)}")
    assert not bad, "\n".join(bad)
