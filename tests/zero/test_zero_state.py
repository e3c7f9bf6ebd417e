"""pycomm.ZeroRedundancyOptimizer beyond the step: clipping by the global norm from the
shards, the state dicts (consolidated, sharded, onto another world size), reading the
model between steps with the all-gathers still pending, optimizer memory per rank, and
the errors for bad input. References are pycomm's DDP and torch's DDP with the same
optimizer unsharded."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from pycomm import adam_step
from pycomm.zero import layout as shard_layout
from tests.support.ddp_models import build, loss_of, make_input
from tests.support.multirank import run_ranks

CAP = 5e-4  # MB: the MLP in several buckets


def _ddp(base, **options):
    return pycomm.DistributedDataParallel(copy.deepcopy(base),
                                          config=pycomm.DDPConfig(bucket_cap_mb=CAP, **options))


def _pair(base, **options):
    """(sharded DDP, its ZeroRedundancyOptimizer, plain DDP, its AdamW) over copies of
    `base`, AdamW lr 1e-2 both."""
    ddp = _ddp(base)
    zero = pycomm.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-2,
                                          **options)
    plain = _ddp(base)
    return ddp, zero, plain, torch.optim.AdamW(plain.parameters(), lr=1e-2)


def _train(ddp, opt, rank, steps, first=0, clip=None):
    norms = []
    for step in range(first, first + steps):
        opt.zero_grad()
        loss_of(ddp(make_input("mlp", rank, step))).backward()
        if clip is not None:
            norms.append(clip())
        opt.step()
    return norms


def _clipping(rank, world_size):
    base = build("mlp")
    ref = TorchDDP(copy.deepcopy(base))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    want = _train(ref, ref_opt, rank, 8,
                  clip=lambda: torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01))
    for how in ("ddp", "pycomm"):
        ddp = _ddp(base)
        zero = pycomm.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-2)
        clip = (lambda d=ddp: d.clip_grad_norm_(0.01)) if how == "ddp" else (
            lambda d=ddp: pycomm.clip_grad_norm_(d.parameters(), 0.01))
        got = _train(ddp, zero, rank, 8, clip=clip)
        assert all(w > 0.01 for w in want), "the test must clip"
        torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-6, atol=0)
        for p, q in zip(ddp.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


class _Scaled(torch.nn.Module):
    """The MLP times a 0-dim learnable scale (as CLIP's logit_scale)."""

    def __init__(self):
        super().__init__()
        self.mlp = build("mlp")
        self.scale = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.mlp(x) * self.scale


def _subset_and_scalar(rank, world_size):
    """Clipping a subset clips that subset, with its own norm; a 0-dim parameter's state
    goes through the consolidated dict and back."""
    torch.manual_seed(5)
    base = _Scaled()
    ref = TorchDDP(copy.deepcopy(base))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ddp = _ddp(base)
    zero = pycomm.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-2)

    def subset(m):
        return list(m.module.mlp.net[2].parameters()) + [m.module.scale]

    want = _train(ref, ref_opt, rank, 4,
                  clip=lambda: torch.nn.utils.clip_grad_norm_(subset(ref), 1e-3))
    got = _train(ddp, zero, rank, 4, clip=lambda: pycomm.clip_grad_norm_(subset(ddp), 1e-3))
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-6, atol=0)
    for p, q in zip(ddp.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    zero.consolidate_state_dict(to=0)
    consolidated = [zero.state_dict() if rank == 0 else None]
    torch.distributed.broadcast_object_list(consolidated, src=0)
    again = pycomm.ZeroRedundancyOptimizer(_ddp(base).parameters(), torch.optim.AdamW,
                                           lr=1e-2)
    again.load_state_dict(consolidated[0])
    again.consolidate_state_dict(to=0)
    if rank == 0:
        scale = len(list(base.parameters())) - 1
        for key, value in consolidated[0]["state"][scale].items():
            assert torch.equal(again.state_dict()["state"][scale][key], value), key


def test_clip_of_a_subset_and_a_zero_dim_parameter():
    run_ranks(_subset_and_scalar, 2)


def test_clip_takes_the_global_norm_from_the_shards():
    """ddp.clip_grad_norm_ and pycomm.clip_grad_norm_ on sharded parameters: torch's norm
    and parameters to float rounding (the norm's sum is split otherwise, so not bitwise)."""
    run_ranks(_clipping, 2)


def _save(rank, world_size, folder):
    """Train 6 steps; save the model, the consolidated state dict and every rank's shard;
    check the consolidated one is what a plain AdamW holds after the same training. The
    pieces are stepped by AdamW's own step in blocks of 37 elements (Note [Stepping in
    cache-sized blocks]), which _resume's optimizers, stepped in one pass (pycomm/adam_step.py),
    do not cut: a shard's runs load onto any cut of the same parameters, and the state of
    either step onto the other."""
    shard_layout.STEP_BLOCK = 37
    adam_step.ONE_PASS = False
    base = build("mlp")
    ddp, zero, plain, adamw = _pair(base, overlap_with_ddp=True)
    for d, o in ((ddp, zero), (plain, adamw)):
        _train(d, o, rank, 6)
    assert max(piece.numel for _, piece, _ in zero._pieces) == 37
    assert zero.step_kernel.startswith("AdamW.step"), zero.step_kernel
    torch.save(zero.sharded_state_dict(), os.path.join(folder, f"shard{rank}.pt"))
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        zero.state_dict()
    zero.consolidate_state_dict(to=0)
    if rank == 0:
        consolidated = zero.state_dict()
        fresh = torch.optim.AdamW(copy.deepcopy(base).parameters(), lr=1e-2)
        fresh.load_state_dict(consolidated)  # a plain torch optimizer loads it
        want = adamw.state_dict()
        for index, state in want["state"].items():
            for key, value in state.items():
                assert torch.equal(fresh.state_dict()["state"][index][key], value), (index, key)
        torch.save(consolidated, os.path.join(folder, "consolidated.pt"))
        torch.save(ddp.module.state_dict(), os.path.join(folder, "model.pt"))


def _resume(rank, world_size, folder, saved_world):
    """Load the model and the optimizer state three ways (consolidated, this rank's shard
    when the world is unchanged, every rank's shards), train 4 more steps: the three agree
    bitwise, and with an unsharded AdamW loaded from the consolidated dict (bitwise at 2
    ranks, to rounding at 3)."""
    base = build("mlp")
    base.load_state_dict(torch.load(os.path.join(folder, "model.pt")))
    consolidated = torch.load(os.path.join(folder, "consolidated.pt"))
    shards = [torch.load(os.path.join(folder, f"shard{r}.pt")) for r in range(saved_world)]
    sources = {"consolidated": consolidated, "all shards": shards}
    if world_size == saved_world:
        sources["own shard"] = shards[rank]
    else:
        zero = pycomm.ZeroRedundancyOptimizer(_ddp(base).parameters(), torch.optim.AdamW,
                                              lr=1e-2)
        with pytest.raises(ValueError, match="rank 1 passed the shard of rank 0 of 2"):
            zero.load_state_dict(shards[0])
    results = {}
    for name, source in sources.items():
        ddp = _ddp(base)
        zero = pycomm.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-2)
        zero.load_state_dict(source)
        assert max(piece.numel for _, piece, _ in zero._pieces) > 37, "the test needs pieces"
        _train(ddp, zero, rank, 4, first=6)
        assert zero.step_kernel == "pycomm one-pass Adam", zero.step_kernel
        results[name] = ddp
    plain = _ddp(base)
    adamw = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    adamw.load_state_dict(consolidated)
    _train(plain, adamw, rank, 4, first=6)
    for name, ddp in results.items():
        for p, q, r in zip(ddp.parameters(), results["consolidated"].parameters(),
                           plain.parameters()):
            assert torch.equal(p, q), f"{name} differs from the consolidated load"
            if world_size == 2:
                assert torch.equal(p, r), f"{name} differs from an unsharded AdamW"
            else:
                torch.testing.assert_close(p, r, rtol=2e-5, atol=2e-6)


def test_state_dicts_consolidated_sharded_and_onto_three_ranks(tmp_path):
    run_ranks(_save, 2, folder=str(tmp_path))
    run_ranks(_resume, 2, folder=str(tmp_path), saved_world=2)
    run_ranks(_resume, 3, folder=str(tmp_path), saved_world=2)


def _reads(rank, world_size):
    """overlap_with_ddp=True leaves the all-gathers running after step(); what reads the
    model waits for them: the module's state_dict(), an evaluation forward."""
    base = build("mlp")
    ddp, zero, plain, adamw = _pair(base, overlap_with_ddp=True)
    x = make_input("mlp", rank, 99)
    for step in range(3):
        for d, o in ((ddp, zero), (plain, adamw)):
            _train(d, o, rank, 1, first=step)
        assert zero._pending, "the all-gathers should still be pending"
        if step == 0:
            state = ddp.module.state_dict()
            for key, value in plain.module.state_dict().items():
                assert torch.equal(state[key], value), key
        else:
            with torch.no_grad():
                assert torch.equal(ddp.module(x), plain.module(x))
        assert not zero._pending
        # each module's pre-hook waits for the buckets its parameters are in now (the
        # buckets were re-cut after step 0)
        index = {id(p): i for i, p in enumerate(ddp.parameters())}
        bucket = {i: b for b, members in enumerate(ddp.reducer.bucket_indices())
                  for i in members}
        for module, waited in zero._module_buckets.items():
            want = {bucket[index[id(p)]] for p in module.parameters(recurse=False)}
            assert waited == want, (module, waited, want)


def test_reading_the_model_waits_for_pending_all_gathers():
    run_ranks(_reads, 2)


def _memory(rank, world_size):
    """AdamW's state per rank: 1/world of the unsharded optimizer's (+ the tail, < world
    elements per bucket and state)."""
    base = build("wide")
    ddp = _ddp(base)
    zero = pycomm.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-2)
    _train(ddp, zero, rank, 1)
    mine = sum(t.numel() * t.element_size() for s in zero.optim.state.values()
               for t in s.values() if t.dim() > 0)
    whole = 2 * sum(p.numel() * p.element_size() for p in base.parameters())
    buckets = len(ddp.reducer.bucket_indices())
    assert mine <= whole / world_size + 2 * 4 * world_size * buckets, (mine, whole)
    assert mine >= whole / world_size - 2 * 4 * world_size * buckets, (mine, whole)


@pytest.mark.parametrize("world", [2, 3])
def test_optimizer_state_is_one_world_th(world):
    run_ranks(_memory, world)


def _released(rank, world_size):
    """ZeRO-2 memory (Note [Released gradients]): after a synchronized backward no
    param.grad is left, every bucket's storage is freed, and the rank keeps 1/world of the
    gradients (+ the tails; the first step keeps whole ones until the re-cut); from the
    second step on the gradients are reduce-scattered where they are, no bucket filled;
    no_sync accumulates in param.grad as usual. With grad_reduce_dtype the fp32 buckets
    stay (they hold no_sync's sums)."""
    base = build("wide")
    ddp = _ddp(base)
    zero = pycomm.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-2,
                                          release_gradients=True)
    whole = sum(p.numel() for p in base.parameters())
    buckets = len(ddp.reducer.bucket_indices())
    for step in range(3):  # the buckets are re-cut after step 0
        zero.zero_grad()
        with ddp.no_sync():
            loss_of(ddp(make_input("mlp", rank, 50 + step))).backward()
        assert all(p.grad is not None for p in ddp.parameters()), "no_sync keeps param.grad"
        loss_of(ddp(make_input("mlp", rank, step))).backward()
        assert all(p.grad is None for p in ddp.parameters()), f"step {step}: a grad is kept"
        freed = [ddp.reducer.grad_view(i).untyped_storage().nbytes() == 0
                 for i in range(len(ddp._named_params))]
        assert all(freed), f"step {step}: a bucket is kept"
        # Once the shards are final, gradients are reduce-scattered where they are (Note
        # [Pieces reduce-scatter] in csrc/shm/collectives.cpp), never copied into a bucket
        in_place = [b["in_place"] for b in ddp.timelines(1)[0]["buckets"]]
        assert in_place == [step > 0] * buckets, (step, in_place)
        if step > 0:  # the first keeps whole gradients (Note [The first step's buckets])
            kept = sum(t.numel() for t in zero._hook_state.grads.values())
            assert whole / world_size <= kept <= whole / world_size + world_size * buckets
        zero.step()
    assert zero._hook_state.final and not zero._hook_state.keep.has_first
    low = _ddp(base.to(torch.bfloat16), grad_reduce_dtype=torch.float32)
    zero = pycomm.ZeroRedundancyOptimizer(low.parameters(), torch.optim.AdamW, lr=1e-2,
                                          release_gradients=True)
    loss_of(low(make_input("mlp", rank, 0).to(torch.bfloat16))).float().backward()
    assert all(p.grad is not None for p in low.parameters())
    assert all(low.reducer.grad_view(i).untyped_storage().nbytes() > 0
               for i in range(len(low._named_params)))
    zero.step()


def test_gradients_are_released_after_their_bucket():
    run_ranks(_released, 2)


def _errors(rank, world_size):
    base = build("mlp")
    ddp = _ddp(base)
    stray = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[6\].*not one of"):
        pycomm.ZeroRedundancyOptimizer(list(ddp.parameters()) + [stray], torch.optim.AdamW)
    with pytest.raises(ValueError, match=r"'net.4.bias'.*not in the optimizer"):
        pycomm.ZeroRedundancyOptimizer(list(ddp.parameters())[:-1], torch.optim.AdamW)
    with pytest.raises(ValueError, match="LBFGS is not an elementwise optimizer"):
        pycomm.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.LBFGS)
    # groups that differ across ranks: every rank raises, naming rank 1 (nothing hangs)
    params = list(ddp.parameters())
    groups = [{"params": params}] if rank == 0 else [{"params": params[:2]},
                                                     {"params": params[2:]}]
    with pytest.raises(ValueError, match="rank 1 differs from rank 0 in its parameter groups"):
        pycomm.ZeroRedundancyOptimizer(groups, torch.optim.AdamW)
    conv = pycomm.DistributedDataParallel(
        torch.nn.Conv2d(4, 8, 3).to(memory_format=torch.channels_last))
    with pytest.raises(ValueError, match="parameter 'weight' is not contiguous"):
        pycomm.ZeroRedundancyOptimizer(conv.parameters(), torch.optim.AdamW)
    zero = pycomm.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-2)
    with pytest.raises(RuntimeError, match="_set_static_graph.. after a ZeroRedundancy"):
        ddp._set_static_graph()
    with pytest.raises(ValueError, match=r"param_groups\[1\] holds a trainable parameter that is "
                                         r"not the DDP's"):
        zero.add_param_group({"params": [stray]})
    assert len(zero.param_groups) == 1, "the refused group is not kept"
    zero.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3), requires_grad=False)],
                          "lr": 0.5})  # a frozen one is (it never gets a gradient)
    assert len(zero.param_groups) == len(zero.optim.param_groups) == 2
    hooked = _ddp(base)
    hooked.register_comm_hook(None, lambda _, bucket: None)
    with pytest.raises(RuntimeError, match="already has a communication hook"):
        pycomm.ZeroRedundancyOptimizer(hooked.parameters(), torch.optim.AdamW,
                                       release_gradients=True)
    # keeping the gradients, the DDP reduces them through its own hook
    pycomm.ZeroRedundancyOptimizer(hooked.parameters(), torch.optim.AdamW)
    with pytest.raises(ValueError, match="not a sharded state dict"):
        zero.load_state_dict([{"state": {}}])
    _train(ddp, zero, rank, 2)  # the refusals left it working


def test_bad_input_is_named():
    run_ranks(_errors, 2)


def _uneven(rank, world_size):
    """join(): rank 1 runs out of data two steps early. Its DDP shadow reduce-scatters
    zeros, so it keeps the others' averaged gradients of its range, and its optimizer's
    shadow steps them and all-gathers: rank 0 trains exactly as with pycomm's DDP + AdamW
    under join, and every rank ends with the same parameters."""
    from torch.distributed.algorithms.join import Join

    base = build("mlp")
    steps = 6 if rank == 0 else 4
    results = []
    for sharded in (True, False):
        ddp = _ddp(base)
        opt = (pycomm.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-2,
                                              overlap_with_ddp=True)
               if sharded else torch.optim.AdamW(ddp.parameters(), lr=1e-2))
        with Join([ddp, opt] if sharded else [ddp]):
            _train(ddp, opt, rank, steps)
        if sharded and rank == 1:  # its shadow steps drop what the DDP's shadow handed over
            assert all(p.grad is None for p in ddp.parameters()), "a stale average is left"
        results.append([p.detach().clone() for p in ddp.parameters()])
    if rank == 0:
        for p, q in zip(*results):
            assert torch.equal(p, q), (p - q).abs().max()
    gathered = [None] * world_size
    torch.distributed.all_gather_object(gathered, results[0])
    for p, q in zip(*gathered):
        assert torch.equal(p, q), "the ranks' parameters differ after join"


def test_join_with_uneven_inputs():
    run_ranks(_uneven, 2)


def _no_sync_only(rank, world_size):
    """A step after only no_sync backwards steps param.grad's local sums, as an unsharded
    optimizer does (no shard was reduced since zero_grad); the next synchronized step reads
    the reduced shards again. The ranks' parameters then differ, as they would unsharded."""
    base = build("mlp")
    pairs = []
    for sharded in (True, False):
        ddp = _ddp(base)
        opt = (pycomm.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-2)
               if sharded else torch.optim.AdamW(ddp.parameters(), lr=1e-2))
        _train(ddp, opt, rank, 2)
        opt.zero_grad()
        with ddp.no_sync():
            loss_of(ddp(make_input("mlp", rank, 7))).backward()
        opt.step()
        pairs.append((ddp, opt))
    (ours, zero), (plain, _) = pairs
    zero.wait_for_params()
    # rank-local steps: only the rank's own range (and the tail) was stepped by the sharded
    # optimizer and then all-gathered, so compare what the rank owns
    for _, piece, main in zero._pieces:
        want = list(plain.parameters())[piece.param].detach().reshape(-1)[piece.lo:piece.hi]
        assert torch.equal(main, want)


def test_a_step_after_only_no_sync_steps_the_local_gradients():
    run_ranks(_no_sync_only, 2)
