"""What every benchmark shares: getting ranks (local spawn or torchrun's env://) and the
header lines. Benchmarks themselves are `run(config) -> result` on an initialized group."""

from __future__ import annotations

import datetime
import os
import platform
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .._version import __version__


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _rank_entry(rank: int, body: Callable, nproc: int, backend: str, store_path: str,
                timeout_s: float, args: Any) -> None:
    store = dist.FileStore(store_path, nproc)
    _init(backend, timeout_s, rank=rank, world_size=nproc, store=store)
    body(args)
    dist.destroy_process_group()


def _init(backend: str, timeout_s: float, **kw: Any) -> None:
    if backend == "nccl":
        torch.cuda.set_device(kw.get("rank", int(os.environ.get("LOCAL_RANK", 0))))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)


def launch(body: Callable[[Any], None], args: Any, nproc: int, backend: str,
           timeout_s: float = 300.0) -> None:
    """Run `body(args)` on every rank: under torchrun in this process, else on `nproc`
    spawned local ranks rendezvoused through a FileStore in a temp dir."""
    if under_torchrun():
        _init(backend, timeout_s)
        body(args)
        dist.destroy_process_group()
        return
    with tempfile.TemporaryDirectory(prefix="pycomm-bench-") as tmp:
        mp.start_processes(_rank_entry, nprocs=nproc, start_method="spawn",
                           args=(body, nproc, backend, os.path.join(tmp, "store"), timeout_s,
                                 args))


def header(title: str, **fields: Any) -> str:
    device = (torch.cuda.get_device_name() if dist.get_backend() == "nccl"
              else f"cpu ({platform.processor() or platform.machine()})")
    meta = " | ".join(f"{k} {v}" for k, v in fields.items())
    return (f"# pycomm {__version__} | torch {torch.__version__} | backend {dist.get_backend()}"
            f" | world {dist.get_world_size()} | {device}\n# {title} | {meta}")
