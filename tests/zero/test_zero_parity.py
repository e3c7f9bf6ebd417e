"""pycomm.ZeroRedundancyOptimizer on pycomm's DDP trains exactly as pycomm's DDP (and
torch's) with the same optimizer unsharded: every parameter bitwise equal after 12 steps
at 2 ranks, on the shared-memory group (reduce-scatter) and on plain Gloo (all-reduce),
with no_sync accumulation, rebuilt buckets, find_unused_parameters, static_graph, several
parameter groups and bf16 parameters with fp32 main parameters; at 3 ranks bitwise equal
to pycomm's DDP and within rounding of torch's (whose Gloo ring sums in another order)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from pycomm import adam_step
from pycomm.zero import layout as shard_layout
from tests.support.ddp_models import build, loss_of, make_input
from tests.support.multirank import run_ranks

STEPS = 12


def _groups(module, weight_decay=0.1):
    """Two groups: matrices with weight decay, vectors without (as transformers trains)."""
    decay = [p for p in module.parameters() if p.dim() > 1]
    rest = [p for p in module.parameters() if p.dim() <= 1]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": rest, "weight_decay": 0.0}]


def _steps(ddp, opt, rank, model, accumulate, dtype=torch.float32):
    for step in range(STEPS):
        opt.zero_grad()
        micro = 2 if accumulate and step % 3 == 1 else 1
        for m in range(micro):
            x = make_input(model, rank, 10 * step + m).to(dtype) if model != "attn" else \
                make_input(model, rank, 10 * step + m)
            if m < micro - 1:
                with ddp.no_sync():
                    loss_of(ddp(x)).float().backward()
            else:
                loss_of(ddp(x)).float().backward()
        opt.step()


def _parity(rank, world_size, model, shm, options, accumulate, ddp_kwargs, exact, cap=5e-4,
            exact_torch=None, block=None):
    if block is not None:  # See Note [Stepping in cache-sized blocks]: small enough to cut
        shard_layout.STEP_BLOCK = block  # and AdamW's own step, which the blocks are for
        adam_step.ONE_PASS = False
    base = build(model)
    cfg = pycomm.DDPConfig(shared_memory_gradients=shm, bucket_cap_mb=cap, **ddp_kwargs)
    sharded = pycomm.DistributedDataParallel(copy.deepcopy(base), config=cfg)
    zero = pycomm.ZeroRedundancyOptimizer(_groups(sharded), torch.optim.AdamW, lr=1e-2,
                                          **options)
    plain = pycomm.DistributedDataParallel(copy.deepcopy(base), config=cfg)
    adamw = torch.optim.AdamW(_groups(plain), lr=1e-2, **options)
    # torch 2.13's static_graph leaves step 1 unreduced on Branchy's dataclass output (see
    # tests/ddp/test_torch_arguments.py): its find_unused_parameters is the torch oracle.
    unused = bool(ddp_kwargs)
    torch_ddp = TorchDDP(copy.deepcopy(base), bucket_cap_mb=cap, find_unused_parameters=unused)
    torch_adamw = torch.optim.AdamW(_groups(torch_ddp), lr=1e-2, **options)
    for ddp, opt in ((sharded, zero), (plain, adamw), (torch_ddp, torch_adamw)):
        _steps(ddp, opt, rank, model, accumulate)
    zero.wait_for_params()
    assert len(sharded.reducer.bucket_indices()) > 1, "the test needs several buckets"
    one_pass = block is None and not any(options.values())  # the for-loop AdamW
    assert (zero.step_kernel == "pycomm one-pass Adam") == one_pass, zero.step_kernel
    if block is not None:
        lengths = [piece.numel for _, piece, _ in zero._pieces]
        assert max(lengths) == block and len(zero.optim.state) == len(lengths), lengths
    for (name, p), q, t in zip(sharded.module.named_parameters(), plain.module.parameters(),
                               torch_ddp.module.parameters()):
        for ref, who in ((q, "pycomm DDP + AdamW"), (t, "torch DDP + AdamW")):
            if exact if ref is q or exact_torch is None else exact_torch:
                assert torch.equal(p, ref), (f"rank {rank}: {name} differs from {who} by "
                                             f"{(p - ref).abs().max().item():.3g}")
            else:
                torch.testing.assert_close(p, ref, rtol=2e-5, atol=2e-6,
                                           msg=lambda m, n=name, w=who: f"{n} vs {w}: {m}")


@pytest.mark.parametrize("options", [{"foreach": False}, {"foreach": True}],
                         ids=["for-loop", "foreach"])
def test_two_ranks_bitwise_on_shared_memory(options):
    run_ranks(_parity, 2, model="mlp", shm=True, options=options, accumulate=True,
              ddp_kwargs={}, exact=True)


@pytest.mark.parametrize("world", [2, 3])
def test_blocks_step_bitwise(world):
    """Note [Stepping in cache-sized blocks]: pieces cut into blocks of 37 elements (odd, so
    that blocks start anywhere in a vector) step every element to the same bits."""
    run_ranks(_parity, world, model="mlp", shm=True, options={}, accumulate=True,
              ddp_kwargs={}, exact=True, exact_torch=world == 2, block=37)


def test_two_ranks_fused_within_an_ulp():
    """fused=True on CPU: the kernel's vector loop and its scalar remainder round
    differently (fused multiply-add), and which elements fall in the remainder depends on
    where a piece ends; so pieces agree with whole tensors to an ulp, not bitwise."""
    run_ranks(_parity, 2, model="mlp", shm=True, options={"fused": True}, accumulate=True,
              ddp_kwargs={}, exact=False)


def test_two_ranks_bitwise_on_gloo():
    run_ranks(_parity, 2, model="mlp", shm=False, options={}, accumulate=True,
              ddp_kwargs={}, exact=True)


@pytest.mark.parametrize("ddp_kwargs", [{"find_unused_parameters": True},
                                        {"static_graph": True}],
                         ids=["find_unused", "static_graph"])
def test_unused_parameters_bitwise(ddp_kwargs):
    run_ranks(_parity, 2, model="branchy", shm=True, options={}, accumulate=True,
              ddp_kwargs=ddp_kwargs, exact=True, cap=2e-4)


def test_batched_grad_copy_bitwise():
    """batched_grad_copy: the gradients are dropped at the bucket's one copy, never left
    as views of a freed bucket."""
    run_ranks(_parity, 2, model="mlp", shm=True, options={}, accumulate=True,
              ddp_kwargs={"batched_grad_copy": True}, exact=True)


def _accumulated(rank, world_size):
    """Two synchronized backwards before each step (no no_sync): the second adds to the
    first, as param.grad accumulates under DDP; also before the first step, across the
    DDP's bucket re-cut in the second forward. Without the accumulation the first
    backward's gradients would be lost: far more than rounding apart."""
    base = build("mlp")
    cfg = pycomm.DDPConfig(bucket_cap_mb=5e-4)
    results = []
    for sharded in (True, False):
        ddp = pycomm.DistributedDataParallel(copy.deepcopy(base), config=cfg)
        opt = (pycomm.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-2)
               if sharded else torch.optim.AdamW(ddp.parameters(), lr=1e-2))
        for step in range(4):
            opt.zero_grad()
            for m in range(2):
                loss_of(ddp(make_input("mlp", rank, 10 * step + m))).backward()
            opt.step()
        results.append(list(ddp.parameters()))
    # DDP reduces (reduced first sum + second local) again, the sharded hook adds the
    # second average to the first: the same sum, rounded otherwise
    for p, q in zip(*results):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_synchronized_backwards_accumulate():
    run_ranks(_accumulated, 2)


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "gloo"])
def test_three_ranks_bitwise_with_pycomm_ddp(shm):
    """At 3 ranks the sharded step is still bitwise equal to pycomm's DDP (the same
    pre-divided gradients, summed in the same order by its reduce-scatter as by its
    all-reduce), and within rounding of torch's, whose Gloo ring sums three terms in
    another order. On the MLP: attention's key bias has a gradient that is zero but for
    rounding, which Adam normalizes into full-size steps, so no tolerance would hold there
    against any other summation order."""
    run_ranks(_parity, 3, model="mlp", shm=shm, options={}, accumulate=True,
              ddp_kwargs={}, exact=True, exact_torch=False)


def _bf16_main_params(rank, world_size, device="cpu", block=None, release=True):
    """bf16 parameters, fp32 gradient buckets: the sharded step on fp32 main parameters
    equals the unsharded oracle (fp32 copies of the parameters stepped by AdamW on the DDP's
    fp32 main_grad, rounded to bf16 after each step), bitwise: the gradients released
    (the step reads the fp32 shards), or kept with main_grad_only (the step reads
    param.main_grad, as the DDP's clip would scale it). On "cuda" too
    (tests/gpu/test_zero_on_cuda.py: the DDPs move the inputs, device_ids=[0])."""
    if block is not None:  # fp32 main copies per block
        shard_layout.STEP_BLOCK = block
        adam_step.ONE_PASS = False
    base = build("mlp").to(device).to(torch.bfloat16)
    cfg = pycomm.DDPConfig(bucket_cap_mb=5e-4, grad_reduce_dtype=torch.float32,
                           main_grad_only=not release)
    ids = [0] if device == "cuda" else None
    sharded = pycomm.DistributedDataParallel(copy.deepcopy(base), device_ids=ids, config=cfg)
    zero = pycomm.ZeroRedundancyOptimizer(sharded.parameters(), torch.optim.AdamW, lr=1e-2,
                                          release_gradients=release)
    plain = pycomm.DistributedDataParallel(copy.deepcopy(base), device_ids=ids, config=cfg)
    main = [p.detach().float().clone() for p in plain.parameters()]
    adamw = torch.optim.AdamW(main, lr=1e-2)
    _steps(sharded, zero, rank, "mlp", accumulate=True, dtype=torch.bfloat16)
    for step in range(STEPS):  # the oracle's loop
        for p in plain.parameters():
            p.grad = None
        micro = 2 if step % 3 == 1 else 1
        for m in range(micro):
            x = make_input("mlp", rank, 10 * step + m).to(torch.bfloat16)
            if m < micro - 1:
                with plain.no_sync():
                    loss_of(plain(x)).float().backward()
            else:
                loss_of(plain(x)).float().backward()
        for w, p in zip(main, plain.parameters()):
            w.grad = p.main_grad.clone()
        adamw.step()
        with torch.no_grad():
            for w, p in zip(main, plain.parameters()):
                p.copy_(w)
    zero.wait_for_params()
    for (name, p), q in zip(sharded.module.named_parameters(), plain.module.parameters()):
        assert p.dtype == torch.bfloat16 and p.device.type == device
        assert torch.equal(p, q), (f"rank {rank}: {name} differs from the fp32-main oracle "
                                   f"by {(p.float() - q.float()).abs().max().item():.3g}")


@pytest.mark.parametrize("block,release", [(None, True), (37, True), (None, False)],
                         ids=["pieces", "blocks", "kept-main-grad-only"])
def test_bf16_parameters_with_fp32_main_parameters_bitwise(block, release):
    run_ranks(_bf16_main_params, 2, block=block, release=release)


def _standalone(rank, world_size):
    """Without a pycomm DDP (torch's DDP averages into param.grad) it does what torch's
    ZeroRedundancyOptimizer does: the same parameters, bit for bit."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    base = build("mlp")
    ours_ddp = TorchDDP(copy.deepcopy(base))
    ours = pycomm.ZeroRedundancyOptimizer(ours_ddp.parameters(), torch.optim.AdamW, lr=1e-2)
    theirs_ddp = TorchDDP(copy.deepcopy(base))
    theirs = TorchZero(theirs_ddp.parameters(), torch.optim.AdamW, lr=1e-2)
    for ddp, opt in ((ours_ddp, ours), (theirs_ddp, theirs)):
        _steps(ddp, opt, rank, "mlp", accumulate=True)
    for p, q in zip(ours_ddp.parameters(), theirs_ddp.parameters()):
        assert torch.equal(p, q)
    mine = sum(t.numel() for s in ours.optim.state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim() > 0)
    total = 2 * sum(p.numel() for p in base.parameters())
    assert mine <= total / world_size + 2 * world_size, (mine, total)


def test_standalone_matches_torch_zero_redundancy_optimizer():
    run_ranks(_standalone, 2)


def _clip_as_torch(ddp, ref, max_norm=0.01):
    """The DDP's clip and torch's clip_grad_norm_ on `ref` (the same gradients unsharded):
    the same global norm, to rounding; the norm must be over max_norm, so that both scale."""
    got = ddp.clip_grad_norm_(max_norm)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    assert want > max_norm, "the test must clip"
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def _one_rank(rank, world_size):
    """Note [One rank: nothing to shard]: no hook on the DDP, param.grad keeps the DDP's
    gradients (the same bits as torch's DDP), the DDP clip equals torch's, the buckets are
    re-cut by the first step before any state exists, and the parameters end bitwise
    pycomm's DDP's and torch's with the same AdamW; with gradient_as_bucket_view and
    bf16 parameters on fp32 main parameters too."""
    for shm in (True, False):
        for ddp_kwargs in ({}, {"gradient_as_bucket_view": True}):
            _parity(rank, world_size, model="mlp", shm=shm, options={}, accumulate=True,
                    ddp_kwargs=ddp_kwargs, exact=True)
    _bf16_main_params(rank, world_size)
    _bf16_main_params(rank, world_size, release=False)
    base = build("mlp")
    ddp = pycomm.DistributedDataParallel(copy.deepcopy(base),
                                         config=pycomm.DDPConfig(bucket_cap_mb=5e-4))
    zero = pycomm.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-2)
    ref = TorchDDP(copy.deepcopy(base), bucket_cap_mb=5e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    assert ddp._sync.comm_hook is None, "a hook at world 1"
    relayouts = []
    zero._relayout = lambda whole, f=zero._relayout: (relayouts.append(whole), f(whole))
    for step in range(4):
        for m, opt in ((ddp, zero), (ref, ref_opt)):
            opt.zero_grad()
            loss_of(m(make_input("mlp", rank, step))).backward()
        for (name, p), q in zip(ddp.module.named_parameters(), ref.module.parameters()):
            assert p.grad is not None, f"step {step}: {name}"
            if step == 0:  # later the clips' last bits (the DDP's sums by bucket) part them
                assert torch.equal(p.grad, q.grad), f"step {step}: {name}"
            else:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
        _clip_as_torch(ddp, ref)
        zero.step()
        ref_opt.step()
        assert not zero._pending and not zero._hook_state.grads, f"step {step}"
    assert relayouts == [None], f"the shards were re-cut {len(relayouts)} times, or with state"
    assert not ddp.reducer.should_rebuild_buckets()
    for (name, p), q in zip(ddp.module.named_parameters(), ref.module.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: n + m)


def test_one_rank_keeps_param_grad_and_trains_as_ddp():
    run_ranks(_one_rank, 1)


def _wrapped_after(rank, world_size, clip_first, release):
    """Note [Wrapped after the optimizer]: built on the bare module, then the module wrapped
    (Accelerate's order). The first step (or a clip before it) moves the optimizer onto
    the DDP; it trains bitwise as pycomm's DDP + AdamW throughout (with a clip: within the
    clip's rounding); released, it reduce-scatters from the second backward on and drops
    param.grad; kept, param.grad holds the DDP's averages."""
    base = build("mlp")
    cfg = pycomm.DDPConfig(bucket_cap_mb=5e-4)
    bare = copy.deepcopy(base)
    zero = pycomm.ZeroRedundancyOptimizer(_groups(bare), torch.optim.AdamW, lr=1e-2,
                                          release_gradients=release)
    assert zero._ddp is None
    sharded = pycomm.DistributedDataParallel(bare, config=cfg)
    plain = pycomm.DistributedDataParallel(copy.deepcopy(base), config=cfg)
    adamw = torch.optim.AdamW(_groups(plain), lr=1e-2)
    for ddp, opt in ((sharded, zero), (plain, adamw)):
        for step in range(STEPS):
            opt.zero_grad()
            micro = 2 if step % 3 == 1 else 1
            for m in range(micro):
                x = make_input("mlp", rank, 10 * step + m)
                with ddp.no_sync() if m < micro - 1 else contextlib.nullcontext():
                    loss_of(ddp(x)).backward()
            if clip_first:
                pycomm.clip_grad_norm_(ddp.parameters(), 0.05)
            if ddp is sharded and step == 0:  # its first step moves it
                assert zero._ddp is None
            opt.step()
            if ddp is sharded:
                assert zero._ddp is sharded, f"step {step}: not moved onto the DDP"
                assert zero.grads_in_shards == release
                if step > 0:
                    assert all((p.grad is None) == release for p in sharded.parameters()), step
    zero.wait_for_params()
    for (name, p), q in zip(sharded.module.named_parameters(), plain.module.parameters()):
        if clip_first:  # the norm from the shards adds in another order than the whole
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: n + m)
        else:
            assert torch.equal(p, q), f"rank {rank}: {name} differs by {(p - q).abs().max()}"


@pytest.mark.parametrize("clip_first", [False, True], ids=["step-first", "clip-first"])
@pytest.mark.parametrize("release", [False, True], ids=["kept", "released"])
def test_built_before_the_module_was_wrapped(clip_first, release):
    run_ranks(_wrapped_after, 2, clip_first=clip_first, release=release)
