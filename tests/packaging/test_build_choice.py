"""setup.py's choice of extension (See Note [Architectures without a GPU] in setup.py), on
the machine the suite runs on: with a CUDA torch, CUDA_HOME and no visible GPU, the default
builds the CPU extension and says how to get the other, and PYCOMM_CUDA=1 gives torch's
helper an architecture list it accepts (before the fix, torch raised IndexError there).
README command 1 runs the default build itself on such a machine; the .cu files are
compiled by tests/packaging/test_cuda_sources_compile.py."""

from __future__ import annotations

import runpy

import pytest
import torch
import torch.utils.cpp_extension as cpp

from tests.support.paths import REPO

CUDA_TORCH = torch.version.cuda is not None and cpp.CUDA_HOME is not None
NO_GPU = not torch.cuda.is_available()


def _setup(monkeypatch, **env):
    # recorded by setenv first, so that what setup.py writes there is undone after the test
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "")
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return runpy.run_path(str(REPO / "setup.py"), run_name="pycomm_setup")


def test_bad_switch_is_named(monkeypatch):
    with pytest.raises(SystemExit, match="PYCOMM_CUDA must be auto, 0 or 1, got 'yes'"):
        _setup(monkeypatch, PYCOMM_CUDA="yes")["_use_cuda"]()


def test_cpu_torch_builds_cpu_and_refuses_cuda(monkeypatch):
    if CUDA_TORCH:
        pytest.skip("a CUDA torch with CUDA_HOME: test_no_gpu_* cover it")
    assert not _setup(monkeypatch)["_use_cuda"]()
    with pytest.raises(SystemExit, match="PYCOMM_CUDA=1 but torch has no CUDA build"):
        _setup(monkeypatch, PYCOMM_CUDA="1")["_use_cuda"]()


needs_cuda_torch_no_gpu = pytest.mark.skipif(
    not (CUDA_TORCH and NO_GPU), reason="needs a CUDA torch, CUDA_HOME (nvcc) and no GPU")


@needs_cuda_torch_no_gpu
def test_no_gpu_default_builds_cpu_and_says_how(monkeypatch, capsys):
    setup = _setup(monkeypatch)
    assert not setup["_use_cuda"]()
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and "PYCOMM_CUDA=1" in said, said
    assert not any(s.endswith(".cu") for s in setup["_extension"]().sources)


@needs_cuda_torch_no_gpu
def test_no_gpu_pycomm_cuda_1_builds_for_torchs_architectures(monkeypatch, capsys):
    setup = _setup(monkeypatch, PYCOMM_CUDA="1")
    ext = setup["_extension"]()
    assert any(s.endswith(".cu") for s in ext.sources)
    expected = {a for a in torch.cuda.get_arch_list() if a.startswith("sm_")}
    # torch's own helper, which raised IndexError here before, now names every one
    flags = cpp._get_cuda_arch_flags()
    assert {f.rsplit("=", 1)[1] for f in flags if "code=sm_" in f} == expected, flags
    assert "TORCH_CUDA_ARCH_LIST=" in capsys.readouterr().err


@needs_cuda_torch_no_gpu
def test_an_arch_list_is_torchs_choice(monkeypatch):
    setup = _setup(monkeypatch, TORCH_CUDA_ARCH_LIST="9.0")
    assert setup["_use_cuda"]()
    assert cpp._get_cuda_arch_flags() == ["-gencode=arch=compute_90,code=sm_90"]
