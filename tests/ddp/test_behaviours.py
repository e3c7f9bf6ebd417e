"""pycomm DDP behaviours beyond plain parity: buckets launch during backward (timeline),
a rank-dependent gradient-ready order still reduces correctly (Note [Bucket order]), the
per-bucket callbacks, fp32 reduction of bf16 gradients, join() with uneven inputs,
state_dict / torch.save of the wrapper, create_graph, autocast + GradScaler, buffers."""

from __future__ import annotations

import copy
import io

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm
from pycomm.objects import all_gather_object
from tests.support.ddp_models import assert_same, build, loss_of, make_input
from tests.support.multirank import run_ranks

TIMELINE_KEYS = {"step", "rank", "backward_start_ns", "param_ready_ns", "param_names",
                 "buckets", "finalize_start_ns", "finalize_end_ns"}
BUCKET_KEYS = {"index", "nbytes", "param_indices", "ready_ns", "launch_ns", "done_ns",
               "in_place"}


class TwoBranch(nn.Module):
    """Two independent branches; the rank decides which one autograd meets first."""

    def __init__(self):
        super().__init__()
        self.left = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.right = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x):
        # The engine runs the most recently created branch first.
        if dist.get_rank() % 2 == 0:
            a = self.left(x)
            b = self.right(x)
        else:
            b = self.right(x)
            a = self.left(x)
        return a + b


def _check_timeline(ddp, steps):
    tls = ddp.timelines(steps)
    assert [t["step"] for t in tls] == list(range(steps))
    for t in tls:
        assert set(t) == TIMELINE_KEYS and all(set(b) == BUCKET_KEYS for b in t["buckets"])
        assert len(t["param_ready_ns"]) == len(t["param_names"]) >= len(t["buckets"]) > 2
        last_ready = max(t["param_ready_ns"])
        launches = [b["launch_ns"] for b in t["buckets"]]
        # Overlap, from the first step on: a bucket's collective starts before the step's
        # last gradient is ready.
        assert launches[0] < last_ready, t
        # See Note [Bucket order]: launched in index order.
        assert launches == sorted(launches)
        for b in t["buckets"]:
            assert b["ready_ns"] <= b["launch_ns"] <= b["done_ns"] <= t["finalize_end_ns"]
        assert t["backward_start_ns"] <= min(t["param_ready_ns"])
    return tls


def _overlap_order_callbacks(rank, world_size):
    torch.manual_seed(0)
    base = TwoBranch()
    ref = TorchDDP(copy.deepcopy(base), bucket_cap_mb=1e-6)
    ours = pycomm.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=1e-6)
    seen_pre, seen_done = {}, {}
    ours.reducer.add_pre_launch(lambda i, buf: seen_pre.__setitem__(i, buf.clone()))
    ours.reducer.add_post_done(lambda i, buf: seen_done.__setitem__(i, buf.clone()))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    for step in range(3):
        x = make_input("mlp", rank, step)
        for m, o in zip((ref, ours), opts):
            o.zero_grad()
            m(x).square().mean().backward()
        assert_same(ref, ours, f"two-branch step {step}", exact=True)
        params = [p for _, p in ours.module.named_parameters()]
        for i, members in enumerate(ours.reducer.bucket_indices()):
            reduced = torch.cat([params[j].grad.flatten() for j in members])
            assert torch.equal(seen_done[i], reduced), f"post_done of bucket {i}"
            assert seen_pre[i].shape == reduced.shape
        for o in opts:
            o.step()
    tls = _check_timeline(ours, 3)
    # The ready order really differed between ranks (else this test proves nothing).
    order = sorted(range(len(tls[1]["param_ready_ns"])), key=lambda i: tls[1]["param_ready_ns"][i])
    orders = all_gather_object(order)
    assert orders[0] != orders[1], orders


def test_buckets_launch_during_backward_in_order_with_rank_dependent_ready_order():
    run_ranks(_overlap_order_callbacks, 2)


def _reduce_in_fp32(rank, world_size):
    base = build("mlp").to(torch.bfloat16)
    plain = copy.deepcopy(base)
    cfg = pycomm.DDPConfig(grad_reduce_dtype=torch.float32, bucket_cap_mb=1e-3)
    ddp = pycomm.DistributedDataParallel(copy.deepcopy(base), config=cfg)
    x = make_input("mlp", rank, 0).to(torch.bfloat16)
    loss_of(ddp(x)).backward()
    loss_of(plain(x)).backward()
    for (name, p), q in zip(plain.named_parameters(), ddp.module.parameters()):
        # Oracle, written out: widen, scale by 1/world in fp32, sum in fp32.
        want = p.grad.float() * (1.0 / world_size)
        dist.all_reduce(want)
        assert q.main_grad.dtype == torch.float32
        assert torch.equal(q.main_grad, want), name
        assert torch.equal(q.grad, want.to(torch.bfloat16)), name


def _join_uneven(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    for divide, hook in ((True, False), (False, False), (True, True)):
        base = build("mlp")
        models = [TorchDDP(copy.deepcopy(base)),
                  pycomm.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=1e-3)]
        for m in models:
            if hook:  # joined ranks shadow the buckets through the hook
                m.register_comm_hook(None, allreduce_hook)
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            with m.join(divide_by_initial_world_size=divide):
                for step in range(2 + 2 * rank):
                    opt.zero_grad()
                    loss_of(m(make_input("mlp", rank, step))).backward()
                    opt.step()
        assert_same(models[0], models[1], f"join divide={divide} hook={hook}", exact=True,
                    grads=False)


def _join_after_set_static_graph(rank, world_size):
    # _set_static_graph() inside join() rebuilds the reducer: a joined rank must shadow the
    # new one's buckets (the hook asks for the wrapper's current ForwardSync each time).
    base = build("mlp")
    models = [pycomm.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=1e-3,
                                             static_graph=True),
              pycomm.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=1e-3)]
    for late, m in enumerate(models):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with m.join():
            if late:
                m._set_static_graph()
            for step in range(2 + 2 * rank):
                opt.zero_grad()
                loss_of(m(make_input("mlp", rank, step))).backward()
                opt.step()
    assert_same(models[0], models[1], "join after _set_static_graph", exact=True,
                grads=False)


def test_reduce_bf16_grads_in_fp32_and_join_uneven_inputs():
    run_ranks(_reduce_in_fp32, 2)
    run_ranks(_join_uneven, 2)
    run_ranks(_join_after_set_static_graph, 2)


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
