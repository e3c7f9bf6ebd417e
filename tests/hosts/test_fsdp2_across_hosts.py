"""torch's FSDP2 (fully_shard) across real hosts (network namespaces, pycomm/testing/hosts.py)
on a hierarchical "pycomm" group, 2 hosts x 2 ranks: its all-gathers and reduce-scatters
run the hierarchy's pipelines (Note [Hierarchical reduce-scatter and all-gather] in
csrc/shm/hier.h), and a group made with pycomm.shm.Options(wire="bf16") sends its gradient
reduce-scatters across hosts in bf16 with float32 sums (Note [A group's wire]).

What a backward sends: with reshard_after_forward=False a backward all-gathers nothing, so
what crosses a host's link during it is the reduce-scatter of each gradient, (H-1)/H of
them per host in float32; the bf16 wire halves it. Counted on the host's interface from
inside the host (/proc/net/dev is per network namespace), headers included."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

import pycomm.shm
from pycomm.testing.hosts import Hosts
from tests.support.hosts_fixture import needs_hosts, nothing_left_behind  # noqa: F401

pytestmark = needs_hosts

WIDTH, LAYERS, BACKWARDS = 512, 4, 5


def _tx_bytes() -> int:
    """This network namespace's eth0: bytes sent so far."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == "eth0":
                return int(counters.split()[8])
    raise AssertionError("no eth0 in /proc/net/dev")


def _model(group):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model


def _fsdp2(rank, world):
    gloo = dist.new_group(backend="gloo")
    out = {}
    for name, group in (("gloo", gloo),
                        ("fp32", dist.new_group(backend="pycomm")),
                        ("bf16", dist.new_group(backend="pycomm",
                                                pg_options=pycomm.shm.Options(wire="bf16")))):
        model = _model(group)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):  # a few steps, against FSDP2 on Gloo below
            opt.zero_grad()
            model(torch.randn(16, WIDTH, generator=g)).square().mean().backward()
            opt.step()
        params = [p.full_tensor() for p in model.parameters()]
        # the bytes of backwards alone (forward all-gathers, and reshards after backward):
        # each count between barriers, so that no rank of the host starts its backward
        # before the count begins or its next forward's all-gathers before it ends (without
        # them, counts up to 0.26 MB high were seen); the median of a few
        sent = []
        for _ in range(BACKWARDS):
            loss = model(torch.randn(16, WIDTH, generator=g)).square().mean()
            dist.barrier(gloo)
            before = _tx_bytes()
            dist.barrier(gloo)
            loss.backward()
            dist.barrier(gloo)
            sent.append(_tx_bytes() - before)
            dist.barrier(gloo)
        out[name] = (params, statistics.median(sent))
        if name != "gloo":
            assert pycomm.shm.hierarchy(group)["hosts"] == 2
    for name, tol in (("fp32", 1e-5), ("bf16", 2e-2)):
        for a, b in zip(out[name][0], out["gloo"][0]):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=name)
    return {name: sent for name, (_, sent) in out.items()}


def test_fsdp2_across_hosts_with_the_bf16_wire():
    with Hosts(2) as hosts:
        values = [r.value for r in hosts.run(_fsdp2, ranks_per_host=2, timeout=240,
                                             group_timeout_s=60)]
    params = LAYERS * (WIDTH * WIDTH + WIDTH)
    gradients = (2 - 1) / 2 * 4 * params  # what leaves a host per backward, float32
    for rank in (0, 2):  # a rank of each host counted its host's link
        sent = values[rank]
        assert gradients <= sent["fp32"] <= 1.06 * gradients, (rank, sent, gradients)
        assert sent["bf16"] <= 0.52 * sent["fp32"], (rank, sent)
