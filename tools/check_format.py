"""Check that the C++/CUDA sources under csrc/ are laid out as .clang-format says.

usage: python tools/check_format.py          # names the files that differ, exit 1 if any
       python tools/check_format.py --fix    # rewrites them in place

The files are the tracked *.cpp, *.h, *.cu and *.cuh under csrc/ (`git ls-files`; every
such file under csrc/ outside a git checkout). The formatter is the `clang-format` on PATH;
the `test` extra pins the release CI uses, since another release may lay out the same code
differently.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SUFFIXES = (".cpp", ".h", ".cu", ".cuh")


def pinned_release() -> str | None:
    """The clang-format release pyproject.toml's `test` extra pins, the one CI runs."""
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'"clang-format==([0-9.]+)"', text)
    return m.group(1) if m else None


def sources() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "csrc"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        out = [str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*")]
    return sorted(f for f in out if f.endswith(SUFFIXES))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fix", action="store_true", help="format the files in place")
    args = parser.parse_args()
    pinned = pinned_release()
    exe = shutil.which("clang-format")
    if exe is None:
        print("check_format: no clang-format on PATH "
              f"(pip install clang-format=={pinned}, or the `test` extra)")
        return 2
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    if pinned is None or pinned not in version.split():
        print(f"check_format: warning: {version.strip()} is not the pinned {pinned}; "
              "its layout may differ from CI's")
    files = sources()
    if args.fix:
        subprocess.run([exe, "-i", "--style=file", *files], cwd=ROOT, check=True)
        print(f"check_format: formatted {len(files)} files")
        return 0
    differ = [f for f in files
              if subprocess.run([exe, "--dry-run", "--Werror", "--style=file", f], cwd=ROOT,
                                capture_output=True).returncode != 0]
    for f in differ:
        print(f"check_format: {f} differs from .clang-format's layout")
    if differ:
        print(f"check_format: {len(differ)} of {len(files)} files differ; "
              "apply with: python tools/check_format.py --fix")
        return 1
    print(f"check_format: {len(files)} files OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
