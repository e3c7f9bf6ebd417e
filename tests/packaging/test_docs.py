"""The README and docs/ cannot rot: every Python example runs, every `pycomm-bench` command
line shown parses, every relative link leads somewhere, the README stays a front door, and
the site builds strictly.

A ```python block is preceded, on the line right above its fence, by one of
    <!-- run -->                a whole script, run as `python script.py` in a temp dir
    <!-- run: ranks=N -->       a whole script as `torchrun --nproc-per-node N` runs it:
                                N ranks with torchrun's variables, each joining its own
                                group (through the rank launcher, in a shared temp dir)
    <!-- run: gpu ranks=N -->   the same on a CUDA device: skipped without one (failed
                                under PYCOMM_REQUIRE_CUDA=1, as tools/gpu_check.py runs
                                `-k gpu.md` of this file on the GPU machine)
    <!-- not run: REASON -->    a fragment; the reason says why and what covers it
so no example is silently left out.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from tests.support.multirank import free_port, run_ranks, set_launcher_env
from tests.support.paths import REPO

README_LIMIT_BYTES = 12 * 1024
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINKED = [*PAGES, REPO / "CONTRIBUTING.md", REPO / "CHANGELOG.md",
          REPO / "benchmarks" / "README.md", REPO / "benchmarks" / "results" / "README.md"]
_MARKER = re.compile(r"^<!-- (run|run: (gpu )?ranks=(\d+)|not run: .+) -->$")


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    marker: str | None
    source: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def ranks(self) -> int | None:
        m = _MARKER.match(self.marker or "")
        return int(m.group(3)) if m and m.group(3) else None

    @property
    def gpu(self) -> bool:
        m = _MARKER.match(self.marker or "")
        return bool(m and m.group(2))


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, each with the marker line right above it."""
    found, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang, start = lines[i][3:].strip(), i
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            above = lines[start - 1].strip() if start else ""
            found.append(Block(path, start + 1, lang, above if _MARKER.match(above) else None,
                               "\n".join(lines[start + 1:end]) + "\n"))
            i = end
        i += 1
    return found


PYTHON = [b for p in PAGES for b in blocks(p) if b.lang == "python"]
RUNNABLE = [b for b in PYTHON if b.marker and b.marker.startswith("<!-- run")]


def test_every_python_example_is_marked():
    unmarked = [b.name for b in PYTHON if b.marker is None]
    assert not unmarked, f"mark each as <!-- run -->, <!-- run: ranks=N --> or <!-- not run: " \
                         f"REASON --> on the line above its fence: {unmarked}"
    assert len(RUNNABLE) >= 8, [b.name for b in RUNNABLE]


def _script_rank(rank: int, world_size: int, source: str, name: str, port: int,
                 cwd: str) -> None:
    set_launcher_env(rank, world_size, port)
    os.environ["TORCHELASTIC_RUN_ID"] = "docs"  # as under torchrun (Lightning reads it)
    os.chdir(cwd)
    exec(compile(source, name, "exec"), {"__name__": "__main__"})


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.name)
def test_example_runs(block: Block, tmp_path: Path):
    if block.gpu:
        from tests.support import gpu

        gpu.require()
    needs = {"lightning", "accelerate", "transformers"} & set(
        re.findall(r"^\s*(?:import|from) (\w+)", block.source, re.M))
    for module in sorted(needs):
        pytest.importorskip(module, reason=f"the integrations extra ({module}) is absent")
    if block.ranks is None:
        script = tmp_path / "example.py"
        script.write_text(block.source)
        out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, f"{block.name} failed:\n{out.stdout}\n{out.stderr}"
    else:
        run_ranks(_script_rank, block.ranks, backend=None, deadline_s=300.0,
                  source=block.source, name=block.name, port=free_port(), cwd=str(tmp_path))


def _bench_command_lines() -> list[tuple[str, list[str]]]:
    """Every `pycomm-bench ...` / `... -m pycomm.bench ...` in the pages' bash blocks, as
    (where, argv after the program)."""
    found = []
    for page in PAGES:
        for b in blocks(page):
            if b.lang not in ("bash", "sh"):
                continue
            for k, line in enumerate(b.source.replace("\\\n", " ").splitlines()):
                segment: list[str] = []
                for word in [*shlex.split(line, comments=True), ";"]:
                    if word not in ("&&", "||", "|", ";"):
                        segment.append(word)
                        continue
                    if "pycomm-bench" in segment:
                        found.append((f"{b.name}+{k}",
                                      segment[segment.index("pycomm-bench") + 1:]))
                    elif "pycomm.bench" in segment and "-m" in segment:
                        found.append((f"{b.name}+{k}",
                                      segment[segment.index("pycomm.bench") + 1:]))
                    segment = []
    return found


BENCH_LINES = _bench_command_lines()


def test_bench_command_lines_are_found():
    assert len(BENCH_LINES) >= 10, BENCH_LINES


@pytest.mark.parametrize("where,argv", BENCH_LINES, ids=[w for w, _ in BENCH_LINES])
def test_bench_command_line_parses(where: str, argv: list[str]):
    from pycomm.bench.__main__ import parse

    argv = [a for a in argv if not a.startswith("$")]  # shell variables stand for values
    try:
        parse(argv)
    except SystemExit as e:
        pytest.fail(f"{where}: pycomm-bench {shlex.join(argv)} does not parse (exit {e.code})")


def slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading."""
    text = re.sub(r"[`*]", "", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def _links(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text.replace("[`", "[").replace("`](", "]("))
    return [(path.name, t) for t in re.findall(r"\]\(([^)\s]+)\)", text)]


@pytest.mark.parametrize("page", LINKED, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_lead_somewhere(page: Path):
    broken = []
    for _, target in _links(page):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and "docs" in dest.parts and anchor not in anchors(
                dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(REPO)}: {broken}"


def test_readme_is_a_front_door():
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) <= README_LIMIT_BYTES, len(readme.encode())
    first_screen = "\n".join(readme.splitlines()[:100])  # before the install details
    for what in ("DistributedDataParallel as DDP", "pycomm-bench collectives",
                 "last_step_report()"):
        assert what in first_screen, what  # each of the three users finds their lines


def test_docs_build_strictly(tmp_path: Path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec(
            "mkdocstrings_handlers") is None:
        pytest.skip("the docs extra (mkdocs, mkdocstrings) is absent")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                          "-d", str(tmp_path / "site")], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "reference" / "index.html").stat().st_size > 50_000
