"""pycomm's DDP where code expects torch's (pycomm/ddp/compat.py): the isinstance answer,
torch's attributes Lightning / Accelerate / the HF Trainer read, each beside torch's own
value, and the reducer methods they call from outside forward, against torch's DDP
running the same sequence."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from tests.support.ddp_models import MLP, ConvBN
from tests.support.multirank import run_ranks

# Attributes read as plain values, with the construction arguments that change them.
_SAME_VALUE = ("static_graph", "find_unused_parameters", "gradient_as_bucket_view",
               "broadcast_buffers", "bucket_bytes_cap", "require_backward_grad_sync",
               "require_forward_param_sync", "device_ids", "output_device", "dim")
_KWARGS = ({}, dict(find_unused_parameters=True, broadcast_buffers=False, bucket_cap_mb=5),
           dict(static_graph=True, gradient_as_bucket_view=True))


def test_is_a_virtual_subclass_of_torch_ddp():
    assert issubclass(pycomm.DistributedDataParallel, TorchDDP)
    # See Note [Virtual subclass of torch's DDP]: nothing of torch's class is inherited.
    assert TorchDDP not in pycomm.DistributedDataParallel.__mro__


def _attributes(rank, world_size):
    for kwargs in _KWARGS:
        torch.manual_seed(0)
        model = ConvBN()
        theirs = TorchDDP(copy.deepcopy(model), **kwargs)
        ours = pycomm.DistributedDataParallel(copy.deepcopy(model), **kwargs)
        assert isinstance(ours, TorchDDP)
        for name in _SAME_VALUE:
            assert getattr(ours, name) == getattr(theirs, name), (name, kwargs)
        assert ours.module is not None and list(ours.state_dict()) == list(theirs.state_dict())
        assert ours.parameters_to_ignore == theirs.parameters_to_ignore
        assert ours.will_sync_module_buffers() == theirs.will_sync_module_buffers()
        ours_log, theirs_log = ours._get_ddp_logging_data(), theirs._get_ddp_logging_data()
        for key, value in ours_log.items():
            if key in ("gradient_backend_name", "bucket_sizes", "dtypes"):
                continue  # pycomm's own values: its gradient group, buckets, dtype names
            assert value == theirs_log[key], (key, kwargs)
        assert ("static_graph" in ours_log) == ("static_graph" in theirs_log)
        assert "can_set_static_graph" not in ours_log
    ours.broadcast_buffers = False  # a setter, as torch's plain attribute
    assert not ours.config.broadcast_buffers and not ours.will_sync_module_buffers()


def test_torch_attributes_match_torch_ddp():
    run_ranks(_attributes)


def _set_static_graph(rank, world_size):
    torch.manual_seed(0)
    model = MLP()
    theirs, ours = TorchDDP(copy.deepcopy(model)), pycomm.DistributedDataParallel(model)
    # Keyword arguments, as Lightning and Accelerate pass them.
    for ddp in (theirs, ours):
        ddp.register_comm_hook(state=None, hook=default_hooks.allreduce_hook)
        ddp._set_static_graph()
        assert ddp.static_graph and ddp._get_ddp_logging_data()["static_graph"] == 1
    assert ours.reducer.has_comm_hook()
    x = torch.randn(4, 8).add(rank)
    for ddp in (theirs, ours):
        for _ in range(2):
            ddp(x).square().sum().backward()
    for a, b in zip(theirs.parameters(), ours.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="before the training loop"):
        fresh = pycomm.DistributedDataParallel(MLP())
        fresh(x).sum().backward()
        fresh._set_static_graph()


def test_set_static_graph_after_construction_matches_torch():
    run_ranks(_set_static_graph)


def _sync_in_backward(ddp, x, y, step):
    """Accelerate's trigger_sync_in_backward: two forwards under no_sync, one local
    backward, then a synchronized one armed from outside forward."""
    with ddp.no_sync():
        loss_a, loss_b = ddp(x).square().mean(), ddp(y).square().mean()
    loss_a.backward()
    ddp.require_backward_grad_sync = ddp.require_forward_param_sync = True
    ddp.reducer.prepare_for_backward([])
    loss_b.backward()


def _manual_optimization(ddp, x, y, step):
    """Lightning 2.6's manual optimization: its training_step runs inside the DDP forward
    (_ForwardRedirection swaps the module's forward) and calls backward there, after
    Lightning's prepare_for_backward (overrides/distributed.py), then _delay_all_reduce
    after the first backward of a static graph (DDPStrategy.post_backward); grad sync is
    switched off when training_step returns and on again after the DDP forward."""
    forward = ddp.module.forward

    def training_step(inputs):
        out = forward(inputs)
        if ddp.require_backward_grad_sync:
            ddp.require_forward_param_sync = True
            ddp.reducer._rebuild_buckets()
            ddp.reducer.prepare_for_backward(
                [out] if ddp.find_unused_parameters and not ddp.static_graph else [])
        out.square().mean().backward()
        if ddp.static_graph and step == 0:
            ddp.reducer._delay_all_reduce()
        ddp.require_backward_grad_sync = False

    ddp.module.forward = training_step
    try:
        ddp(x)
    finally:
        del ddp.module.forward
        ddp.require_backward_grad_sync = True


_OUTSIDE_FORWARD = (("_sync_in_backward", {}), ("_manual_optimization", {}),
                    ("_manual_optimization", {"find_unused_parameters": True}),
                    ("_manual_optimization", {"static_graph": True}))


def _reducer_outside_forward(rank, world_size):
    for sequence, kwargs in _OUTSIDE_FORWARD:  # one spawn for all: each costs seconds
        torch.manual_seed(0)
        model = MLP()
        theirs = TorchDDP(copy.deepcopy(model), **kwargs)
        ours = pycomm.DistributedDataParallel(model, **kwargs)
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + rank)
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
            for ddp in (theirs, ours):
                ddp.zero_grad()
                globals()[sequence](ddp, x, y, step)
            # Two ranks: each element's all-reduce adds the same two numbers, in either
            # order the same float; the reducer copies and scales as torch's: bit-exact.
            case = f"{sequence} {kwargs} step {step}"
            for a, b in zip(theirs.parameters(), ours.parameters()):
                torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0,
                                           msg=lambda m, case=case: f"{case}: {m}")
            summed = ours.module.net[0].weight.grad.clone()
            dist.all_reduce(summed)
            torch.testing.assert_close(summed / world_size, ours.module.net[0].weight.grad)


def test_reducer_armed_outside_forward_reduces_as_torch():
    run_ranks(_reducer_outside_forward)
