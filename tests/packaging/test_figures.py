"""Every measured figure a page quotes is its record's: in README.md, the docs and the
results index, each paragraph, list item or table row that links records under
benchmarks/results/ (a list item without a link: those of the paragraph it hangs from)
may only quote figures (a number with its unit: 1.15-1.27x, 54 ms,
298 MB, 1.02 µs, 23.5 GB/s, 12%) that one of those records states, written the same
way. A record changed without its pages, or a page without its record, fails here,
naming the page, the block and the figure."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.paths import REPO

PAGES = sorted([REPO / "README.md", REPO / "benchmarks" / "results" / "README.md",
                *(REPO / "docs").glob("*.md")])
# A number, or a range of two, and a unit; "x" only right after the number (1.15-1.27x).
FIGURE = re.compile(r"(?<![\w.-])(\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?)"
                    r"(x|\s?(?:ms|MB|GB/s|µs|us|%))(?![\w/])")
# "392 / 298 MB": the first number takes the second's unit.
PAIR = re.compile(r"(?<![\w.-])(\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?)\s*/\s*"
                  r"\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?(x|\s?(?:ms|MB|GB/s|µs|us|%))(?![\w/])")
RECORD = re.compile(r"\(((?:\.\./)*(?:benchmarks/)?results/[\w.-]+\.md)(?:#[\w-]*)?\)")


def _blocks(text: str) -> list[str]:
    """Paragraphs, list items and table rows (a list item or row is its own block)."""
    blocks, current = [], []
    for line in text.splitlines():
        starts = line.lstrip().startswith(("- ", "* ", "|")) or re.match(r"\s*\d+\. ", line)
        if not line.strip() or starts:
            if current:
                blocks.append(" ".join(current))
            current = [line] if line.strip() else []
            if line.lstrip().startswith("|"):  # a table row ends at its line
                blocks.append(line)
                current = []
        else:
            current.append(line)
    if current:
        blocks.append(" ".join(current))
    return blocks


def _records(page: Path, block: str) -> list[Path]:
    out = []
    for link in RECORD.findall(block):
        path = (page.parent / link).resolve()
        if not path.exists():  # pages in docs/ link records as results/..., a symlink
            path = (REPO / "benchmarks" / "results" / Path(link).name).resolve()
        if path.exists():  # a dead link is test_docs.py's to report
            out.append(path)
    return out


def _normal(figure: str) -> str:
    return figure.replace(" ", "").replace("us", "µs")


def _figures(text: str) -> set[str]:
    return {_normal(num + unit) for num, unit in FIGURE.findall(text) + PAIR.findall(text)}


def disagreements(pages=PAGES) -> list[str]:
    """What the suite fails on: (page, block start, figure, records) for each figure
    quoted next to records that state it nowhere."""
    found = []
    for page in pages:
        text = page.read_text()
        text = re.sub(r"```.*?```", "", text, flags=re.S)  # commands, not figures
        lead: list[Path] = []  # the records of the paragraph a list hangs from
        for block in _blocks(text):
            records = [r for r in _records(page, block) if r != page.resolve()]
            if not block.lstrip().startswith(("- ", "* ")):
                lead = records
            elif not records:
                records = lead
            if not records:
                continue
            stated = set()
            for record in records:
                stated |= _figures(record.read_text())
            for figure in sorted(_figures(block) - stated):
                names = ", ".join(r.name for r in records)
                where = page.relative_to(REPO) if page.is_relative_to(REPO) else page
                found.append(f"{where}: {block.strip()[:70]!r}... quotes "
                             f"{figure}, which {names} does not state")
    return found


def test_every_quoted_figure_is_its_records():
    assert not disagreements(), "\n".join(disagreements())


def test_a_planted_disagreement_fails(tmp_path):
    """The check can fail: a page quoting 1.16-1.27x where its record says 1.15-1.27x."""
    record = REPO / "benchmarks" / "results" / "ddp_floor_cpu.md"
    assert "1.15-1.27x" in record.read_text()
    page = tmp_path / "page.md"
    page.write_text("The MLP steps at 1.16-1.27x its floor ([record](results/ddp_floor_cpu.md)).\n")
    found = disagreements([page])
    assert len(found) == 1 and "quotes 1.16-1.27x" in found[0], found
    page.write_text("The MLP steps at 1.15-1.27x its floor ([record](results/ddp_floor_cpu.md)).\n")
    assert disagreements([page]) == []


@pytest.mark.parametrize("text, figures", [
    ("0.43-0.57x / 0.40-0.54x DDP; 392 / 298 MB", {"0.43-0.57x", "0.40-0.54x", "392MB",
                                                   "298MB"}),
    ("1.02 µs, 28-175x better, 12% of it, 23.5 GB/s", {"1.02µs", "28-175x", "12%",
                                                        "23.5GB/s"}),
    ("2 hosts x 2 ranks, torch 2.13, 25.2M parameters", set()),
])
def test_what_counts_as_a_figure(text, figures):
    assert _figures(text) == figures
