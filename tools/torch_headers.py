"""Fetch the C++ headers of another torch release, for compile checks against it.

The GPU machine runs torch 2.11 while this project develops on 2.13, and c10d's C++ API
moves between releases. `python tools/torch_headers.py 2.11.0 DEST` downloads that
release's wheel from the package index (no install) and extracts `torch/include` into
DEST; tests/packaging/test_other_torch_headers.py then compiles every translation unit
against it when PYCOMM_COMPAT_TORCH_INCLUDE=DEST/torch/include is set. Prints that include path.
VERSION `latest` is the newest release the package index serves, asked each time (a
release newer than the cached one is fetched again).
"""

import glob
import os
import re
import subprocess
import sys
import tempfile
import zipfile


def newest_release() -> str:
    """The newest torch release the package index serves (pip's own answer)."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "torch"],
                         capture_output=True, text=True, check=True).stdout
    match = re.search(r"^torch \(([^)]+)\)", out, re.M)
    if match is None:
        raise RuntimeError(f"pip index versions torch: no version in {out!r}")
    return match.group(1)


def fetch(version: str, dest: str) -> str:
    if version == "latest":
        version = newest_release()
    include = os.path.join(dest, "torch", "include")
    stamp = os.path.join(dest, "torch", "version.txt")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if f.read().strip() == version:
                return include
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--only-binary=:all:", "-d", tmp, f"torch=={version}"], check=True)
        wheels = glob.glob(os.path.join(tmp, "torch-*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"expected one torch wheel in {tmp}, found {wheels}")
        with zipfile.ZipFile(wheels[0]) as whl:
            whl.extractall(dest, [n for n in whl.namelist() if n.startswith("torch/include/")])
    with open(stamp, "w") as f:
        f.write(version + "\n")
    return include


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python tools/torch_headers.py VERSION DEST")
    print(fetch(sys.argv[1], sys.argv[2]))
