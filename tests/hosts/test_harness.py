"""The hosts harness itself (pycomm/testing/hosts.py): hosts are distinct machines to the ranks
(hostname, address, pycomm's host identity), the links carry Gloo and are shaped to their
rate, and everything is torn down after a crash, a timeout, an interrupt or a killed run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import pycomm.shm
from pycomm.testing import hosts as hosts_mod
from pycomm.testing.hosts import Hosts, RanksFailed
from tests.support.hosts_fixture import needs_hosts, nothing_left_behind  # noqa: F401
from tests.support.paths import REPO

ROOT = str(REPO)


def _who(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)  # over Gloo, across the bridge
    return {"hostname": socket.gethostname(), "identity": pycomm.shm.host_identity(),
            "sum": t.item(), "local": int(os.environ["LOCAL_RANK"]),
            "master": os.environ["MASTER_ADDR"]}


@needs_hosts
def test_hosts_have_their_own_hostnames_and_reach_each_other():
    with Hosts(2) as hosts:
        results = hosts.run(_who, ranks_per_host=1, timeout=90)
        assert hosts.run_in(1, ["hostname"]).strip() == "host1"
        assert hosts.addr(1) in hosts.run_in(1, ["ip", "-br", "addr", "show", "eth0"])
    values = [r.value for r in results]
    assert [v["hostname"] for v in values] == ["host0", "host1"]
    assert values[0]["identity"] != values[1]["identity"]  # pycomm's same-host test differs
    assert all(v["sum"] == 1.0 and v["master"] == "10.77.0.1" for v in values)
    assert socket.gethostname() not in ("host0", "host1")  # this machine's name untouched


_RATE_GBIT = 0.2
_PAYLOAD = 16 * 2**20


def _send_over_the_link(rank, world_size):
    buf = torch.zeros(_PAYLOAD // 4) if rank else torch.ones(_PAYLOAD // 4)
    dist.barrier()
    start = time.perf_counter()
    if rank == 0:
        dist.send(buf, 1)
    else:
        dist.recv(buf, 0)
        assert bool((buf == 1).all())
    dist.barrier()
    return time.perf_counter() - start


@needs_hosts
def test_a_shaped_link_limits_the_rate():
    with Hosts(2, link_gbit=_RATE_GBIT) as hosts:
        before = hosts.tx_bytes()
        seconds = hosts.run(_send_over_the_link, timeout=90)[1].value
        sent = [a - b for a, b in zip(hosts.tx_bytes(), before)]
    gbit = _PAYLOAD * 8 / seconds / 1e9
    # tbf counts Ethernet frames: the payload rate sits a few % under the link's rate,
    # never above it (the 64 KiB burst is 0.4% of the payload). The lower bound is
    # generous: 2 loaded cores must still move 0.2 Gbit/s through Gloo.
    assert 0.5 * _RATE_GBIT < gbit <= 1.02 * _RATE_GBIT, f"{gbit:.3f} Gbit/s"
    # Host 0 sent the payload (plus headers) across; host 1 only acknowledgements.
    assert _PAYLOAD <= sent[0] < 1.1 * _PAYLOAD and sent[1] < 0.1 * _PAYLOAD, sent


def _crash(rank, world_size):
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.barrier()


@needs_hosts
def test_a_crash_or_a_timeout_reports_every_rank_and_tears_down():
    with Hosts(2) as hosts:
        with pytest.raises(RanksFailed, match=r"(?s)rank 1 \(host 1\): exit 1.*rank 1 fails on "
                                              r"purpose"):
            hosts.run(_crash, group_timeout_s=10,
                      timeout=60)
        start = time.monotonic()
        with pytest.raises(RanksFailed, match=r"(?s)still running after 3 s.*rank 0 \(host "
                                              r"0\): killed at the timeout"):
            hosts.run(["sleep", "600"], timeout=3)  # a command target: no torch to import
        assert time.monotonic() - start < 10
        assert hosts.pids(0) == [] and hosts.pids(1) == []


@needs_hosts
def test_an_interrupt_tears_down():
    with pytest.raises(KeyboardInterrupt), Hosts(3, link_gbit=1.0) as hosts:
        hosts.spawn(1, ["sleep", "600"])
        raise KeyboardInterrupt
    assert not os.path.exists(hosts._uts[1])


@needs_hosts
def test_a_killed_run_is_removed_by_the_next():
    code = ("from pycomm.testing.hosts import Hosts; import sys, time; h = Hosts(2, link_gbit=1.0)"
            ".open(); print(h.prefix, flush=True); time.sleep(600)")
    env = dict(os.environ, PYTHONPATH=ROOT)
    with subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                          text=True) as proc:
        prefix = proc.stdout.readline().strip()
        proc.send_signal(signal.SIGKILL)  # no atexit, no finally
    assert prefix and any(n.startswith(prefix) for n in hosts_mod.netns_names())
    removed = hosts_mod.remove_stale()
    assert {f"{prefix}-0", f"{prefix}-1", f"{prefix}-sw"} <= set(removed), removed
    assert not any(n.startswith(prefix) for n in hosts_mod.netns_names())
    assert not any(f.startswith(prefix) for f in os.listdir(hosts_mod.UTS_DIR))


def test_available_says_why_not_without_root(monkeypatch):
    monkeypatch.setattr(hosts_mod, "_available", None)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert hosts_mod.available() == "needs root (network and UTS namespaces)"
    assert Hosts.available() == "needs root (network and UTS namespaces)"
