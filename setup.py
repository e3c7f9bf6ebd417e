"""Build pycomm._C: a CppExtension on CPU-only torch, a CUDAExtension when CUDA is there.

Switches (one per real choice): PYCOMM_CUDA=auto|0|1, DEBUG=1. torch is not a build
requirement: install with `pip install --no-build-isolation -e .` after torch.
"""

import glob
import os
import sys

try:
    import torch
except ModuleNotFoundError:  # pip's default build isolation: a fresh env without torch
    raise SystemExit(
        "pycomm's C++ extension is compiled against the torch you run, so torch is not a "
        "build requirement and pip's isolated build environment lacks it. Install torch "
        "first, then build without isolation:\n"
        "    pip install torch ninja \"setuptools>=77\"\n"
        "    pip install --no-build-isolation -e .") from None
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension


def _use_cuda() -> bool:
    choice = os.environ.get("PYCOMM_CUDA", "auto").strip().lower()
    if choice not in ("auto", "0", "1"):
        raise SystemExit(f"PYCOMM_CUDA must be auto, 0 or 1, got {choice!r}")
    available = torch.version.cuda is not None and CUDA_HOME is not None
    if choice == "1" and not available:
        raise SystemExit(
            "PYCOMM_CUDA=1 but torch has no CUDA build "
            f"(torch.version.cuda={torch.version.cuda}) or CUDA_HOME is unset ({CUDA_HOME})"
        )
    if choice == "0" or not available:
        return False
    if _arch_list_known():
        return True
    # See Note [Architectures without a GPU]
    archs = _torch_archs()
    if choice == "auto":
        print(f"pycomm: no GPU is visible and TORCH_CUDA_ARCH_LIST is unset, so this builds the "
              f"CPU extension; PYCOMM_CUDA=1 builds the CUDA one for this torch's "
              f"architectures ({archs}), TORCH_CUDA_ARCH_LIST for others",
              file=sys.stderr, flush=True)
        return False
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    print(f"pycomm: no GPU is visible: building the CUDA extension for this torch's "
          f"architectures, TORCH_CUDA_ARCH_LIST={archs}", file=sys.stderr, flush=True)
    return True


# Note [Architectures without a GPU]
# torch.utils.cpp_extension picks the CUDA architectures from TORCH_CUDA_ARCH_LIST, else
# from the visible GPUs; with neither (a container build, a CI runner, a login node) it
# fails with an IndexError of its own. Then PYCOMM_CUDA=auto builds the CPU extension and
# says how to get the other; PYCOMM_CUDA=1 compiles for the architectures this torch build
# was compiled for (torch.cuda.get_arch_list(), which needs no GPU), so the extension runs
# wherever this torch does.
def _arch_list_known() -> bool:
    return bool(os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()) or (
        torch.cuda.is_available() and torch.cuda.device_count() > 0)


def _torch_archs() -> str:
    """This torch build's GPU architectures in TORCH_CUDA_ARCH_LIST's form ("8.0 9.0")."""
    archs = [a.split("_", 1)[1] for a in torch.cuda.get_arch_list() if a.startswith("sm_")]
    if not archs:
        raise SystemExit("PYCOMM_CUDA=1, no GPU is visible and this torch names no GPU "
                         "architecture (torch.cuda.get_arch_list()): set "
                         "TORCH_CUDA_ARCH_LIST, e.g. TORCH_CUDA_ARCH_LIST=9.0")
    return " ".join(f"{a[:-1]}.{a[-1]}" for a in archs)


def _extension():
    with_cuda = _use_cuda()
    debug = os.environ.get("DEBUG", "0") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    macros = []
    # No fused multiply-adds the source did not ask for: the reductions promise the bits of
    # ATen's separately rounded multiply and add (Note [Pieces all-reduce]), and a compiler
    # may contract a * s + b where FMA is baseline (aarch64) or enabled (-march=native).
    args = {"cxx": opt + ["-fvisibility=hidden", "-ffp-contract=off"]}
    kind = CppExtension
    if with_cuda:
        sources += sorted(glob.glob("csrc/**/*.cu", recursive=True))
        macros.append(("PYCOMM_WITH_CUDA", None))
        args["nvcc"] = opt + ["-lineinfo"]
        kind = CUDAExtension
    # at::parallel_for is an inline OpenMP region: without -fopenmp it silently runs on one
    # thread. The runtime linked is libgomp.so.1, the soname torch itself loads: one pool.
    args["cxx"].append("-fopenmp")
    return kind("pycomm._C", sources, include_dirs=[os.path.abspath("csrc")],
                define_macros=macros, extra_compile_args=args, extra_link_args=["-fopenmp"])


if __name__ == "__main__":  # pip and setuptools run this file as a script
    setup(ext_modules=[_extension()], cmdclass={"build_ext": BuildExtension})
