"""Compile every csrc/**/*.cu with nvcc, even against a CPU-only torch: CUDA code that is
never compiled rots. Skipped where nvcc is absent, or where the extension was built with
CUDA (the real build then compiled them, and the CUDA tests run)."""

import glob
import os
import shutil
import subprocess
import sysconfig

import pytest
import torch.utils.cpp_extension as cpp

import pycomm
from tests.support.paths import REPO

ROOT = str(REPO)
CU_FILES = sorted(glob.glob(os.path.join(ROOT, "csrc", "**", "*.cu"), recursive=True))
NVCC = shutil.which("nvcc") or (cpp.CUDA_HOME and os.path.join(cpp.CUDA_HOME, "bin", "nvcc"))
# The GPU machine is Hopper (sm_90); compile for what we run on.
ARCH = os.environ.get("PYCOMM_CHECK_ARCH", "sm_90")


def _shim(tmp_path):
    # CPU wheels ship c10/cuda headers but not this one generated header: supply it.
    d = tmp_path / "shim" / "c10" / "cuda" / "impl"
    d.mkdir(parents=True)
    (d / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    return tmp_path / "shim"


@pytest.mark.skipif(not NVCC or not os.path.exists(NVCC), reason="nvcc not found")
@pytest.mark.skipif(pycomm._C.cuda, reason="the CUDA extension is built; its tests cover this")
@pytest.mark.parametrize("source", CU_FILES, ids=lambda p: os.path.relpath(p, ROOT))
def test_cu_file_compiles(source, tmp_path):
    includes = [_shim(tmp_path), *cpp.include_paths(), os.path.join(ROOT, "csrc"),
                sysconfig.get_paths()["include"]]
    cmd = [NVCC, "-c", source, "-o", str(tmp_path / "out.o"), "-std=c++20", f"-arch={ARCH}",
           "-DPYCOMM_WITH_CUDA", *cpp.COMMON_NVCC_FLAGS, *(f"-I{p}" for p in includes)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"nvcc failed on {source}:\n{proc.stderr[-6000:]}"
