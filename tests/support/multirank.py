"""The rank launcher of every multi-rank test: real processes over a real process group.

`run_ranks(fn, world_size, backend, **kwargs)` starts `world_size` processes, each joins a
process group rendezvoused through a FileStore in a fresh temp dir (never a fixed port),
with a timeout on the group, and calls `fn(rank, world_size, **kwargs)`. The first rank
that fails is reported with its traceback; a rank that exits hard fails the run at once;
a run that outlives `deadline_s` is killed and reported with the ranks still alive. The
process group is not destroyed in a `finally`: a healthy rank's "connection closed" would
then hide the real error of the rank that failed; a rank that returns leaves the group
once every rank has (`pycomm.bench.common.leave_group`), and a test's rank that dies on
purpose calls `exit_rank()` so the others do not wait for it. `set_launcher_env` gives a
rank the variables torchrun would, for libraries that read them
(tests/integrations/test_lightning.py, ...).
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pycomm.bench.common import abandon_group, leave_group

# Processes are forked from a forkserver that has already imported torch: about 10x
# cheaper than `spawn` per rank on 2 cores, and as clean (no parent threads inherited).
_START_METHOD = "forkserver"
_PRELOAD = ["torch", "torch.distributed", "pycomm"]


_STORE: dist.Store | None = None  # the rank's store, for exit_rank


class RankFailed(RuntimeError):
    """A rank raised, exited hard, or the run outlived its deadline."""


def _entry(rank: int, fn: Callable, world_size: int, backend: str | None, store_path: str,
           group_timeout_s: float, threads: int, kwargs: dict[str, Any]) -> None:
    torch.set_num_threads(threads)
    if backend is None:  # fn joins a group itself (a script as torchrun would run it)
        fn(rank, world_size, **kwargs)
        if dist.is_initialized():
            dist.destroy_process_group()
        return
    global _STORE
    store = _STORE = dist.FileStore(store_path, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=group_timeout_s))
    fn(rank, world_size, **kwargs)
    leave_group(store, rank, world_size, group_timeout_s)


def exit_rank() -> None:
    """End this rank now with exit code 0, which lets the other ranks go on: a crash the
    launcher does not report, for tests of how the others fail. The others do not wait
    for it once they are done (bench.common.leave_group)."""
    abandon_group(_STORE, dist.get_rank(), dist.get_world_size())
    os._exit(0)


def run_ranks(fn: Callable, world_size: int = 2, backend: str | None = "gloo", *,
              group_timeout_s: float = 60.0, deadline_s: float = 300.0, threads: int = 1,
              **kwargs: Any) -> None:
    """Run module-level `fn(rank, world_size, **kwargs)` on `world_size` ranks; raise on failure.

    `backend=None`: no group is made for `fn`, which joins one itself (with
    `set_launcher_env`'s variables, as a script under torchrun does)."""
    ctx = mp.get_context(_START_METHOD)
    if _START_METHOD == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory(prefix="pycomm-ranks-") as tmp:
        args = (fn, world_size, backend, os.path.join(tmp, "store"), group_timeout_s, threads,
                kwargs)
        procs = mp.start_processes(_entry, args=args, nprocs=world_size, join=False,
                                   start_method=_START_METHOD)
        deadline = time.monotonic() + deadline_s
        try:
            while not procs.join(timeout=0.2):
                if time.monotonic() > deadline:
                    alive = [r for r, p in enumerate(procs.processes) if p.is_alive()]
                    raise RankFailed(f"{getattr(fn, '__name__', fn)}: ranks {alive} still "
                                     f"running after {deadline_s:.0f} s; killed them")
        except mp.ProcessRaisedException as e:
            raise RankFailed(f"rank {e.error_index} raised:\n{e}") from None
        except mp.ProcessExitedException as e:
            raise RankFailed(f"rank {e.error_index} exited with code {e.exit_code} "
                             f"({'signal ' + e.signal_name if e.signal_name else 'no signal'})"
                             ) from None
        finally:
            for p in procs.processes:
                if p.is_alive():
                    p.kill()
                    p.join()


def free_port() -> int:
    """A TCP port free on this host now (the OS picks it), for a test to hand its ranks."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_launcher_env(rank: int, world_size: int, port: int) -> None:
    """The variables torchrun would set, for libraries that read them (Lightning,
    Accelerate, the HF Trainer) in a rank of run_ranks. The process group already exists
    (FileStore), and those libraries keep it; MASTER_PORT is a port found free at run
    time, so that nothing falls back to a fixed default."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), NODE_RANK="0", GROUP_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS=str(torch.get_num_threads()))
