"""The wrapper's state: state_dict and torch.save / pickling; and graph features beyond
plain parity: create_graph, autocast with GradScaler, buffers, a 1-D device_mesh."""

from __future__ import annotations

import copy
import io

import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from tests.support.ddp_models import assert_same, build, loss_of, make_input
from tests.support.multirank import run_ranks


def _state_and_pickle(rank, world_size):
    base = build("convbn")
    ref = TorchDDP(copy.deepcopy(base))
    ours = pycomm.DistributedDataParallel(copy.deepcopy(base))
    assert list(ref.state_dict()) == list(ours.state_dict())
    assert [n for n, _ in ref.named_parameters()] == [n for n, _ in ours.named_parameters()]
    ours.eval()
    assert not ours.module.bn.training
    ours.train()
    loss_of(ours(make_input("convbn", rank, 0))).backward()
    fresh = pycomm.DistributedDataParallel(build("convbn"))
    fresh.load_state_dict(ours.state_dict())
    assert_same(ours, fresh, "load_state_dict", exact=True, grads=False)
    buf = io.BytesIO()
    torch.save(ours, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert isinstance(loaded, pycomm.DistributedDataParallel)
    # The unpickled wrapper trains in lockstep with the original.
    for m in (ours, loaded):
        for p in m.parameters():
            p.grad = None
        loss_of(m(make_input("convbn", rank, 1))).backward()
    assert_same(ours, loaded, "after torch.load", exact=True)
    # A pickle from before the delayed all-reduce existed has neither of its attributes.
    state = copy.deepcopy(ours.__getstate__())
    del state["_delayed_spec"], state["_delayed_names"]
    older = pycomm.DistributedDataParallel.__new__(pycomm.DistributedDataParallel)
    older.__setstate__(state)
    for m in (ours, older):
        for p in m.parameters():
            p.grad = None
        loss_of(m(make_input("convbn", rank, 2))).backward()
    assert_same(ours, older, "after loading an older pickle", exact=True)


def _graph_features(rank, world_size):
    base = build("mlp")
    models = [TorchDDP(copy.deepcopy(base)), pycomm.DistributedDataParallel(copy.deepcopy(base))]
    for m in models:  # create_graph=True: a gradient penalty on the input
        x = make_input("mlp", rank, 0).requires_grad_()
        (gx,) = torch.autograd.grad(m(x).sum(), x, create_graph=True)
        (gx.square().sum() + loss_of(m(x))).backward()
    assert_same(*models, "create_graph", exact=True)
    for m in models:  # autocast + GradScaler
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(2):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_of(m(make_input("mlp", rank, step)))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert_same(*models, "autocast+GradScaler", exact=True)
    view = pycomm.DistributedDataParallel(build("mlp"), gradient_as_bucket_view=True)
    loss_of(view(make_input("mlp", rank, 0))).backward()
    for i, p in enumerate(view.module.parameters()):  # param.grad IS the bucket slot
        assert p.grad.data_ptr() == view.reducer.grad_view(i).data_ptr()
    branchy = pycomm.DistributedDataParallel(build("branchy"), find_unused_parameters=True)
    loss_of(branchy(make_input("mlp", rank, 0))).backward()
    tl = branchy.timelines(1)[-1]
    unused = {n: t for n, t in zip(tl["param_names"], tl["param_ready_ns"]) if t < 0}
    assert set(unused) == {"b.weight", "b.bias", "unused.weight", "unused.bias"}, unused
    from torch.distributed.device_mesh import init_device_mesh
    meshed = pycomm.DistributedDataParallel(build("mlp"), device_mesh=init_device_mesh(
        "cpu", (world_size,)))
    loss_of(meshed(make_input("mlp", rank, 0))).backward()
    assert_same(view, meshed, "1-D device_mesh", exact=True)
    bn = pycomm.DistributedDataParallel(build("convbn"))
    with torch.no_grad():
        bn.module.bn.running_mean.fill_(float(rank))
    bn(make_input("convbn", rank, 0))  # buffers come from rank 0 before the forward
    assert bn.module.bn.running_mean.abs().max() < 1.0


def test_state_dict_pickle_create_graph_autocast_and_buffers():
    run_ranks(_state_and_pickle, 2)
    run_ranks(_graph_features, 2)
