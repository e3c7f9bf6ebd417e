"""A /dev/shm too small for a group's segment (containers: Docker's default is 64 MB):
never a SIGBUS (See Note [Reserving the segment] in csrc/shm/segment.cpp). Each case runs
its ranks in a mount namespace of their own whose /dev/shm is a 4 MB tmpfs, less than the
5 MiB two ranks' segment needs: pycomm's DDP on a Gloo group falls back to Gloo with one
warning per rank naming the space and how to grant it, and trains as torch's DDP; an
explicit "pycomm" group raises a ShmSpaceError on every rank. Root and unshare(1) only."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.support.paths import REPO

_WHY = ("needs root and unshare(1) for a mount namespace" if os.geteuid() != 0
        or shutil.which("unshare") is None else None)
pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")


def _under_small_dev_shm(body: str) -> subprocess.CompletedProcess:
    script = textwrap.dedent(body)
    shell = (f"mount -t tmpfs -o size=4m tmpfs /dev/shm && exec {sys.executable} -c "
             f"'{script}'")
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", shell],
                          capture_output=True, text=True, timeout=240, cwd=REPO)


def test_ddp_falls_back_to_gloo_with_one_warning_and_trains_as_torch():
    proc = _under_small_dev_shm("""
        from tests.shm.test_small_dev_shm import _ddp_fallback
        from tests.support.multirank import run_ranks
        run_ranks(_ddp_fallback, 2)
        print("trained")
    """)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "trained" in proc.stdout and "Bus error" not in proc.stderr


def test_an_explicit_pycomm_group_raises_on_every_rank():
    proc = _under_small_dev_shm("""
        from tests.shm.test_small_dev_shm import _explicit_group
        from tests.support.multirank import run_ranks
        run_ranks(_explicit_group, 2)
        print("raised on every rank")
    """)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "raised on every rank" in proc.stdout


def _ddp_fallback(rank, world_size):
    import copy
    import warnings

    import torch.distributed as dist

    import pycomm
    from tests.support.ddp_models import tanh_mlp, train_sgd

    base = tanh_mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = pycomm.DistributedDataParallel(copy.deepcopy(base))
    said = [str(w.message) for w in caught if "/dev/shm" in str(w.message)]
    assert len(said) == 1, said
    assert "--shm-size" in said[0] and "bytes for 2 ranks" in said[0], said[0]
    # the group already is Gloo: no advice to use one
    assert "use a gloo group" not in said[0] and "stay on gloo" in said[0], said[0]
    assert ours.gradient_group is dist.group.WORLD
    ref = torch_ddp(copy.deepcopy(base))
    for a, b in zip(train_sgd(ours, rank), train_sgd(ref, rank)):
        assert a.equal(b)  # 2 ranks on Gloo both: the same additions


def torch_ddp(module):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(module)


def _explicit_group(rank, world_size):
    import torch.distributed as dist

    from pycomm.shm import ShmSpaceError

    with pytest.raises(ShmSpaceError, match=rf"rank {rank}: pycomm shm: no space in "
                                            r"/dev/shm: the group's segment needs \d+ bytes"):
        dist.new_group([0, 1], backend="pycomm")
