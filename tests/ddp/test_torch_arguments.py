"""torch 2.13 DDP constructor arguments that pycomm implements, each against torch's DDP
given the same argument: skip_all_reduce_unused_params, batched_grad_copy,
delay_all_reduce_named_params + param_to_hook_all_reduce, and a device_mesh that is the
data-parallel slice of a 2-D mesh. mixed_precision stays refused (tests/ddp/test_errors.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from tests.support.ddp_models import Branchy, assert_same, build, lockstep, loss_of, make_input
from tests.support.multirank import run_ranks

DDP = pycomm.DistributedDataParallel


class TensorBranchy(Branchy):
    """Branchy returning a plain tensor: torch's static_graph does not reduce step 1 when
    the output is a dataclass (its _DDPSink never sees the tensors; seen while writing
    this test), so it would be no oracle on Branchy itself."""

    def forward(self, x):
        return super().forward(x).value


def _static_skip_lockstep(rank, steps=3):
    torch.manual_seed(7)
    base = TensorBranchy()
    kwargs = dict(static_graph=True, skip_all_reduce_unused_params=True, bucket_cap_mb=1e-6)
    models = [TorchDDP(copy.deepcopy(base), **kwargs),
              DDP(copy.deepcopy(base), config=pycomm.DDPConfig(shared_memory_gradients=False,
                                                                **kwargs))]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    for step in range(steps):
        for m, opt in zip(models, opts):
            opt.zero_grad()
            loss_of(m(make_input("mlp", rank, step))).backward()
        assert_same(models[0], models[1], f"static_graph skip step {step}", exact=True)
        for opt in opts:
            opt.step()
    return models[1]


def _launched_buckets(ddp, rank) -> list[int]:
    """Indices of the buckets whose collective one more step launches."""
    launched: list[int] = []
    ddp.reducer.add_pre_launch(lambda i, buf: launched.append(i))
    loss_of(ddp(make_input("branchy", rank, 9))).backward()
    return launched


def _skip_unused(rank, world_size):
    # branchy: `b` and `unused` never take part, on every rank (torch's precondition).
    for kwargs in (dict(find_unused_parameters=True),
                   dict(find_unused_parameters=True, gradient_as_bucket_view=True),
                   dict(static_graph=True)):
        if "static_graph" in kwargs:
            ours = _static_skip_lockstep(rank)
        else:
            ours = lockstep(rank, "branchy", steps=3, bucket_cap_mb=1e-6,
                            skip_all_reduce_unused_params=True, **kwargs)
        names = [n for n, _ in ours._named_params]
        used = {i for i, n in enumerate(names) if n.split(".")[0] in ("trunk", "a")}
        buckets = ours.reducer.bucket_indices()
        launched = _launched_buckets(ours, rank)
        # One parameter per bucket: exactly the used ones communicate.
        assert sorted(buckets[i][0] for i in launched) == sorted(used), (kwargs, launched)
    # torch's join does not shadow skipped buckets either (it hangs): refused, clearly.
    with pytest.raises(NotImplementedError, match="join.*skip_all_reduce_unused_params"):
        ours.join()
    plain = lockstep(rank, "branchy", steps=1, bucket_cap_mb=1e-6, find_unused_parameters=True)
    assert len(_launched_buckets(plain, rank)) == len(plain.reducer.bucket_indices())


def test_skip_all_reduce_unused_params_matches_torch_and_skips_the_buckets():
    run_ranks(_skip_unused, 2, deadline_s=120)


def _batched_copy(rank, world_size):
    cases = (dict(model="mlp"),
             dict(model="convbn", gradient_as_bucket_view=True, zero_to_none=False),
             dict(model="attn", no_sync_every=1),
             dict(model="mlp", hook=lambda: (None, allreduce_hook)))
    for case in cases:
        # World 3: x / 3 (torch's batched numerics) and x * (1/3) differ in the last bit.
        # Default caps give these small models one bucket in both (torch's step-1 layout):
        # Gloo's ring adds the 3 terms in the same order: bitwise.
        lockstep(rank, steps=2, batched_grad_copy=True, **case)
    # One parameter per bucket: pycomm's step-1 layout differs from torch's single bucket,
    # so the 3-term summation order does too: fp32 tolerance (see assert_same).
    lockstep(rank, "mlp", steps=2, exact=False, batched_grad_copy=True, bucket_cap_mb=1e-6)
    # The mode really changes the numbers at world 3 (else the above proves little).
    base = build("mlp")
    pair = [TorchDDP(copy.deepcopy(base), batched_grad_copy=b) for b in (False, True)]
    for m in pair:
        loss_of(m(make_input("mlp", rank, 0))).backward()
    differs = torch.tensor([any(not torch.equal(p.grad, q.grad) for p, q in
                                zip(pair[0].parameters(), pair[1].parameters()))], dtype=torch.int)
    dist.all_reduce(differs)
    assert differs.item() > 0


def test_batched_grad_copy_matches_torch_bitwise_at_world_3():
    run_ranks(_batched_copy, 3, deadline_s=120)


def _delayed(rank, world_size):
    base = build("mlp")
    models = []
    for cls in (TorchDDP, DDP):
        module = copy.deepcopy(base)
        delayed = [(n, p) for n, p in module.named_parameters() if not n.startswith("net.0")]
        kwargs = dict(delay_all_reduce_named_params=delayed,
                      param_to_hook_all_reduce=module.net[0].weight)
        if cls is DDP:
            kwargs["config"] = pycomm.DDPConfig(shared_memory_gradients=False)
        models.append(cls(module, **kwargs))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    for step in range(3):
        for m, opt in zip(models, opts):
            opt.zero_grad()
            loss_of(m(make_input("mlp", rank, step))).backward()
        # torch drops the delayed all-reduce's handle; a Gloo barrier waits for prior work.
        dist.barrier()
        # World 2: the same division then a 2-term sum on both sides: bitwise.
        assert_same(models[0], models[1], f"delayed all-reduce step {step}", exact=True)
        for opt in opts:
            opt.step()
    ours = models[1]
    for p, view in zip(ours._delayed.params, ours._delayed.views):
        assert p.grad.data_ptr() == view.data_ptr()
    assert [n for n, _ in ours._named_params] == ["net.0.weight", "net.0.bias"]
    with pytest.raises(NotImplementedError, match="join.*delay_all_reduce_named_params"):
        ours.join()
    module = build("mlp")
    with pytest.raises(NotImplementedError, match="every trainable parameter"):
        DDP(module, delay_all_reduce_named_params=list(module.named_parameters()),
            param_to_hook_all_reduce=module.net[0].weight)


def test_delay_all_reduce_named_params_matches_torch():
    run_ranks(_delayed, 2, deadline_s=90)


def _mesh_slice(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "tp"))
    with pytest.raises(NotImplementedError, match="1-D"):
        DDP(build("mlp"), device_mesh=mesh)
    with pytest.raises(RuntimeError, match="1D"):
        TorchDDP(build("mlp"), device_mesh=mesh)  # torch refuses a 2-D mesh too
    models = [TorchDDP(build("mlp"), device_mesh=mesh["dp"]),
              DDP(build("mlp"), device_mesh=mesh["dp"])]
    for m in models:
        loss_of(m(make_input("mlp", rank, 0))).backward()
    assert_same(models[0], models[1], "dp slice of a 2-D mesh", exact=True)


def test_device_mesh_dp_slice_of_a_2d_mesh_matches_torch():
    run_ranks(_mesh_slice, 2, deadline_s=60)


def _buffer_sync_attributes(rank, world_size):
    for kwargs in (dict(), dict(forward_sync_buffers=False, batched_grad_copy=True)):
        models = [cls(build("mlp"), **kwargs) for cls in (TorchDDP, DDP)]
        for name in ("forward_sync_buffers", "broadcast_buffers", "batched_grad_copy"):
            assert getattr(models[0], name) == getattr(models[1], name), (kwargs, name)
        for m in models:  # one option under both names, as in torch
            m.forward_sync_buffers = not m.forward_sync_buffers
        assert [m.broadcast_buffers for m in models] == [models[0].forward_sync_buffers] * 2


def test_buffer_sync_and_batched_copy_attributes_read_as_torchs():
    run_ranks(_buffer_sync_attributes, world_size=2)
