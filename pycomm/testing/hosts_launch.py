"""Ranks inside pycomm's hosts (pycomm/testing/hosts.py): what each rank runs, with which
variables, and how a run is waited on and reported. The topology lives in hosts.py.

Each rank is a fresh Python process entered into its host (`ip netns exec`, then
`nsenter --uts`), with torchrun's variables: RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK (= the host), MASTER_ADDR/MASTER_PORT (host 0's address: rank
0 serves the TCPStore there, as on a cluster) and GLOO_SOCKET_IFNAME=eth0. A function
target runs through `python -m pycomm.testing.hosts_launch`, which makes the env:// Gloo group,
calls it and pickles what it returned; stdout and stderr go to files, so a test can watch
a rank's progress (`Launch.output`) and a failure reports every rank's tail.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:
    from .hosts import Hosts

# the folder holding the pycomm package (pycomm/testing/hosts_launch.py: three up)
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TAIL_CHARS = 2000


class RanksFailed(RuntimeError):
    """A rank exited non-zero, or the run outlived its timeout; says what every rank did."""


@dataclasses.dataclass
class RankResult:
    rank: int
    host: int
    returncode: Optional[int]  # None: still running when the run timed out (then killed)
    elapsed_s: float           # from the start of the run to this rank's exit
    stdout: str
    stderr: str
    value: Any = None          # what a function target returned

    def describe(self) -> str:
        state = ("killed at the timeout" if self.returncode is None
                 else f"exit {self.returncode}")
        tail = self.stderr[-_TAIL_CHARS:].rstrip() or "(no stderr)"
        return f"--- rank {self.rank} (host {self.host}): {state} after " \
               f"{self.elapsed_s:.1f} s\n{tail}"


@dataclasses.dataclass
class _Spec:
    rank: int
    host: int
    argv: list[str]
    env: dict[str, str]
    base: str                  # path prefix of this rank's .out, .err (and .pkl) files
    returns_value: bool


def _target_name(target: Union[Callable[..., Any], str]) -> tuple[str, str]:
    """("module:qualname", the sys.path entry that imports the module)."""
    if isinstance(target, str):
        return target, ""
    module = sys.modules[target.__module__]
    path = os.path.abspath(module.__file__)
    for _ in target.__module__.split("."):
        path = os.path.dirname(path)
    return f"{target.__module__}:{target.__qualname__}", path


def rank_specs(hosts: Hosts, target: Any, ranks_per_host: int, port: int,
               kwargs: dict, group_timeout_s: float, extra_env: dict, tmp: str
               ) -> list[_Spec]:
    world = hosts.n * ranks_per_host
    is_command = not (callable(target) or isinstance(target, str))
    if not is_command:
        name, import_root = _target_name(target)
        with open(os.path.join(tmp, "kwargs.pkl"), "wb") as f:
            pickle.dump(kwargs, f)
    pythonpath = os.pathsep.join(p for p in [_ROOT, "" if is_command else import_root,
                                             os.environ.get("PYTHONPATH", "")] if p)
    specs = []
    for host in range(hosts.n):
        for local in range(ranks_per_host):
            rank = host * ranks_per_host + local
            env = dict(os.environ, PYTHONPATH=pythonpath, RANK=str(rank),
                       WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                       LOCAL_WORLD_SIZE=str(ranks_per_host), GROUP_RANK=str(host),
                       NODE_RANK=str(host), MASTER_ADDR=hosts.addr(0),
                       MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="eth0",
                       OMP_NUM_THREADS="1", **{k: str(v) for k, v in extra_env.items()})
            base = os.path.join(tmp, f"rank{rank}")
            argv = [str(a) for a in target] if is_command else [
                sys.executable, "-m", "pycomm.testing.hosts_launch", name,
                os.path.join(tmp, "kwargs.pkl"), base + ".pkl", str(group_timeout_s)]
            specs.append(_Spec(rank, host, hosts.exec_argv(host, argv), env, base,
                               not is_command))
    return specs


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


class Launch:
    """Ranks started by `Hosts.start`; `wait()` collects them."""

    def __init__(self, hosts: Hosts, target: Any, ranks_per_host: int, port: int,
                 kwargs: dict, group_timeout_s: float, env: dict):
        self.hosts = hosts
        self._tmp = tempfile.TemporaryDirectory(prefix="pycomm-hosts-")
        self.specs = rank_specs(hosts, target, ranks_per_host, port, kwargs,
                                group_timeout_s, env, self._tmp.name)
        self.t0 = time.monotonic()
        self.procs = []
        for spec in self.specs:
            with open(spec.base + ".out", "w") as out, open(spec.base + ".err", "w") as err:
                self.procs.append(subprocess.Popen(spec.argv, env=spec.env, stdout=out,
                                                   stderr=err, stdin=subprocess.DEVNULL))
        self._exit_at: dict[int, float] = {}

    def output(self, rank: int) -> str:
        """Rank `rank`'s stdout so far."""
        return _read(self.specs[rank].base + ".out")

    def wait_for_output(self, rank: int, text: str, timeout: float = 60.0) -> None:
        """Block until rank `rank` printed `text`; if it exits first or time runs out,
        kill every rank and raise RanksFailed with what each did."""
        deadline = time.monotonic() + timeout
        while text not in self.output(rank):
            if self.procs[rank].poll() is not None or time.monotonic() > deadline:
                raise RanksFailed(f"rank {rank} never printed {text!r}\n" +
                                  "\n".join(r.describe() for r in self._results(kill=True)))
            time.sleep(0.02)

    def _poll(self) -> bool:
        now = time.monotonic()
        for rank, p in enumerate(self.procs):
            if rank not in self._exit_at and p.poll() is not None:
                self._exit_at[rank] = now - self.t0
        return len(self._exit_at) == len(self.procs)

    def _results(self, kill: bool) -> list[RankResult]:
        self._poll()
        if kill:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        results = []
        for spec, p in zip(self.specs, self.procs):
            value = None
            done = spec.rank in self._exit_at
            if done and p.returncode == 0 and spec.returns_value:
                with open(spec.base + ".pkl", "rb") as f:
                    value = pickle.load(f)
            results.append(RankResult(
                spec.rank, spec.host, p.returncode if done else None,
                self._exit_at.get(spec.rank, time.monotonic() - self.t0),
                _read(spec.base + ".out"), _read(spec.base + ".err"), value))
        return results

    def _close(self) -> None:
        self._tmp.cleanup()

    def wait(self, timeout: float = 120.0, check: bool = True) -> list[RankResult]:
        """Every rank's RankResult once all exited; ranks alive at `timeout` seconds from
        the start are killed and the run raises RanksFailed (whatever `check`)."""
        deadline = self.t0 + timeout
        while not self._poll():
            if time.monotonic() > deadline:
                results = self._results(kill=True)
                self._close()
                raise RanksFailed(f"ranks still running after {timeout:.0f} s, killed:\n" +
                                  "\n".join(r.describe() for r in results))
            time.sleep(0.05)
        results = self._results(kill=False)
        self._close()
        if check and any(r.returncode != 0 for r in results):
            raise RanksFailed("a rank failed:\n" + "\n".join(r.describe() for r in results))
        return results


def _main(name: str, kwargs_path: str, result_path: str, group_timeout_s: str) -> None:
    import torch
    import torch.distributed as dist

    from pycomm.bench.common import leave_group

    torch.set_num_threads(1)
    module, qualname = name.split(":")
    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    with open(kwargs_path, "rb") as f:
        kwargs = pickle.load(f)
    dist.init_process_group("gloo", init_method="env://",
                            timeout=datetime.timedelta(seconds=float(group_timeout_s)))
    value = fn(dist.get_rank(), dist.get_world_size(), **kwargs)
    # Written before the group goes: a peer's slower teardown cannot lose the result.
    with open(result_path + ".tmp", "wb") as f:
        pickle.dump(value, f)
    os.replace(result_path + ".tmp", result_path)
    leave_group(dist.distributed_c10d._get_default_store(), dist.get_rank(),
                dist.get_world_size(), float(group_timeout_s))


if __name__ == "__main__":
    _main(*sys.argv[1:])
