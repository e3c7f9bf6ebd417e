"""pycomm across hosts (pycomm/testing/hosts.py): its DDP against torch's on the same Gloo group,
2 hosts x 1 rank and 2 hosts x 2 ranks, with the shared-memory path found per host and
never across; join, a comm hook and the overlap trace across hosts; the collectives
benchmark and torchrun across hosts."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
import pycomm.shm
from pycomm.testing.hosts import Hosts
from tests.support.ddp_models import assert_same, build, loss_of, make_input, train_against
from tests.support.hosts_fixture import needs_hosts, nothing_left_behind  # noqa: F401
from tests.support.paths import REPO

pytestmark = needs_hosts
ROOT = str(REPO)


def _groups(rank, world_size):
    """Which groups pycomm's shared-memory detection gives: None for the world (it spans
    hosts), a "pycomm" group for the ranks of one host, and for a "pycomm" group asked
    across hosts a hierarchical one (here one rank per host)."""
    per_host = int(os.environ["LOCAL_WORLD_SIZE"])
    host = rank // per_host
    mine = None
    for h in range(world_size // per_host):  # new_group is collective over the world
        g = dist.new_group(list(range(h * per_host, (h + 1) * per_host)))
        mine = g if h == host else mine
    local = pycomm.shm.same_host_group(mine) if per_host > 1 else None
    across = None
    if per_host > 1 and rank in (per_host - 1, per_host):  # last of host 0, first of host 1
        across = pycomm.shm.hierarchy(dist.new_group(
            [per_host - 1, per_host], backend="pycomm", use_local_synchronization=True))
    return {"world": pycomm.shm.same_host_group(dist.group.WORLD),
            "by_host": pycomm.shm.ranks_by_host(dist.group.WORLD),
            "local": None if local is None else dist.get_backend(local), "across": across}


def _ddp_against_torch(rank, world_size, steps=3):
    found = _groups(rank, world_size)
    base = build("mlp")
    ref = TorchDDP(copy.deepcopy(base))
    # The flat path (hierarchical_allreduce=False): with several ranks per host the
    # default is the hierarchical all-reduce, tested in
    # tests/hosts/test_hierarchical_across_hosts.py.
    ours = pycomm.DistributedDataParallel(
        copy.deepcopy(base), config=pycomm.DDPConfig(hierarchical_allreduce=False))
    # Both all-reduce one bucket of the same size with Gloo's same algorithm on the same
    # group (pycomm's DDP falls back to the Gloo world group across hosts), and both scale
    # by 1/world before the sum: the same additions in the same order, so bitwise equal at
    # 2 ranks and at 4.
    train_against(ref, ours, rank, steps, exact=True)
    return {**found, "gradient_backend": dist.get_backend(ours.gradient_group),
            "gradient_is_world": ours.gradient_group is ours.process_group}


def test_ddp_two_hosts_one_rank_each_equals_torch():
    with Hosts(2) as hosts:
        values = [r.value for r in hosts.run(_ddp_against_torch, timeout=120,
                                             group_timeout_s=30)]
    for v in values:
        assert v["world"] is None and v["gradient_backend"] == "gloo" and v["gradient_is_world"]
        assert v["by_host"] == [("10.77.0.1", "host0: rank 0"), ("10.77.0.2", "host1: rank 1")]


def test_ddp_two_hosts_two_ranks_each_uses_shared_memory_only_within_a_host():
    with Hosts(2) as hosts:
        values = [r.value for r in hosts.run(_ddp_against_torch, ranks_per_host=2,
                                             timeout=180, group_timeout_s=60)]
    for rank, v in enumerate(values):
        # Within a host the shared-memory group forms; across hosts it never does: with
        # the hierarchical path off, DDP reduces over the Gloo world group.
        assert v["local"] == "pycomm", (rank, v)
        assert v["world"] is None and v["gradient_backend"] == "gloo", (rank, v)
        assert v["by_host"] == [("10.77.0.1", "host0: ranks 0, 1"),
                                ("10.77.0.2", "host1: ranks 2, 3")], (rank, v)
    for rank in (1, 2):  # a "pycomm" group of ranks 1 and 2 spans the two hosts
        assert values[rank]["across"] == {"host": rank - 1, "hosts": 2, "local_rank": 0,
                                          "ranks_per_host": 1}, values[rank]


def _join_hook_and_trace(rank, world_size, trace_path):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    # World 2 throughout: a 2-term sum and a 1/2 scale are exact in any order, so
    # pycomm's DDP equals torch's bitwise (fp16 compression rounds alike in both).
    for hook, uneven in ((None, True), (fp16_compress_hook, False)):
        base = build("mlp")
        models = [TorchDDP(copy.deepcopy(base)),
                  pycomm.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=1e-3)]
        for m in models:
            if hook is not None:
                m.register_comm_hook(None, hook)
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            with m.join(enable=uneven):
                for step in range(2 + 2 * rank if uneven else 3):  # host 1 runs 2 more
                    opt.zero_grad()
                    loss_of(m(make_input("mlp", rank, step))).backward()
                    opt.step()
        assert_same(models[0], models[1], f"hook={hook} join={uneven}", exact=True,
                    grads=False)
    ours = models[1]
    reports = ours.step_reports(3)
    assert len(reports) == 3 and all(len(r.buckets) > 1 for r in reports)
    written = ours.export_chrome_trace(trace_path, all_ranks=True, align="step")
    return {"written": written, "buckets": len(reports[-1].buckets)}


def test_join_comm_hook_and_step_aligned_trace_across_hosts(tmp_path):
    trace = tmp_path / "trace.json"
    with Hosts(2) as hosts:
        values = [r.value for r in hosts.run(_join_hook_and_trace, timeout=120,
                                             kwargs={"trace_path": str(trace)},
                                             group_timeout_s=30)]
    assert values[0]["written"] == str(trace) and values[1]["written"] is None
    events = json.loads(trace.read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    # Both hosts' ranks in one file, each rank's first backward at 0 (align="step").
    for rank in (0, 1):
        mine = [e for e in slices if e["pid"] == rank]
        assert min(e["ts"] for e in mine) == 0.0, rank
        assert sum(e["name"].startswith("all_reduce") for e in mine) == \
            3 * values[0]["buckets"]


def test_collectives_benchmark_across_hosts(tmp_path):
    report = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "pycomm.bench", "collectives", "all_reduce", "--backend",
           "gloo", "-b", "1K", "-e", "1M", "-f", "32", "-w", "1", "-n", "3", "--json",
           str(report)]
    with Hosts(2) as hosts:
        before = hosts.tx_bytes()
        results = hosts.run(cmd, timeout=120)
        sent = [a - b for a, b in zip(hosts.tx_bytes(), before)]
    out = results[0].stdout
    assert "# Out of bounds values : 0 OK" in out and "world 2" in out, out
    assert json.loads(report.read_text())  # rank 0 wrote it
    # Each host sent at least one 1 MiB all-reduce's half (2 ranks: S/2 each way, per call)
    # across the link: the benchmark's traffic really crossed hosts.
    assert min(sent) > 2**20 // 2, sent


def test_torchrun_across_hosts_runs_the_example(tmp_path):
    """Two torchrun agents, one per host, c10d rendezvous on host 0. Should the run stall,
    every Python process in both hosts dumps its threads' stacks (faulthandler, SIGABRT)
    and the failure shows both hosts' output, the agents' INFO log included: where it
    stopped, not only that it did."""
    import signal
    import subprocess

    logs = [tmp_path / f"host{h}.log" for h in range(2)]
    with Hosts(2) as hosts:
        procs = []
        for host in range(2):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                    "--node-rank", str(host), "--nproc-per-node", "1", "--rdzv-backend",
                    "c10d", "--rdzv-endpoint", f"{hosts.addr(0)}:29400", "--local-addr",
                    hosts.addr(host), "examples/train.py", "--epochs", "2"]
            env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1",
                       LOGLEVEL="INFO", PYTHONFAULTHANDLER="1",
                       PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
            with open(logs[host], "w") as log:
                procs.append(hosts.spawn(host, argv, cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 180
        try:
            for p in procs:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for host in range(2):
                for pid in hosts.pids(host):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGABRT)
            time.sleep(2)
    for p in procs:  # the hosts' teardown killed what was left
        p.wait()
    outs = [log.read_text(errors="replace") for log in logs]
    report = "".join(f"\n--- host {h} (exit {p.returncode}) ---\n{out[-12000:]}"
                     for h, (p, out) in enumerate(zip(procs, outs)))
    assert all(p.returncode == 0 for p in procs), report
    assert "replicas identical" in outs[0] and "2 ranks" in outs[0], report
    assert outs[0].count("epoch ") >= 2, report
