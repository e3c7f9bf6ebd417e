"""Compile every translation unit against another torch release's headers.

The GPU machine runs torch 2.11, CI builds against 2.15 and 2.13, and c10d's C++ API moves
between releases (csrc/comm/c10d.h guards what we use). This catches a break before a GPU
session does, and before a user on a newer release does. Set PYCOMM_COMPAT_TORCH_INCLUDE to
one `torch/include` directory or several joined by os.pathsep (tools/torch_headers.py
fetches one; .ci/run does it for 2.11 and the newest release); skipped otherwise. Syntax and
template checks only (-fsyntax-only / nvcc -c), nothing is linked or run.
"""

import glob
import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.utils.cpp_extension as cpp

from tests.support.paths import REPO

ROOT = str(REPO)
CSRC = os.path.join(ROOT, "csrc")
INCLUDES = [p for p in os.environ.get("PYCOMM_COMPAT_TORCH_INCLUDE", "").split(os.pathsep) if p]
NVCC = shutil.which("nvcc") or (cpp.CUDA_HOME and os.path.join(cpp.CUDA_HOME, "bin", "nvcc"))
CPP_FILES = sorted(glob.glob(os.path.join(CSRC, "**", "*.cpp"), recursive=True))
CU_FILES = sorted(glob.glob(os.path.join(CSRC, "**", "*.cu"), recursive=True))

pytestmark = pytest.mark.skipif(not INCLUDES or not all(map(os.path.isdir, INCLUDES)),
                                reason="PYCOMM_COMPAT_TORCH_INCLUDE not set to torch/include "
                                       "directories")


def _release(include: str) -> str:
    """The torch release of an include directory (tools/torch_headers.py's version.txt)."""
    stamp = os.path.join(os.path.dirname(include), "version.txt")
    if os.path.exists(stamp):
        with open(stamp) as f:
            return f.read().strip()
    return include


def _includes(include: str) -> list[str]:
    paths = [CSRC, include, os.path.join(include, "torch", "csrc", "api", "include"),
             sysconfig.get_paths()["include"]]
    if NVCC and os.path.exists(NVCC):
        paths.append(os.path.join(os.path.dirname(os.path.dirname(NVCC)), "include"))
    return [f"-I{p}" for p in paths]


def _defines() -> list[str]:
    # The GPU build defines PYCOMM_WITH_CUDA in every unit (setup.py); check that variant,
    # the CPU one is what the installed torch builds anyway.
    cuda = ["-DPYCOMM_WITH_CUDA"] if NVCC and os.path.exists(NVCC) else []
    return ["-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C", *cuda]


def _check(cmd: list[str], source: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode == 0:
        return ""
    return f"{os.path.relpath(source, ROOT)}:\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("include", INCLUDES, ids=_release)
def test_cpp_compiles(include):
    # One test per release, every core: each unit parses all of torch's headers (seconds).
    cxx = os.environ.get("CXX", "c++")
    flags = ["-fsyntax-only", "-std=c++20", "-fopenmp", *_defines(), *_includes(include)]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        errors = [e for e in pool.map(lambda src: _check([cxx, *flags, src], src), CPP_FILES) if e]
    assert not errors, (f"{len(errors)} unit(s) do not compile against {include}:\n"
                        + "\n".join(errors))


@pytest.mark.skipif(not NVCC or not os.path.exists(NVCC), reason="nvcc not found")
@pytest.mark.parametrize("include", INCLUDES, ids=_release)
@pytest.mark.parametrize("source", CU_FILES, ids=lambda p: os.path.relpath(p, ROOT))
def test_cu_compiles(source, include, tmp_path):
    error = _check([NVCC, "-c", source, "-o", str(tmp_path / "out.o"), "-std=c++20", "-arch=sm_90",
                    *cpp.COMMON_NVCC_FLAGS, *_defines(), *_includes(include)], source)
    assert not error, f"does not compile against {include}:\n{error}"
