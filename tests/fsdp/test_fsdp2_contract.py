"""The FSDP2 contract: what torch's own CPU-runnable `fully_shard` and `replicate` tests check
(test/distributed/_composable/fsdp/test_fully_shard_*.py, test_replicate_with_fsdp.py,
test_replicate_training.py, checkpoint/fsdp/test_fsdp_dsd.py), run on a "pycomm" group and
on a Gloo group of the same ranks in the same processes, the two runs asserted bitwise
equal: losses, every step's gradient shards, parameters, state dicts, checkpoints.

Bitwise, not close: each run starts from the same seed and feeds the same inputs, so the
only thing that differs is the backend under FSDP's all-gathers, reduce-scatters and
all-reduces. An all-gather is a copy. A sum of two terms has one order, so at 2 ranks
every reduction (float32, bfloat16, float16, float64) is Gloo's to the bit; the 4-rank
test (HSDP on a 2 x 2 mesh, FSDP over 4 ranks) reduces float32 only, whose sums pycomm
adds in Gloo's ring order (Note [Gloo's summation order] in csrc/shm/sum_order.h). Every
comparison also checks that collectives ran on the pycomm group, so that two runs on Gloo
could not pass for one on each backend.

Not here: what needs CUDA (streams and events: post-optim events, shared comm contexts,
delays injected into kernels; pinned-memory CPU offload; CUDA graphs; torch.compile's
FSDP tests), NCCL-only features (symmetric memory, allocation from the process group; a
divide factor other than the world size, which asks for PREMUL_SUM, is checked only to be
refused by both backends), and FSDP with tensor parallelism, whose tests torch runs on 8
ranks (over this file's budget; test_clip.py has pycomm's clip on such meshes).
"""

from __future__ import annotations

import collections
import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.support.multirank import run_ranks

# --- helpers -----------------------------------------------------------------------------


def _groups() -> dict[str, dist.ProcessGroup]:
    """The world on each backend (every rank makes both, in the same order)."""
    return {backend: dist.new_group(backend=backend) for backend in ("gloo", "pycomm")}


def _meshes() -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    return {backend: DeviceMesh.from_group(group, "cpu") for backend, group in _groups().items()}


def _hsdp_meshes(world: int) -> dict:
    """A (replicate=2, shard=world/2) mesh per backend, made from that backend's groups:
    init_device_mesh would put every dimension on the default backend (Gloo)."""
    from torch.distributed.device_mesh import DeviceMesh
    layout = torch.arange(world).view(2, world // 2)
    meshes = {}
    for backend in ("gloo", "pycomm"):
        shard, _ = dist.new_subgroups_by_enumeration(layout.tolist(), backend=backend)
        rep, _ = dist.new_subgroups_by_enumeration(layout.t().tolist(), backend=backend)
        meshes[backend] = DeviceMesh.from_group([rep, shard], "cpu", mesh=layout,
                                                mesh_dim_names=("replicate", "shard"))
    return meshes


def _pycomm_ops(mesh) -> int:
    """Operations the pycomm groups under `mesh` have run, on this rank."""
    import pycomm.shm
    total = 0
    for group in mesh.get_all_groups():
        stats = pycomm.shm.stats(group)
        total += stats["ops_on_caller_thread"] + stats["ops_on_worker_thread"]
    return total


def _assert_bitwise(ours, theirs, what: str) -> None:
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_flatten
    our_leaves, our_spec = tree_flatten(ours)
    their_leaves, their_spec = tree_flatten(theirs)
    assert our_spec == their_spec, f"{what}: pycomm's result has another structure than Gloo's"
    assert any(isinstance(leaf, torch.Tensor) for leaf in our_leaves), f"{what}: no tensors"
    for i, (a, b) in enumerate(zip(our_leaves, their_leaves)):
        if isinstance(a, torch.Tensor):
            # (a DTensor's torch.equal is a collective: compare local tensors only)
            assert not isinstance(a, DTensor) and not isinstance(b, DTensor), (what, i)
            assert a.dtype == b.dtype and a.shape == b.shape, (what, i, a.dtype, b.dtype)
            assert torch.equal(a, b), \
                f"{what}: leaf {i} differs, max |diff| {(a.double() - b.double()).abs().max()}"
        else:
            assert a == b, (what, i, a, b)


def _same_on_both(what: str, run, meshes: dict, *args, **kwargs):
    """run(mesh, ...) on Gloo's mesh, then on pycomm's: bitwise the same result."""
    theirs = run(meshes["gloo"], *args, **kwargs)
    before = _pycomm_ops(meshes["pycomm"])
    ours = run(meshes["pycomm"], *args, **kwargs)
    assert _pycomm_ops(meshes["pycomm"]) > before, f"{what}: nothing ran on the pycomm group"
    _assert_bitwise(ours, theirs, what)
    return ours


def _inputs(step: int, *shape: int, dtype=torch.float32) -> torch.Tensor:
    """This rank's batch of a step: different across ranks, the same on both backends."""
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    return torch.randn(*shape, generator=g).to(dtype)


def _local_grads(model: nn.Module) -> list:
    """This rank's gradient shards (None where a parameter has no gradient)."""
    return [None if p.grad is None else _local(p.grad).clone() for p in model.parameters()]


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t.detach()


def _full_params(model: nn.Module) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for p in model.parameters()]


def _fsdp_modules(model: nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _recorded_ops(mesh, since: int) -> collections.Counter:
    """What the pycomm group of a 1-D mesh ran after operation number `since`."""
    import pycomm.shm
    record = pycomm.shm.flight_record(mesh.get_group())
    return collections.Counter(e["op"] for e in record if e["seq"] > since)


def _last_seq(mesh) -> int:
    import pycomm.shm
    record = pycomm.shm.flight_record(mesh.get_group())
    return record[-1]["seq"] if record else 0


class _MLP(nn.Module):
    """Linear-ReLU-Linear with a residual; `wide` hidden units (odd: uneven shards)."""

    def __init__(self, dim: int, wide: int | None = None):
        super().__init__()
        self.in_proj = nn.Linear(dim, wide or 3 * dim + 1)
        self.out_proj = nn.Linear(wide or 3 * dim + 1, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out_proj(torch.relu(self.in_proj(x)))


def _mlp_stack(mesh, dim: int = 8, n: int = 3, before=None, **opts) -> nn.Module:
    """A root Linear then `n` MLPs, each MLP its own FSDP group, the root holding the Linear;
    `before(model)` runs before any fully_shard."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(dim, dim), *[_MLP(dim) for _ in range(n)])
    if before is not None:
        before(model)
    for mlp in model[1:]:
        fully_shard(mlp, mesh=mesh, **opts)
    fully_shard(model, mesh=mesh, **opts)
    return model


# --- training: reshard modes, module shapes, activations ---------------------------------


class _Block(nn.Module):
    """An MLP over a dict activation (test_fully_shard_autograd.py: non-tensor activations)."""

    def __init__(self, dim: int, wide: int):
        super().__init__()
        self.mlp = _MLP(dim, wide)

    def forward(self, act: dict) -> dict:
        return {"h": self.mlp(act["h"])}


class _Tower(nn.Module):
    """Blocks, one block run twice per forward, an output some steps leave out of the loss,
    a module forward never reaches, the root's own parameters (embed, head)."""

    def __init__(self, dim: int = 12):
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(_Block(dim, 17) for _ in range(3))
        self.twice = _Block(dim, 6)
        self.side = nn.Linear(dim, 4)
        self.idle = nn.Linear(dim, 2)
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor):
        act = {"h": self.embed(x)}
        for block in self.blocks:
            act = block(act)
        act = self.twice(self.twice(act))
        return self.head(act["h"]), self.side(act["h"])


def _wide_dim(param: nn.Parameter):
    """Shard(1) where dim 1 is the larger and splits evenly over 2 ranks, else Shard(0)."""
    from torch.distributed.tensor import Shard
    if param.ndim == 2 and param.shape[1] > param.shape[0] and param.shape[1] % 2 == 0:
        return Shard(1)
    return Shard(0)


def _train_tower(mesh, reshard, grouped: bool, prefetch: bool, wide_dim: bool):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = _Tower()
    initial = [p.detach().clone() for p in model.parameters()]
    opts = {"mesh": mesh, "reshard_after_forward": reshard}
    if wide_dim:
        opts["shard_placement_fn"] = _wide_dim
    for block in [*model.blocks, model.twice]:
        fully_shard(block, **opts)
    if grouped:  # one FSDP group over two modules, one of them never run
        fully_shard([model.side, model.idle], **opts)
    else:
        fully_shard(model.side, **opts)
        fully_shard(model.idle, **opts)
    fully_shard(model, **opts)
    if prefetch:
        blocks = list(model.blocks)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 3])
            block.set_modules_to_backward_prefetch(blocks[max(i - 2, 0):i][::-1])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    losses, grads = [], []
    for step in range(3):
        x = _inputs(step, 6, 12)
        out, side = model(x)
        # the side output is left out of the loss on odd steps (an unused forward output)
        loss = out.square().mean() + (side.sum() if step % 2 == 0 else 0)
        loss.backward()
        losses.append(loss.detach())
        grads.append(_local_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    # forward and backward through a non-root module alone
    model.blocks[0]({"h": x})["h"].sum().backward()
    grads.append(_local_grads(model))
    opt.step()
    params = _full_params(model)
    assert not all(torch.equal(a, b) for a, b in zip(initial, params)), "nothing trained"
    return losses, grads, params


def _two_forwards(mesh, reshard, checkpointed: bool):
    """test_fully_shard_training.py test_double_forward_with_nested_fsdp_and_checkpoint (two
    forwards of the whole model before one backward, as in DPO; FSDP nested in the blocks)
    and test_train_parity_with_activation_checkpointing (composable checkpoint per block)."""
    from torch.distributed._composable import checkpoint
    from torch.distributed.fsdp import fully_shard

    def nest(model):
        for mlp in model[1:]:
            if checkpointed:
                checkpoint(mlp)
            fully_shard(mlp.in_proj, mesh=mesh, reshard_after_forward=reshard)

    model = _mlp_stack(mesh, reshard_after_forward=reshard, before=nest)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(2):
        chosen, rejected = model(_inputs(2 * step, 4, 8)), model(_inputs(2 * step + 1, 4, 8))
        loss = (chosen.sum() - rejected.sum()).square()
        loss.backward()
        losses.append(loss.detach())
        grads.append(_local_grads(model))
        opt.step()
        opt.zero_grad()
    return losses, grads, _full_params(model)


def _training(rank, world):
    meshes = _meshes()
    # test_fully_shard_training.py: train parity single/multi group, uneven shards,
    # shard_placement_fn (Shard(1) where it splits evenly), reshard_after_forward
    # True/False/None (test_param_registration_after_forward), a module
    # run twice per forward, explicit forward/backward prefetching, non-root
    # forward/backward, grouped fully_shard([a, b]) with an unused module;
    # test_fully_shard_autograd.py: unused forward output, unused module, dict activations.
    for reshard, grouped, prefetch, wide_dim in ((True, False, False, False),
                                                 (False, True, False, True),
                                                 (None, False, True, False)):
        _same_on_both(f"tower reshard={reshard} grouped={grouped} prefetch={prefetch} "
                      f"wide_dim={wide_dim}", _train_tower, meshes, reshard, grouped,
                      prefetch, wide_dim)
    for reshard, checkpointed in ((True, True), (False, False)):
        _same_on_both(f"two forwards, one backward, reshard={reshard} "
                      f"checkpointed={checkpointed}", _two_forwards, meshes, reshard,
                      checkpointed)


def test_training_across_reshard_modes_and_module_shapes():
    run_ranks(_training, world_size=2)


# --- gradient accumulation ----------------------------------------------------------------


def _accumulate(mesh, mode: str, reshard_after_forward: bool, reshard_after_backward: bool,
                mixed: bool = False, reduce_scatters: list | None = None):
    """`reduce_scatters` gets, on pycomm, how many reduce-scatters the group ran per step."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    opts = {"reshard_after_forward": reshard_after_forward}
    if mixed:
        opts["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32)
    model = _mlp_stack(mesh, **opts)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    microbatches, losses, grads = 3, [], []
    on_pycomm = dist.get_backend(mesh.get_group()) == "pycomm"
    for it in range(2):
        seq = _last_seq(mesh) if on_pycomm else None
        for mb in range(microbatches):
            last = mb == microbatches - 1
            if mode == "all":
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_backward(last or reshard_after_backward)
            elif mode == "root_only":
                model.set_requires_gradient_sync(last, recurse=False)
            elif mode == "some_mlps":
                for mlp in model[1:3]:
                    mlp.set_requires_gradient_sync(last, recurse=False)
            loss = model(_inputs(10 * it + mb, 4, 8)).float().sum()
            loss.backward()
            losses.append(loss.detach())
        grads.append(_local_grads(model))
        if on_pycomm and reduce_scatters is not None:
            reduce_scatters.append(_recorded_ops(mesh, seq)["reduce_scatter_tensor"])
        opt.step()
        # set_to_none=False mixes accumulation with and without communication
        opt.zero_grad(set_to_none=it % 2 == 1)
    return losses, grads, _full_params(model)


def _one_f_one_b(mesh, explicit_unshard: bool):
    """test_fully_shard_training.py test_1f1b_microbatching: no resharding after forward,
    parameters optionally all-gathered up front, gradients reduced on the last microbatch."""
    model = _mlp_stack(mesh, reshard_after_forward=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if explicit_unshard:
        handles = [m.unshard(async_op=True) for m in _fsdp_modules(model)]
        for handle in handles:
            if handle is not None:
                handle.wait()
    losses = []
    for mb in range(3):
        last = mb == 2
        model.set_requires_gradient_sync(last)
        model.set_is_last_backward(last)
        model.set_reshard_after_backward(last)
        loss = model(_inputs(mb, 4, 8)).sum()
        loss.backward()
        losses.append(loss.detach())
    grads = _local_grads(model)
    opt.step()
    return losses, grads, _full_params(model)


def _gradient_accumulation(rank, world):
    meshes = _meshes()
    # test_fully_shard_training.py TestFullyShardGradientAccumulation and
    # test_fully_shard_grad_acc.py: set_requires_gradient_sync for all / the root only /
    # some MLPs (recurse=False), set_reshard_after_backward, accumulation mixed with
    # zero_grad(set_to_none=False); the reduce-scatters pycomm runs are torch's count:
    # one per FSDP group on the last microbatch, every microbatch for the groups left on.
    groups = 4  # the root and 3 MLPs
    for mode, raf, rab, expected in (("all", False, False, groups),
                                     ("root_only", True, True, 1 + 3 * 3),
                                     ("some_mlps", True, True, 2 + 2 * 3)):
        counts = []
        _same_on_both(f"accumulation mode={mode}", _accumulate, meshes, mode, raf, rab,
                      reduce_scatters=counts)
        assert counts == [expected, expected], (mode, counts)
    # test_fully_shard_mixed_precision.py test_grad_acc_with_reduce_dtype: bf16 compute,
    # unsharded gradients accumulated (and reduced) in fp32
    _same_on_both("accumulation in fp32 under bf16", _accumulate, meshes, "all", True, True,
                  mixed=True)
    for explicit in (False, True):
        _same_on_both(f"1f1b explicit_unshard={explicit}", _one_f_one_b, meshes, explicit)


def test_gradient_accumulation_without_sync():
    run_ranks(_gradient_accumulation, world_size=2)


# --- mixed precision ----------------------------------------------------------------------


def _train_mixed(mesh, param_dtype, reduce_dtype, output_dtype=None, reshard=True):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                  output_dtype=output_dtype)
    model = _mlp_stack(mesh, dim=16, reshard_after_forward=reshard, mp_policy=policy)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    losses, grads = [], []
    for step in range(3):
        out = model(_inputs(step, 4, 16))
        assert out.dtype == (output_dtype or param_dtype or torch.float32)
        loss = out.sum()
        loss.backward()
        losses.append(loss.detach())
        grads.append(_local_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    return losses, grads, _full_params(model)


def _cast_after_init(mesh):
    """test_fully_shard_training.py test_to_float64_after_init: model.to(float64) after
    fully_shard (swapping the parameters), then float64 all-gathers and reduce-scatters."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model = _mlp_stack(mesh).to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    grads = []
    for step in range(2):
        model(_inputs(step, 4, 8, dtype=torch.float64)).sum().backward()
        grads.append(_local_grads(model))
        assert all(g.dtype == torch.float64 for g in grads[-1])
        opt.step()
        opt.zero_grad()
    return grads, _full_params(model)


def _mixed_precision(rank, world):
    meshes = _meshes()
    # test_fully_shard_mixed_precision.py: compute dtype (bf16 and fp16 parameters, the
    # reduce-scatter in that dtype; fp16's with pre/post division), reduce dtype (bf16
    # compute with fp32 reduction, fp32 compute with bf16 reduction), output_dtype
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    for param_dtype, reduce_dtype, output_dtype, reshard in ((bf16, None, None, True),
                                                            (bf16, fp32, None, False),
                                                            (None, bf16, None, True),
                                                            (fp16, None, fp32, True)):
        _same_on_both(f"mixed precision {param_dtype}/{reduce_dtype}/{output_dtype}",
                      _train_mixed, meshes, param_dtype, reduce_dtype, output_dtype, reshard)
    _same_on_both("float64 after init", _cast_after_init, meshes)


def test_mixed_precision():
    run_ranks(_mixed_precision, world_size=2)


# --- frozen and shared parameters ---------------------------------------------------------


def _bias_only(mesh, freeze_after_init: bool):
    """test_fully_shard_frozen.py test_train_mixed_requires_grad_per_group: only the biases
    train (frozen weights share each FSDP group), frozen before or after fully_shard."""

    def freeze(model):
        for name, param in model.named_parameters():
            if "bias" not in name:
                param.requires_grad_(False)

    model = _mlp_stack(mesh, dim=16, before=None if freeze_after_init else freeze)
    if freeze_after_init:
        freeze(model)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    grads = []
    for step in range(3):
        model(_inputs(step, 8, 16)).sum().backward()
        grads.append(_local_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    return grads, _full_params(model)


def _frozen_across_groups(mesh, reshard):
    """test_fully_shard_frozen.py test_train_mixed_requires_grad_across_groups: every other
    Linear frozen, a no_grad step in between, everything unfrozen for the last step."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(16, 16), nn.ReLU())])
    linears = [m for m in model if isinstance(m, nn.Linear)]
    for linear in linears:
        fully_shard(linear, mesh=mesh, reshard_after_forward=reshard)
    for linear in linears[::2]:
        linear.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, losses, grads = _inputs(0, 8, 16), [], []
    for step in range(3):
        if step == 2:
            model.requires_grad_(True)
        if step == 1:
            with torch.no_grad():
                losses.append(model(x).sum())
            continue
        loss = model(x).sum()
        loss.backward()
        losses.append(loss.detach())
        grads.append(_local_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    return losses, grads, _full_params(model)


class _Reused(nn.Module):
    """test_fully_shard_frozen.py test_multi_forward_mixed_requires_grad: a trainable and a
    frozen module each run several times per forward, some of the runs under no_grad."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(5, 5)
        self.frozen = nn.Linear(5, 5)
        self.trained = nn.Linear(5, 5)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        for _ in range(3):
            x = self.frozen(torch.relu(self.trained(x)))
            with torch.no_grad():  # in place: x keeps its autograd history
                x += torch.relu(self.trained(x))
        return x


class _Tied(nn.Module):
    """test_fully_shard_training.py test_train_shared_params_uneven_shard: the output
    projection is the embedding (one parameter, in one FSDP group), unevenly sharded."""

    def __init__(self, vocab: int, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mix(self.embed(ids))))


def _train_module(mesh, make, reshard, steps: int = 3):
    """`make(mesh, reshard)` builds the model, shards its submodules and gives the loss of a
    step; the root is sharded here."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model, loss_of_step = make(mesh, reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(steps):
        loss = loss_of_step(step)
        loss.backward()
        losses.append(loss.detach())
        grads.append(_local_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    return losses, grads, _full_params(model)


def _make_reused(mesh, reshard):
    from torch.distributed.fsdp import fully_shard
    model = _Reused()
    for linear in (model.first, model.frozen, model.trained):
        fully_shard(linear, mesh=mesh, reshard_after_forward=reshard)
    return model, lambda step: model(_inputs(step, 8, 5)).sum()


def _make_tied(mesh, reshard):
    from torch.distributed.fsdp import fully_shard
    vocab = 4 * dist.get_world_size() + 1
    model = _Tied(vocab)
    fully_shard([model.embed, model.out], mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model.mix, mesh=mesh, reshard_after_forward=reshard)

    def loss(step):
        g = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
        ids = torch.randint(0, vocab, (2, 8), generator=g)
        return nn.functional.cross_entropy(model(ids).view(-1, vocab), ids.view(-1))
    return model, loss


def _frozen_and_shared(rank, world):
    meshes = _meshes()
    for after in (False, True):
        _same_on_both(f"bias only, frozen after init={after}", _bias_only, meshes, after)
    for reshard in (True, False):
        _same_on_both(f"frozen across groups reshard={reshard}", _frozen_across_groups,
                      meshes, reshard)
        _same_on_both(f"reused frozen/trained modules reshard={reshard}", _train_module,
                      meshes, _make_reused, reshard)
        ours = _same_on_both(f"tied embedding reshard={reshard}", _train_module, meshes,
                             _make_tied, reshard, 6)
        # every row of the tied, unevenly sharded weight trained, the padded shard's too
        torch.manual_seed(0)
        initial = _Tied(4 * world + 1).embed.weight.detach()
        assert not (ours[2][0] == initial).all(dim=1).any(), "a tied row never moved"


def test_frozen_and_shared_parameters():
    run_ranks(_frozen_and_shared, world_size=2)


# --- gradient divide factors and the all-reduce hook -------------------------------------


def _train_divided(mesh, setup: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    world = mesh.size()
    opts = {}
    if setup == "mixed, factor = world":
        opts["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32)
    model = _mlp_stack(mesh, reshard_after_forward=False, **opts)
    fsdp = _fsdp_modules(model)
    for module in fsdp:
        if setup == "deprecated alias, factor = world":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module.set_reduce_scatter_divide_factor(world)
        elif setup in ("factor = world", "mixed, factor = world"):
            module.set_gradient_divide_factor(world)
        elif setup == "sums only":  # torchtitan's: a plain sum, the loss normalised instead
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
        elif setup == "forced sum":  # a sum, then FSDP divides by the world itself
            module.set_force_sum_reduction_for_comms(True)
        elif setup == "forced sum, factor = 2 world":
            module.set_gradient_divide_factor(2 * world)
            module.set_force_sum_reduction_for_comms(True)
        elif setup == "all-reduce hook":
            group = mesh.get_group()

            def hook(reduced: torch.Tensor, group=group) -> None:
                reduced.mul_(0.5)
                dist.all_reduce(reduced, group=group)
            module.set_all_reduce_hook(hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(3):
        loss = model(_inputs(step, 4, 8)).sum()
        loss.backward()
        losses.append(loss.detach())
        grads.append(_local_grads(model))
        opt.step()
        opt.zero_grad()
    return losses, grads, _full_params(model)


def _refused_premul_sum(mesh) -> str:
    """A divide factor other than the world size asks for ReduceOp.PREMUL_SUM, which only
    NCCL has: Gloo and pycomm both refuse it, before any rank sends anything."""
    model = _mlp_stack(mesh, n=1)
    model.set_gradient_divide_factor(2 * mesh.size())
    with pytest.raises((RuntimeError, ValueError)) as refused:
        model(_inputs(0, 4, 8)).sum().backward()
    return type(refused.value).__name__, str(refused.value)


def _divide_factors(rank, world):
    meshes = _meshes()
    # test_fully_shard_comm.py test_set_reduce_scatter_divide_factor (and its mixed
    # precision case), TestFullyShardForceSumReduction (set_force_sum_reduction_for_comms);
    # test_fully_shard_init.py TestHSDPWithCustomHook: set_all_reduce_hook on 1-D FSDP
    for setup in ("deprecated alias, factor = world", "factor = world", "mixed, factor = world",
                  "sums only", "forced sum", "forced sum, factor = 2 world",
                  "all-reduce hook"):
        _same_on_both(f"divide: {setup}", _train_divided, meshes, setup)
    refusals = {backend: _refused_premul_sum(mesh) for backend, mesh in meshes.items()}
    # Gloo raises RuntimeError, pycomm ValueError (docs/shm-backend.md, "Operations"),
    # naming the op
    assert {b: kind for b, (kind, _) in refusals.items()} == {
        "gloo": "RuntimeError", "pycomm": "ValueError"}, refusals
    assert "ReduceOp.PREMUL_SUM is not supported" in refusals["pycomm"][1], refusals
    for mesh in meshes.values():  # both groups still work after the refusal
        t = torch.ones(2)
        dist.all_reduce(t, group=mesh.get_group())
        assert t.tolist() == [world, world]


def test_gradient_divide_factors_and_hooks():
    run_ranks(_divide_factors, world_size=2)


# --- explicit unshard / reshard, prefetching, forward methods ----------------------------


class _Overlapped(nn.Module):
    """test_fully_shard_comm.py test_unshard_async: each branch's activation is all-reduced
    asynchronously on the mesh's own group while the next MLP's parameters are all-gathered
    (unshard(async_op=True)); plus a method other than forward run under FSDP
    (test_fully_shard_training.py test_register_fsdp_forward_method)."""

    def __init__(self, dim: int, group: dist.ProcessGroup):
        super().__init__()
        self.group = group
        self.mixers = nn.ParameterList(nn.Parameter(torch.randn(dim, dim) / dim ** 0.5)
                                       for _ in range(3))
        self.mlps = nn.ModuleList(_MLP(dim) for _ in range(3))
        self.proj = _Projector(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pending = []
        for mixer, mlp in zip(self.mixers, self.mlps):
            y = x @ mixer
            pending.append((y, dist.all_reduce(y, group=self.group, async_op=True)))
            mlp.unshard(async_op=True)
        out = self.proj.features(x)
        for (y, work), mlp in zip(pending, self.mlps):
            work.wait()
            out = out + mlp(torch.relu(y))
        return out


class _Projector(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x).sum(dim=-1)


def _explicit_unshard(mesh):
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
    from torch.distributed.tensor import DTensor
    torch.manual_seed(0)
    dim = 8
    model = _Overlapped(dim, mesh.get_group())
    reference = [p.detach().clone() for p in model.parameters()]
    third = model.mlps[2]
    fully_shard(third.in_proj, mesh=mesh)
    fully_shard(third.out_proj, mesh=mesh)
    for mlp in model.mlps:
        fully_shard(mlp, mesh=mesh, reshard_after_forward=False)
    fully_shard(model.proj, mesh=mesh)
    register_fsdp_forward_method(model.proj, "features")
    fully_shard(model, mesh=mesh)
    # test_fully_shard_comm.py test_backward_misprefetch: in_proj "prefetches" out_proj,
    # which backward has already passed
    third.in_proj.set_modules_to_backward_prefetch([third.out_proj])

    # test_fully_shard_comm.py test_unshard_without_lazy_init / test_unshard_no_param_group
    # and test_fully_shard_training.py test_param_registration_after_forward: unshard()
    # before the first forward registers the full parameters, reshard() the shards
    fsdp = _fsdp_modules(model)
    handles = [m.unshard(async_op=True) for m in fsdp]
    for handle in handles:
        if handle is not None:
            handle.wait()
    unsharded = [p.detach().clone() for p in model.parameters()]
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    for a, b in zip(unsharded, reference):
        assert torch.equal(a, b), "unshard() did not gather the original parameters"
    for m in fsdp:
        m.reshard()
    assert all(isinstance(p, DTensor) for p in model.parameters())

    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    losses, grads = [], []
    for step in range(4):
        if step == 3:  # test_fully_shard_comm.py test_set_reshard_after_forward
            model.set_reshard_after_forward(True)
        loss = model(_inputs(step, 4, dim)).sum()
        if step % 2 == 1:
            # test_manual_reshard_with_reshard_after_forward_false: reshard by hand
            # between forward and backward, so backward all-gathers again
            for m in fsdp:
                m.reshard()
        loss.backward()
        losses.append(loss.detach())
        grads.append(_local_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    return unsharded, losses, grads, _full_params(model)


def _unshard_reshard(rank, world):
    _same_on_both("explicit unshard/reshard, async overlap, forward method", _explicit_unshard,
                  _meshes())


def test_explicit_unshard_reshard_and_overlap():
    run_ranks(_unshard_reshard, world_size=2)


# --- state dicts and torch.distributed.checkpoint -----------------------------------------


def _steps(model, opt, steps: range) -> None:
    for step in steps:
        model(_inputs(step, 4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()


def _fresh(mesh, reshard=True):
    model = _mlp_stack(mesh, reshard_after_forward=reshard)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _state_dicts(mesh, root: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )
    from torch.distributed.tensor import DTensor
    group = mesh.get_group()
    backend = dist.get_backend(group)
    model, opt = _fresh(mesh, reshard=False)
    _steps(model, opt, range(2))
    # test_fully_shard_state_dict.py test_dp_state_dict_save_load: after a forward that
    # left the parameters unsharded, state_dict() gives the shards (DTensors) all the same
    model(_inputs(9, 4, 8))
    sharded = model.state_dict()
    assert all(isinstance(v, DTensor) for v in sharded.values())
    local = {k: v.to_local().clone() for k, v in sharded.items()}
    for m in _fsdp_modules(model):
        m.reshard()
    # test_fsdp_dsd.py: get_model_state_dict equals state_dict(); the full state dict
    # offloaded to the CPU on rank 0 only
    assert get_model_state_dict(model).keys() == sharded.keys()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    assert (len(full) > 0) == (dist.get_rank() == 0)
    # torch.distributed.checkpoint round trip of the model and Adam's state, coordinated
    # on the mesh's group: a model loaded from it takes the step the saved one takes
    model_sd, optim_sd = get_state_dict(model, opt)
    path = f"{root}/{backend}"
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=group)
    saved = _full_params(model)
    _steps(model, opt, range(2, 3))
    continued = _full_params(model)
    loaded, loaded_opt = _fresh(mesh)
    model_sd, optim_sd = get_state_dict(loaded, loaded_opt)
    both = {"model": model_sd, "optim": optim_sd}
    dcp.load(both, checkpoint_id=path, process_group=group)
    set_state_dict(loaded, loaded_opt, model_state_dict=both["model"],
                   optim_state_dict=both["optim"])
    _steps(loaded, loaded_opt, range(2, 3))
    _assert_bitwise(_full_params(loaded), continued, f"{backend}: resumed from the checkpoint")
    # the full state dict back in, broadcast from rank 0 (which turns the dict's values into
    # the DTensors it loaded: keep a copy)
    full_copy = {k: v.clone() for k, v in full.items()}
    from_full, _ = _fresh(mesh)
    set_model_state_dict(from_full, full, options=StateDictOptions(full_state_dict=True,
                                                                   broadcast_from_rank0=True))
    restored = _full_params(from_full)
    _assert_bitwise(restored, saved, f"{backend}: loaded from the full state dict")
    # load_state_dict with new DTensors writes them into the sharded parameters
    filled = {k: v.detach().clone().fill_(42.0 + dist.get_rank()) for k, v in sharded.items()}
    from_full.load_state_dict(filled)
    assert all(torch.equal(p.to_local(), torch.full_like(p.to_local(), 42.0 + dist.get_rank()))
               for p in from_full.parameters())
    return local, full_copy, continued, restored


def _resume(mesh, path: str) -> list[torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model, opt = _fresh(mesh)
    model_sd, optim_sd = get_state_dict(model, opt)
    both = {"model": model_sd, "optim": optim_sd}
    dcp.load(both, checkpoint_id=path, process_group=mesh.get_group())
    set_state_dict(model, opt, model_state_dict=both["model"], optim_state_dict=both["optim"])
    _steps(model, opt, range(2, 3))  # Adam's state came back too
    return _full_params(model)


def _checkpoints(rank, world, root):
    meshes = _meshes()
    _same_on_both("state dicts and checkpoints", _state_dicts, meshes, root)
    # a checkpoint is the same whichever backend wrote it: Gloo's loads on pycomm as
    # pycomm's own does
    _assert_bitwise(_resume(meshes["pycomm"], f"{root}/gloo"),
                    _resume(meshes["pycomm"], f"{root}/pycomm"),
                    "Gloo's checkpoint loaded on pycomm")


def test_state_dicts_and_distributed_checkpoint(tmp_path):
    run_ranks(_checkpoints, world_size=2, root=str(tmp_path))


# --- replicate (FSDP's DDP), and FSDP with ignored parameters under DDP ------------------


def _replicate_train(mesh, layout: str):
    """test_replicate_with_fsdp.py test_train_replicate_fsdp / test_replicate_transformer,
    test_replicate_training.py (gradient accumulation, train parity): replicate on every
    MLP and the root, or replicate and fully_shard mixed, or torch's DDP on the same group;
    two microbatches per step, the first without gradient sync."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = nn.Sequential(_MLP(8), _MLP(8), nn.Linear(8, 4))
    if layout == "ddp":
        model = DDP(model, process_group=mesh.get_group())
    else:
        replicate(model[0], mesh=mesh)
        if layout == "replicate":
            replicate(model[1], mesh=mesh)
        else:
            fully_shard(model[1], mesh=mesh)
        replicate(model, mesh=mesh)
        expected = {"replicate": (Replicate(),), "mixed": (Shard(0),)}[layout]
        assert all(p.placements == expected for p in model[1].parameters())
        assert all(p.placements == (Replicate(),) for p in model[0].parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for it in range(3):
        for mb in range(2):
            last = mb == 1
            if layout == "ddp":
                sync = contextlib.nullcontext() if last else model.no_sync()
            else:
                model.set_requires_gradient_sync(last)
                sync = contextlib.nullcontext()
            with sync:
                loss = model(_inputs(10 * it + mb, 4, 8)).sum()
                loss.backward()
            losses.append(loss.detach())
        grads.append(_local_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=it % 2 == 0)
    return losses, grads, _full_params(model)


class _Inner(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.core = nn.Linear(dim, dim)  # ignored by FSDP, reduced by DDP
        self.offset = nn.Parameter(torch.randn(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.core(x)) - self.offset


class _Outer(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.inner = _Inner(dim)
        self.addend = nn.Parameter(torch.randn(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.inner(x) + self.addend).sum()


def _ignored_under_ddp(mesh, composed: bool = True):
    """test_fully_shard_ignore_params.py test_ddp_A_fsdp_B_ddp_C: FSDP on the inner module
    with its core's parameters ignored, DDP over the whole model ignoring what FSDP holds,
    both on the same group (`composed=False`: DDP alone, torch's reference)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = _Outer(8)
    inner = model.inner
    if composed:
        fully_shard(inner.lin, mesh=mesh)
        fully_shard(inner, mesh=mesh, ignored_params=set(inner.core.parameters()))
        held = [f"inner.{name}" for name, _ in inner.named_parameters() if "core" not in name]
        assert not any(isinstance(p, DTensor) for p in inner.core.parameters())
        DDP._set_params_and_buffers_to_ignore_for_model(model, held)
    ddp = DDP(model, process_group=mesh.get_group(), broadcast_buffers=False)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(3):
        loss = ddp(_inputs(step, 8, 8))
        loss.backward()
        losses.append(loss.detach())
        grads.append(_local_grads(model))
        with implicit_replication():
            opt.step()
            opt.zero_grad()
    return losses, grads, _full_params(model)


def _replicate(rank, world):
    meshes = _meshes()
    runs = {layout: _same_on_both(f"replicate layout={layout}", _replicate_train, meshes, layout)
            for layout in ("replicate", "mixed", "ddp")}
    # replicate averages with one all-reduce (sum, then halve), DDP halves each gradient
    # and sums: halving is exact, so at 2 ranks the two are the same bits
    _assert_bitwise(runs["replicate"], runs["ddp"], "replicate against DDP")
    composed = _same_on_both("fully_shard with ignored parameters under DDP",
                             _ignored_under_ddp, meshes)
    alone = _ignored_under_ddp(meshes["gloo"], composed=False)
    # the same losses and parameters as DDP alone (gradients differ in shape: shards)
    _assert_bitwise((composed[0], composed[2]), (alone[0], alone[2]), "FSDP under DDP vs DDP")


def test_replicate_and_ddp_composition():
    run_ranks(_replicate, world_size=2)


# --- 4 ranks: HSDP on a 2 x 2 mesh, native and by hook; resharding to 2 of 4 ranks -------


def _hsdp_train(mesh, accumulate: str):
    """test_fully_shard_training.py test_train_parity_hsdp and test_gradient_accumulation
    (HSDP, reduce_scatter_only): set_requires_gradient_sync (neither reduce-scatter nor
    all-reduce until the last microbatch) or set_requires_all_reduce (reduce-scatter every
    microbatch, all-reduce on the last), or neither (both reductions every microbatch)."""
    from torch.distributed.tensor import Replicate, Shard
    model = _mlp_stack(mesh, reshard_after_forward=accumulate == "no sync")
    assert all(p.placements == (Replicate(), Shard(0)) for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for it in range(2):
        for mb in range(2):
            last = mb == 1
            if accumulate == "no sync":
                model.set_requires_gradient_sync(last)
            elif accumulate == "reduce-scatter only":
                model.set_requires_all_reduce(last)
            loss = model(_inputs(10 * it + mb, 4, 8)).sum()
            loss.backward()
            losses.append(loss.detach())
        grads.append(_local_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=it % 2 == 0)
    return losses, grads, _full_params(model)


def _hsdp_by_hook(mesh):
    """test_fully_shard_init.py test_custom_hsdp_all_reduce_hook: FSDP over the shard
    dimension only, its all-reduce hook averaging across replicas: HSDP by hand, which
    must train as native HSDP (the same two reductions, in the same order)."""
    from torch.distributed.tensor import DTensor
    replicas = mesh.get_group("replicate")
    model = _mlp_stack(mesh["shard"], reshard_after_forward=False)
    for module in _fsdp_modules(model):
        module.set_all_reduce_hook(
            lambda reduced: dist.all_reduce(reduced, op=dist.ReduceOp.AVG, group=replicas))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for it in range(2):
        for mb in range(2):
            loss = model(_inputs(10 * it + mb, 4, 8)).sum()
            loss.backward()
            losses.append(loss.detach())
        grads.append(_local_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=it % 2 == 0)
    assert all(isinstance(p, DTensor) and p.device_mesh.ndim == 1 for p in model.parameters())
    return losses, grads, _full_params(model)


def _reshard_to_two(mesh):
    """test_fully_shard_training.py test_train_parity_multi_group (reshard_after_forward=2)
    and test_fully_shard_frozen.py: after forward the parameters are resharded over 2 of the
    4 ranks. FSDP makes that smaller mesh itself, on the default backend (Gloo), so only
    the forward all-gathers and the reduce-scatters run on the mesh's backend."""
    model = _mlp_stack(mesh, reshard_after_forward=2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(2):
        loss = model(_inputs(step, 4, 8)).sum()
        loss.backward()
        losses.append(loss.detach())
        grads.append(_local_grads(model))
        opt.step()
        opt.zero_grad()
    return losses, grads, _full_params(model)


def _four_ranks(rank, world):
    hsdp = _hsdp_meshes(world)
    for accumulate in ("no sync", "reduce-scatter only"):
        _same_on_both(f"HSDP {accumulate}", _hsdp_train, hsdp, accumulate)
    native = _same_on_both("HSDP", _hsdp_train, hsdp, "none")
    by_hand = _same_on_both("HSDP by hand: FSDP and an all-reduce hook", _hsdp_by_hook, hsdp)
    _assert_bitwise(by_hand, native, "HSDP by hand against native HSDP")
    _same_on_both("reshard after forward to 2 of 4 ranks", _reshard_to_two, _meshes())


def test_hsdp_and_partial_resharding_on_four_ranks():
    run_ranks(_four_ranks, world_size=4)
