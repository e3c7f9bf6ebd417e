"""pycomm.clip_grad_norm_ on FSDP2 / replicate / HSDP gradients (DTensors), against torch's
clip_grad_norm_ on the same gradients and against the float64 norm of the full gradients:
the same total and clipped gradients, one all-reduce per sharded mesh dimension (none for
replicate), the slot plan decided once per spec, torch's non-finite behaviour, several
meshes and pipeline stages (pp_mesh), and torch's clip routed here under pycomm.patch().
See Note [Clipping sharded gradients] in pycomm/fsdp/clip.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tests.support.multirank import run_ranks

NORM_TYPES = (2.0, 1.0, 3.0, 0.5, math.inf)


def _net(seed: int = 0) -> torch.nn.Module:
    # Uneven rows (33, 5, 7) over 2 and 3 ranks: padded shards, one rank short, one empty.
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5),
                               torch.nn.ReLU(), torch.nn.Linear(5, 7), torch.nn.Linear(7, 2))


def _shard(model: torch.nn.Module, mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _backward(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = None
    model(torch.randn(8, 16, generator=g)).square().mean().mul(100).backward()


def _full_norm(params, norm_type: float) -> float:
    """The float64 norm of the full gradients (every rank computes it from full_tensor)."""
    flat = torch.cat([p.grad.full_tensor().double().flatten() for p in params])
    return torch.linalg.vector_norm(flat, norm_type).item()


class _CountAllReduce:
    """Counts dist.all_reduce calls (pycomm's clip issues them; torch's clip uses functional
    collectives, which this does not count)."""

    def __init__(self):
        self.calls = 0
        self._orig = dist.all_reduce

    def __enter__(self):
        def counted(*args, **kwargs):
            self.calls += 1
            return self._orig(*args, **kwargs)
        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig


def _locals(params) -> list[torch.Tensor]:
    return [p.grad.to_local().clone() for p in params]


def _restore(params, saved) -> None:
    for p, s in zip(params, saved):
        p.grad.to_local().copy_(s)


def _against_torch(params, norm_type: float, max_norm: float, expect_all_reduces: int,
                   where: str) -> None:
    from torch.distributed.tensor import DTensor, Replicate

    import pycomm

    saved = _locals(params)
    ref = _full_norm(params, norm_type)
    empty_shard = torch.tensor([any(p.grad.to_local().numel() == 0 for p in params)])
    dist.all_reduce(empty_shard, op=dist.ReduceOp.MAX)
    if math.isinf(norm_type) and empty_shard.item():
        # torch's foreach inf-norm refuses an empty tensor ("does not have an identity"), so
        # its clip fails on a rank whose shard of a parameter is empty (and the others wait
        # in its collectives); an empty shard contributes nothing here. Compare with the
        # full norm and its coefficient instead.
        theirs = None
        coef = min(max_norm / (torch.tensor(ref, dtype=torch.float32).item() + 1e-6), 1.0)
        their_grads = [s * coef for s in saved]
    else:
        theirs = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        their_grads = _locals(params)
    _restore(params, saved)
    with _CountAllReduce() as count:
        ours = pycomm.clip_grad_norm_(params, max_norm, norm_type)
    assert count.calls == expect_all_reduces, (where, norm_type, count.calls)
    assert isinstance(ours, DTensor) and all(isinstance(p, Replicate) for p in ours.placements)
    torch.testing.assert_close(ours.full_tensor().double().item(), ref, rtol=2e-6, atol=0,
                               msg=lambda m: f"{where} p={norm_type}: {m}")
    if theirs is not None:
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        torch.testing.assert_close(ours.full_tensor(), theirs.full_tensor(), rtol=1e-5, atol=0)
    active = max_norm < ref
    for mine, torch_grad, before in zip(_locals(params), their_grads, saved):
        if active:
            torch.testing.assert_close(mine, torch_grad, rtol=1e-5, atol=1e-7)
        else:  # coefficient 1: nothing touched
            assert torch.equal(mine, before), (where, norm_type)
    _restore(params, saved)


def _fsdp_matches_torch(rank: int, world: int, group_backend: str) -> None:
    from torch.distributed.device_mesh import DeviceMesh

    import pycomm
    from pycomm.fsdp.clip import plan_stats

    group = dist.new_group(backend=group_backend)
    mesh = DeviceMesh.from_group(group, "cpu")
    model = _shard(_net(), mesh)
    params = list(model.parameters())
    for step in range(3):
        _backward(model, seed=100 * step + rank)
        if step == 1:
            built = plan_stats()["built"]
        for norm_type in NORM_TYPES:
            ref = _full_norm(params, norm_type)
            for max_norm in (0.25 * ref, 4 * ref):
                _against_torch(params, norm_type, max_norm, 1, f"fsdp {group_backend} w{world}")
    assert plan_stats()["built"] == built, "the slot plan was decided again at a later step"

    # torch's clip, patched, takes the fused path: one dist.all_reduce, torch's result
    _backward(model, seed=7 + rank)
    saved = _locals(params)
    unpatched = torch.nn.utils.clip_grad_norm_(params, 0.1)
    _restore(params, saved)
    with pycomm.patch(), _CountAllReduce() as count:
        patched = torch.nn.utils.clip_grad_norm_(params, 0.1)
    assert count.calls == 1
    torch.testing.assert_close(patched.full_tensor(), unpatched.full_tensor(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("world,backend", [(2, "gloo"), (3, "gloo"), (2, "pycomm")])
def test_fsdp2_clip_matches_torch_and_the_full_norm(world, backend):
    run_ranks(_fsdp_matches_torch, world_size=world, group_backend=backend)


def _nonfinite(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import DeviceMesh

    import pycomm

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    model = _shard(_net(), mesh)
    params = list(model.parameters())
    for bad in (math.nan, math.inf):
        for norm_type in (2.0, math.inf):
            _backward(model, seed=rank)
            if rank == world - 1:  # one rank only: the others must learn of it
                params[0].grad.to_local().view(-1)[0] = bad
            saved = _locals(params)
            # What torch's clip gives on the full gradients. (torch's clip on the DTensors
            # does not, for the inf norm with a NaN: its MAX all-reduce drops the NaN on some
            # ranks (58.1 on rank 0, NaN on rank 1 here), so its ranks scale differently.)
            full = torch.nn.utils.get_total_norm(
                [p.grad.full_tensor() for p in params], norm_type).item()
            ours = pycomm.clip_grad_norm_(params, 1.0, norm_type).full_tensor().item()
            where = (bad, norm_type, rank, ours, full)
            assert math.isnan(ours) == math.isnan(full), where
            assert math.isinf(ours) == math.isinf(full), where
            _restore(params, saved)
            with pytest.raises(RuntimeError, match="non-finite, so it cannot be clipped"):
                pycomm.clip_grad_norm_(params, 1.0, norm_type, error_if_nonfinite=True)
            for p, s in zip(params, saved):  # the refusal scaled nothing
                torch.testing.assert_close(p.grad.to_local(), s, rtol=0, atol=0,
                                           equal_nan=True)


def test_nonfinite_on_one_rank_reaches_every_rank_as_torch():
    run_ranks(_nonfinite, world_size=2)


def _meshes(rank: int, world: int) -> None:
    """4 ranks: HSDP on a 2 x 2 mesh, replicate, two meshes in one model, and two pipeline
    stages of 2 FSDP ranks each clipped together through pp_mesh."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import pycomm

    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    # HSDP: Replicate() on dim 0, Shard(0) on dim 1: one all-reduce, over "shard"
    hsdp = _shard(_net(), mesh2d)
    params = list(hsdp.parameters())
    _backward(hsdp, seed=rank)
    # (HSDP's gradients are reduced over "replicate" too: equal across it)
    for norm_type in NORM_TYPES:
        _against_torch(params, norm_type, 0.01, 1, "hsdp")

    # replicate: every gradient Replicate(): no all-reduce at all
    rep = replicate(_net(), mesh=init_device_mesh("cpu", (world,)))
    params = list(rep.parameters())
    _backward(rep, seed=rank)
    for norm_type in NORM_TYPES:
        _against_torch(params, norm_type, 0.01, 0, "replicate")

    # two meshes in one model: torch's clip refuses the mix; the norm is the whole model's
    mesh1d = init_device_mesh("cpu", (world,))
    model = _net()
    fully_shard(model[0], mesh=mesh1d)
    fully_shard(model[2], mesh=mesh2d)
    fully_shard(model[4], mesh=mesh1d)
    fully_shard(model[5], mesh=mesh2d)
    params = list(model.parameters())
    _backward(model, seed=rank)
    for norm_type in NORM_TYPES:
        ref = _full_norm(params, norm_type)
        saved = _locals(params)
        with _CountAllReduce() as count:
            total = pycomm.clip_grad_norm_(params, 0.5 * ref, norm_type)
        assert count.calls == 2, count.calls  # mesh1d's dim 0, mesh2d's "shard"
        assert type(total) is torch.Tensor
        torch.testing.assert_close(total.double().item(), ref, rtol=2e-6, atol=0)
        coef = 0.5 * ref / (total.item() + 1e-6)
        for p, s in zip(params, saved):
            torch.testing.assert_close(p.grad.to_local(), s * coef, rtol=1e-5, atol=1e-7)
        _restore(params, saved)

    # pipeline: ranks {0, 1} hold stage 0, {2, 3} stage 1; pp_mesh pairs them across stages
    pp_fsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = rank // 2
    model = _shard(_net(seed=stage), pp_fsdp["dp"])
    params = list(model.parameters())
    _backward(model, seed=rank)
    for norm_type in NORM_TYPES:
        mine = torch.tensor([_full_norm(params, norm_type)], dtype=torch.float64)
        inf = math.isinf(norm_type)
        both = mine if inf else mine.pow(norm_type)
        dist.all_reduce(both, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM,
                        group=pp_fsdp.get_group("pp"))
        ref = both.item() if inf else both.item() ** (1 / norm_type)
        saved = _locals(params)
        total = pycomm.clip_grad_norm_(params, 1e9, norm_type, pp_mesh=pp_fsdp["pp"])
        torch.testing.assert_close(total.double().item(), ref, rtol=2e-6, atol=0)
        assert all(torch.equal(p.grad.to_local(), s) for p, s in zip(params, saved))
    # a stage with no gradient still takes its part (a plain tensor group as pp_mesh)
    for p in params:
        p.grad = None
    total = pycomm.clip_grad_norm_(params, 1.0, pp_mesh=pp_fsdp.get_group("pp"))
    assert total.item() == 0.0


def test_hsdp_replicate_several_meshes_and_pipeline_stages():
    run_ranks(_meshes, world_size=4, deadline_s=600)


def _refusals(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial

    import pycomm

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    model = _shard(_net(), mesh)
    params = list(model.parameters())
    _backward(model, seed=rank)
    plain = torch.nn.Parameter(torch.ones(3))
    plain.grad = torch.ones(3)
    with pytest.raises(TypeError, match=r"parameters\[2\] has a plain Tensor gradient"):
        pycomm.clip_grad_norm_(params[:2] + [plain] + params[2:], 1.0)
    with pytest.raises(TypeError, match="pp_mesh must be a DeviceMesh or a ProcessGroup"):
        pycomm.clip_grad_norm_(params, 1.0, pp_mesh="pp")
    for pp in (None, dist.group.WORLD):  # the C++ path and the pipeline path
        with pytest.raises(RuntimeError, match="norm_type must be > 0 or inf, got 0"):
            pycomm.clip_grad_norm_(params, 1.0, norm_type=0.0, pp_mesh=pp)

    # A Partial gradient (pending sum): the norm is of the sum, the scale of the summands
    weight = torch.nn.Parameter(DTensor.from_local(torch.zeros(4, 3), mesh, [Partial()]))
    summand = torch.full((4, 3), float(rank + 1))
    weight.grad = DTensor.from_local(summand.clone(), mesh, [Partial()], run_check=False)
    total = pycomm.clip_grad_norm_([weight], 1.0)
    whole = sum(range(1, world + 1)) * torch.ones(4, 3)
    torch.testing.assert_close(total.full_tensor(), whole.norm())
    torch.testing.assert_close(weight.grad.to_local(), summand / whole.norm(), rtol=1e-6,
                               atol=0)


def test_refusals_name_what_is_wrong_and_partial_gradients_clip():
    run_ranks(_refusals, world_size=2)
