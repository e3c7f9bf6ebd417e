"""Where torch 2.13's DDP has a precise semantics that users depend on, pycomm's matches it
value for value and exception type for exception type, against torch's DDP on the same
inputs (2 Gloo ranks): buffers at construction with broadcast_buffers=False, which
forwards synchronize buffers, activation checkpointing (reentrant or not, with
static_graph and find_unused_parameters), and requires_grad changed after construction.

Values are compared bitwise: at 2 ranks every reduced element is one sum of two terms,
the same whichever transport or bucket layout adds them."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from tests.support.ddp_models import build, lockstep, loss_of, make_input
from tests.support.multirank import run_ranks


def _make_buffers_rank_local(module: torch.nn.Module, rank: int) -> None:
    with torch.no_grad():
        for b in module.buffers():
            b.fill_(rank + 1 if b.is_floating_point() else 10 * (rank + 1))


def _assert_buffers_equal(ref: torch.nn.Module, ours: torch.nn.Module, what: str) -> None:
    for (name, x), (_, y) in zip(ref.named_buffers(), ours.named_buffers()):
        assert torch.equal(x, y), f"{what}: buffer {name}: torch {x.flatten()[:3].tolist()} " \
                                  f"vs pycomm {y.flatten()[:3].tolist()}"


def _assert_grads_equal(ref: torch.nn.Module, ours: torch.nn.Module, what: str) -> None:
    for (name, x), y in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(x.grad, y.grad), f"{what}: grad of {name}"


def _wrap_pair(rank: int, **kwargs):
    base = build("convbn")
    _make_buffers_rank_local(base, rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's broadcast_buffers notice
        ref = TorchDDP(copy.deepcopy(base), **kwargs)
    if "broadcast_buffers" in kwargs:  # pycomm says so too (the same category)
        with pytest.warns(FutureWarning, match="broadcast_buffers"):
            ours = pycomm.DistributedDataParallel(copy.deepcopy(base), **kwargs)
    else:
        ours = pycomm.DistributedDataParallel(copy.deepcopy(base), **kwargs)
    return ref, ours


def _buffers_at_construction(rank, world_size, kwargs, rank_local):
    ref, ours = _wrap_pair(rank, **kwargs)
    _assert_buffers_equal(ref.module, ours.module, f"{kwargs} after construction")
    mean = ours.module.bn.running_mean.clone()
    dist.all_reduce(mean, op=dist.ReduceOp.MAX)
    # rank_local: each rank kept its own statistics (so the test can tell); else rank 0's.
    assert torch.equal(mean, ours.module.bn.running_mean) != (rank_local and rank == 0)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    for step in range(3):
        for ddp, opt in zip((ref, ours), opts):
            opt.zero_grad()
            loss_of(ddp(make_input("convbn", rank, step))).backward()
            opt.step()
        _assert_grads_equal(ref.module, ours.module, f"{kwargs} step {step}")
        _assert_buffers_equal(ref.module, ours.module, f"{kwargs} step {step}")


@pytest.mark.parametrize("kwargs, rank_local", [
    ({}, False),
    ({"broadcast_buffers": False}, True),
    ({"forward_sync_buffers": False}, False),
    ({"broadcast_buffers": False, "forward_sync_buffers": True}, False),
], ids=["default", "broadcast_buffers_false", "forward_sync_false", "both"])
def test_construction_broadcasts_buffers_exactly_when_torch_does(kwargs, rank_local):
    run_ranks(_buffers_at_construction, 2, kwargs=kwargs, rank_local=rank_local)


def _forward_buffer_sync(rank, world_size):
    """Gradient accumulation (two no_sync micro-batches, then a synchronizing one) and a
    torch.no_grad() forward in train mode, BatchNorm statistics compared after every
    forward: only a forward that follows a synchronizing one broadcasts rank 0's."""
    ref, ours = _wrap_pair(rank)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    for step in range(3):
        phases = ("no_sync", "no_sync", "no_grad", "sync") if step != 1 else (
            "no_grad", "no_sync", "sync")
        for i, phase in enumerate(phases):
            x = make_input("convbn", rank, 10 * step + i)
            for ddp in (ref, ours):
                if phase == "no_grad":
                    with torch.no_grad():
                        ddp(x)
                elif phase == "no_sync":
                    with ddp.no_sync():
                        loss_of(ddp(x)).backward()
                else:
                    loss_of(ddp(x)).backward()
            _assert_buffers_equal(ref.module, ours.module, f"step {step} {i}: {phase}")
        _assert_grads_equal(ref.module, ours.module, f"step {step}")
        for opt in opts:
            opt.step()
            opt.zero_grad()


def test_buffers_sync_only_after_a_synchronizing_forward():
    run_ranks(_forward_buffer_sync, 2)


# ---- activation checkpointing ---------------------------------------------------------

@pytest.mark.parametrize("model, kwargs", [
    ("ckpt_reentrant_shared", {"static_graph": True}),
    # torch 2.13's own DDP fails an internal assert on a no_sync backward through
    # reentrant checkpoints with static_graph ("expect_autograd_hooks_"): the oracle with
    # accumulation is the module averaged by hand.
    ("ckpt_reentrant_shared", {"static_graph": True, "no_sync_every": 1, "manual": True}),
    ("ckpt_reentrant", {}),
    ("ckpt_reentrant", {"static_graph": True}),
    ("ckpt_shared", {}),
    ("ckpt_shared", {"static_graph": True}),
    ("ckpt_shared", {"find_unused_parameters": True}),
], ids=["reentrant_twice_static", "reentrant_twice_static_no_sync", "reentrant",
        "reentrant_static", "nonreentrant_twice", "nonreentrant_twice_static",
        "nonreentrant_twice_find_unused"])
def test_activation_checkpointing_matches_torch(model, kwargs):
    run_ranks(_checkpointed_lockstep, 2, model=model, kwargs=kwargs)


def _checkpointed_lockstep(rank, world_size, model, kwargs):
    # One bucket per parameter: buckets launch between (and inside) the nested backwards;
    # 4 steps (static_graph's first step is its own code path).
    lockstep(rank, model, steps=4, exact=True, bucket_cap_mb=1e-5, **kwargs)


def _checkpoint_refused(rank, world_size, model, kwargs, match):
    base = build(model)
    for cls in (TorchDDP, pycomm.DistributedDataParallel):
        ddp = cls(copy.deepcopy(base), **kwargs)
        loss = loss_of(ddp(make_input("mlp", rank, 0)))
        with pytest.raises(RuntimeError, match=match if cls is not TorchDDP else None):
            loss.backward()


@pytest.mark.parametrize("kwargs", [{}, {"find_unused_parameters": True}],
                         ids=["plain", "find_unused"])
def test_reentrant_reuse_without_static_graph_raises_in_backward_like_torch(kwargs):
    # torch raises a RuntimeError in the backward where the second hook fires; so does
    # pycomm, naming the parameter and the way out.
    run_ranks(_checkpoint_refused, 2, model="ckpt_reentrant_shared", kwargs=kwargs,
              match=r"block\.(weight|bias) was marked ready twice.*static_graph=True")


def _requires_grad_changed(rank, world_size):
    base = build("mlp")
    ref = TorchDDP(copy.deepcopy(base))
    ours = pycomm.DistributedDataParallel(copy.deepcopy(base))
    for ddp in (ref, ours):
        loss_of(ddp(make_input("mlp", rank, 0))).backward()
        ddp.module.net[0].weight.requires_grad_(False)
    # torch: the next backward leaves the frozen parameter's bucket unfinished, and the
    # forward after it raises a RuntimeError.
    loss_of(ref(make_input("mlp", rank, 1))).backward()
    with pytest.raises(RuntimeError):
        ref(make_input("mlp", rank, 2))
    # pycomm refuses the first forward after the change, naming the parameter; the same
    # exception type, so code written for torch's DDP catches it.
    with pytest.raises(RuntimeError, match=r"net\.0\.weight no longer requires grad"):
        ours(make_input("mlp", rank, 1))


def test_requires_grad_changed_raises_runtime_error_like_torch():
    run_ranks(_requires_grad_changed, 2)


def _frozen_under_static_graph(rank, world_size):
    # static_graph learns its unused set in the first step and walks the graph no more, so
    # even with find_unused_parameters a parameter frozen later is never marked unused:
    # the forward after the change names it (not finalize, with a bucket left waiting).
    ours = pycomm.DistributedDataParallel(build("mlp"), static_graph=True,
                                          find_unused_parameters=True)
    for step in range(2):
        loss_of(ours(make_input("mlp", rank, step))).backward()
    ours.module.net[0].weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"net\.0\.weight no longer requires grad.*"
                                           r"without static_graph"):
        ours(make_input("mlp", rank, 2))
    # frozen before the first step, it is in the unused set static_graph learns there
    early = pycomm.DistributedDataParallel(build("mlp"), static_graph=True,
                                           find_unused_parameters=True)
    early.module.net[0].weight.requires_grad_(False)
    for step in range(3):
        early.zero_grad()
        loss_of(early(make_input("mlp", rank, step))).backward()
        assert early.module.net[0].weight.grad is None
        assert early.module.net[0].bias.grad is not None


def test_frozen_after_wrapping_under_static_graph_is_named():
    run_ranks(_frozen_under_static_graph, 2)


def _frozen_with_find_unused(rank, world_size):
    # With find_unused_parameters torch's DDP finds a parameter frozen after wrapping
    # unused, and trains on: its gradient stays as zero_grad left it. So does pycomm's.
    base = build("mlp")
    ref = TorchDDP(copy.deepcopy(base), find_unused_parameters=True)
    ours = pycomm.DistributedDataParallel(copy.deepcopy(base), find_unused_parameters=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    for step in range(6):
        for ddp, opt in zip((ref, ours), opts):
            ddp.module.net[0].weight.requires_grad_(step % 2 == 0)
            opt.zero_grad()
            loss_of(ddp(make_input("mlp", rank, step))).backward()
            opt.step()
        assert (ours.module.net[0].weight.grad is None) == (step % 2 == 1), step
        for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
            torch.testing.assert_close(p, q, msg=f"step {step}: {name}")


def test_frozen_after_wrapping_trains_on_with_find_unused_like_torch():
    run_ranks(_frozen_with_find_unused, 2)
