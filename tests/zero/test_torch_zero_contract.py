"""The behaviours torch's own ZeroRedundancyOptimizer tests check, with pycomm's class
(docs/zero.md lists each and where pycomm's differs): the constructor's inputs and
refusals, step(closure, **kwargs) handed to the wrapped optimizer, keys the wrapped
optimizer adds, schedulers, zero_grad, parameter groups added later, the shard sizes,
consolidated state dicts, uneven inputs under join, replicas kept equal when every rank
steps its own gradients (4 ranks, a subgroup of the even ones), and parity with an
unsharded optimizer under torch's DDP and pycomm's, parameters frozen on the way."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.optim import SGD, AdamW

import pycomm
from tests.support.multirank import run_ranks

Zero = pycomm.ZeroRedundancyOptimizer


def _one(value: float = 1.0) -> torch.Tensor:
    return torch.tensor([value], requires_grad=True)


def _three_linear(widths=(5, 10, 10, 10)) -> torch.nn.Sequential:
    return torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])])


def _single_rank_api(rank, world_size):
    # state dicts: torch's keys, groups in sync, reloaded lr and momentum win
    x = _one()
    o = Zero([x], SGD, lr=0.1, momentum=0.9)
    x.backward()
    o.step()
    assert torch.equal(x.detach(), torch.tensor([0.9]))
    o.zero_grad()
    o.consolidate_state_dict(to=0)
    saved = o.state_dict()
    group = saved["param_groups"][0]
    assert (group["lr"], group["momentum"], group["nesterov"], group["weight_decay"],
            group["dampening"]) == (0.1, 0.9, False, 0.0, 0.0)
    assert all(o.param_groups[0][k] == v for k, v in group.items() if k != "params")
    assert torch.equal(saved["state"][0]["momentum_buffer"], torch.tensor([1.0]))
    o = Zero([x], SGD, lr=0.01)
    o.load_state_dict(saved)
    assert o.param_groups[0]["lr"] == 0.1, "the loaded lr, not the constructor's"
    x.backward()
    o.step()
    torch.testing.assert_close(x.detach(), torch.tensor([0.71]))
    o.consolidate_state_dict(to=0)
    torch.testing.assert_close(o.state_dict()["state"][0]["momentum_buffer"],
                               torch.tensor([1.9]))
    assert o.param_groups[0]["params"][0].device == x.device

    # an lr scheduler steps it as torch's SGD
    a, b = _one(), _one()
    oa, ob = Zero([a], SGD, lr=0.01), SGD([b], lr=0.01)
    sa, sb = (torch.optim.lr_scheduler.StepLR(o, 1) for o in (oa, ob))
    for _ in range(5):
        for t, o, s in ((a, oa, sa), (b, ob, sb)):
            t.backward()
            o.zero_grad()  # after the backward, as torch's test does: nothing to step
            o.step()
            s.step()
        assert torch.equal(a, b)

    # step's closure and keyword arguments reach the wrapped optimizer's step
    class KeywordStep(SGD):
        def step(self, closure=None, kwarg=None):
            super().step()
            kwarg.append(closure)

    seen: list = []
    x = _one()
    o = Zero([x], KeywordStep, lr=0.1)
    x.backward()
    o.step(0, kwarg=seen)
    assert seen == [0], "a closure that is not callable is handed over as it is"
    assert torch.equal(x.detach(), torch.tensor([0.9]))

    # keys the wrapped optimizer adds to its groups show in the optimizer's
    class NewKey(SGD):
        def step(self, closure=None):
            super().step()
            self.param_groups[0]["new_key"] = 0.1

    x = _one()
    o = Zero([x], NewKey, lr=0.1)
    x.backward()
    o.step()
    assert o.param_groups[0]["new_key"] == 0.1
    assert torch.equal(x.detach(), torch.tensor([0.9]))

    # a wrapped optimizer whose step takes no closure
    class NoClosure(SGD):
        def step(self):
            return super().step()

    x = _one()
    o = Zero([x], NoClosure, lr=0.1)
    x.backward()
    o.step()
    assert torch.equal(x.detach(), torch.tensor([0.9]))

    # zero_grad sets the gradients to None
    m = torch.nn.Linear(1, 1)
    o = Zero(m.parameters(), SGD, lr=0.01)
    m(torch.rand(1)).sum().backward()
    assert m.weight.grad is not None
    o.zero_grad()
    assert m.weight.grad is None and m.bias.grad is None

    # the constructor takes what torch's Optimizer takes, and refuses what it refuses
    m = _three_linear()
    for params, error in (([], ValueError), (torch.randn(1), TypeError), (1.2, TypeError),
                          (list(m.parameters()) + [42], TypeError)):
        with pytest.raises(error):
            Zero(params, SGD, lr=0.01)
    two_groups = [{"params": [layer.weight for layer in m]},
                  {"params": [layer.bias for layer in m]}]
    for params in (two_groups, m.parameters(), list(m.parameters())):
        Zero(params, SGD, lr=0.01)
    o = Zero([{"params": [layer.weight for layer in m], "weight_decay": 0.0},
              {"params": [layer.bias for layer in m], "weight_decay": 0.01}], AdamW, lr=0.01,
             betas=(0.9, 0.999), eps=1e-8)
    assert len(o.param_groups) == len(o.optim.param_groups) == 2

    # sparse parameters are refused by name, alone or among dense ones
    for params in ([torch.sparse_coo_tensor(size=(2, 3))],
                   [torch.zeros(1), torch.zeros(1), torch.sparse_coo_tensor(size=(2, 3))]):
        with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[\d\] is a "
                                             r"torch.sparse_coo tensor"):
            Zero(params, SGD, lr=0.01)
    # dense parameters of several dtypes are sharded (torch's refuses them): each steps as
    # the unsharded optimizer steps it
    pair = [torch.ones(3, requires_grad=True), torch.ones(2, dtype=torch.float64,
                                                          requires_grad=True)]
    twin = [t.detach().clone().requires_grad_() for t in pair]
    for ts, o in ((pair, Zero(pair, SGD, lr=0.1)), (twin, SGD(twin, lr=0.1))):
        sum(t.sum() for t in ts).backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(pair, twin))
    # no parameter requires a gradient: built all the same
    Zero([torch.rand(3, 1), torch.rand(5, 1)], SGD, lr=0.01)


def test_single_rank_api_as_torch():
    run_ranks(_single_rank_api, 1)


def _groups_and_shards(rank, world_size):
    sizes = [9, 7, 5, 3]
    # every rank steps an equal share of the elements
    o = Zero([torch.rand(n, 1) for n in sizes * world_size], SGD, lr=0.01)
    assert sum(t.numel() for t in o.optim.param_groups[0]["params"]) == sum(sizes)
    # a group added later is sharded with the rest; the wrapped optimizer has a group for it
    params = [torch.rand(n, 1, requires_grad=True) for n in (sizes * world_size)[:-1]]
    o = Zero(params, SGD, lr=0.01)
    o.add_param_group({"params": [torch.rand(3, 1)]})
    assert len(o.param_groups) == len(o.optim.param_groups) == 2
    assert sum(t.numel() for g in o.optim.param_groups for t in g["params"]) == sum(sizes)
    params = [torch.rand(n, 1) for n in (100, 3, 5, 2, 6, 4)]
    for p in params[1:]:
        p.requires_grad = True
    o = Zero(params, SGD, lr=0.01)
    o.add_param_group({"params": [torch.rand(3, 1)]})
    assert len(o.param_groups) == len(o.optim.param_groups) == 2

    # groups given up front, or added after construction, against an unsharded AdamW;
    # and a group added after a step (the state held moves onto the new cut), against
    # an unsharded AdamW given the group at the same step
    torch.manual_seed(0)
    base = _three_linear((5, 10, 10, 5))
    models = [copy.deepcopy(base) for _ in range(5)]
    up_front = Zero([{"params": [layer.weight for layer in models[0]], "weight_decay": 0.0},
                     {"params": [layer.bias for layer in models[0]], "weight_decay": 0.01}],
                    AdamW, lr=0.01)
    added = Zero([layer.weight for layer in models[1]], AdamW, lr=0.01, weight_decay=0.0)
    added.add_param_group({"params": [layer.bias for layer in models[1]], "weight_decay": 0.01})
    plain = AdamW([{"params": [layer.weight for layer in models[2]], "weight_decay": 0.0},
                   {"params": [layer.bias for layer in models[2]], "weight_decay": 0.01}], lr=0.01)
    late = Zero([layer.weight for layer in models[3]], AdamW, lr=0.01, weight_decay=0.0)
    plain_late = AdamW([layer.weight for layer in models[4]], lr=0.01, weight_decay=0.0)
    optimizers = (up_front, added, plain, late, plain_late)
    for step in range(3):
        x = torch.randn(8, 5, generator=torch.Generator().manual_seed(step))
        for model, opt in zip(models, optimizers):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        if step == 0:
            for model, opt in zip(models[3:], optimizers[3:]):
                opt.add_param_group({"params": [layer.bias for layer in model],
                                     "weight_decay": 0.01})
        for ours, theirs in ((models[0], models[2]), (models[1], models[2]),
                             (models[3], models[4])):
            for a, b in zip(ours.parameters(), theirs.parameters()):
                torch.testing.assert_close(a, b, msg=f"step {step}")


def test_parameter_groups_and_shard_sizes_as_torch():
    run_ranks(_groups_and_shards, 2)


def _collect_shards(rank, world_size, ddp):
    torch.manual_seed(0)
    model = _three_linear((20, 10, 5))
    if ddp:
        model = pycomm.DistributedDataParallel(model)
    o = Zero(model.parameters(), SGD, lr=1e-3, momentum=0.99)
    inputs, target = torch.rand(3, 20), torch.rand(3, 5)

    def closure():
        o.zero_grad()
        loss = torch.nn.functional.l1_loss(model(inputs), target)
        loss.backward()
        return loss

    loss = o.step(closure=closure)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0
    o.consolidate_state_dict(to=0)
    saved = [o.state_dict() if rank == 0 else None]
    if rank == 0:
        assert len(saved[0]["state"]) == len(list(model.parameters()))
    dist.broadcast_object_list(saved, src=0)
    o.load_state_dict(saved[0])
    o.step(closure=closure)


@pytest.mark.parametrize("ddp", [False, True], ids=["alone", "pycomm_ddp"])
def test_consolidated_state_dict_loads_on_every_rank(ddp):
    run_ranks(_collect_shards, 2, ddp=ddp)


def _own_gradients_on_a_subgroup(rank, world_size):
    """Each rank steps its own gradients (no DDP), on a group of the even ranks: every
    element has one owner, so the replicas stay equal (the tails included: 10 * 20 + 10
    elements over 2 ranks, 5 * 10 + 5 over 2, ... and 4 ranks on the whole world)."""
    evens = [r for r in range(world_size) if r % 2 == 0]
    sub = dist.new_group(ranks=evens)
    for group, members in ((sub, evens), (None, list(range(world_size)))):
        if rank not in members:
            continue
        torch.manual_seed(0)
        model = _three_linear((20, 10, 5))
        o = Zero(model.parameters(), SGD, lr=1e-3, momentum=0.99, process_group=group)
        torch.manual_seed(rank)  # every rank its own data
        for step in range(5):
            x, target = torch.rand(3, 20), torch.rand(3, 5)

            def closure(o=o, model=model, x=x, target=target):
                o.zero_grad()
                loss = torch.nn.functional.l1_loss(model(x), target)
                loss.backward()
                return loss

            o.step(closure=closure)
            for name, p in model.named_parameters():
                everyone = [torch.empty_like(p) for _ in members]
                dist.all_gather(everyone, p.detach(), group=group)
                for r, other in zip(members[1:], everyone[1:]):
                    assert torch.equal(everyone[0], other), \
                        f"step {step}: {name} differs between ranks {members[0]} and {r}"


def test_replicas_equal_with_own_gradients_on_four_ranks_and_a_subgroup():
    run_ranks(_own_gradients_on_a_subgroup, 4)


def _local_optimizer_parity(rank, world_size, wrapper, optimizer, maximize):
    torch.manual_seed(rank)  # different initial weights: the DDP broadcasts rank 0's
    model = _three_linear((2, 3, 3, 3))
    model.test_buffer = torch.nn.Buffer(torch.ones(1) * rank)
    options = {"maximize": True} if maximize else {}
    cls = getattr(torch.optim, optimizer)
    sharded_opt = Zero(model.parameters(), cls, lr=1e-3, **options)
    wrap = TorchDDP if wrapper == "torch" else pycomm.DistributedDataParallel
    sharded = wrap(model, broadcast_buffers=True, find_unused_parameters=True)
    local = copy.deepcopy(model)
    local_opt = cls(local.parameters(), lr=1e-3, **options)
    reference = TorchDDP(local, broadcast_buffers=True, find_unused_parameters=True)

    def check_step(step):
        x = torch.rand(64, 2)
        losses = []
        for ddp, opt in ((reference, local_opt), (sharded, sharded_opt)):
            def closure(ddp=ddp, opt=opt):
                opt.zero_grad()
                loss = ddp(x).abs().sum()
                loss.backward()
                return loss

            losses.append(opt.step(closure=closure))
        torch.testing.assert_close(losses[0], losses[1])
        for (name, p), q in zip(sharded.module.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=f"step {step}: {name}")
        for a, b in zip(sharded.module.buffers(), reference.module.buffers()):
            assert torch.equal(a, b)

    for step in range(20):
        check_step(step)
        if step > 10:  # frozen and thawed in turn, on both
            for ddp in (reference, sharded):
                next(ddp.parameters()).requires_grad = bool(step % 2)
    # state dicts load across: the unsharded optimizer's into the sharded one, and back
    theirs = local_opt.state_dict()
    sharded_opt.consolidate_state_dict(to=0)
    ours = [sharded_opt.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(ours, src=0)
    kept = copy.deepcopy(theirs)
    # (a copy: torch's Adam steps the 'step' tensors it loaded in place)
    local_opt.load_state_dict(copy.deepcopy(ours[0]))
    sharded_opt.load_state_dict(theirs)
    check_step(20)
    local_opt.load_state_dict(kept)
    sharded_opt.load_state_dict(ours[0])
    check_step(21)


@pytest.mark.parametrize("wrapper", ["torch", "pycomm"])
@pytest.mark.parametrize("optimizer,maximize", [("Adam", False), ("AdamW", True),
                                                ("SGD", False)])
def test_parity_with_a_local_optimizer_under_ddp(wrapper, optimizer, maximize):
    run_ranks(_local_optimizer_parity, 2, wrapper=wrapper, optimizer=optimizer,
              maximize=maximize)


class _GradsAfterJoining(JoinHook):
    def __init__(self, zero, grads):
        self.zero, self.grads = zero, list(grads)

    def main_hook(self):
        for p, g in zip(self.zero._all_params, self.grads.pop(0)):
            p.grad = g.clone()


class _GradientSetter(Joinable):
    def __init__(self):
        super().__init__()

    def join_hook(self, **kwargs):
        return _GradsAfterJoining(kwargs["zero_optim"], kwargs["grads"])

    @property
    def join_device(self):
        return torch.device("cpu")

    @property
    def join_process_group(self):
        return dist.group.WORLD


def _uneven_inputs(rank, world_size):
    """Rank r has r more inputs. The optimizer's join hook shadows the steps of the ranks
    still training; a hook before it sets the gradients they used (recorded from torch's
    DDP with Adam under join, on the last rank)."""
    torch.manual_seed(0)
    model = _three_linear((2, 3, 3, 3))
    ddp = TorchDDP(copy.deepcopy(model))
    local = torch.optim.Adam(ddp.parameters(), lr=0.01)
    zero_model = copy.deepcopy(model)
    zero = Zero(zero_model.parameters(), torch.optim.Adam, lr=0.01)
    inputs = [torch.randn(20, 2) for _ in range(3 + rank)]
    labels = torch.randn(20, 3)
    grads, params = [], []
    with ddp.join():
        for _ in range(2):
            for x in inputs:
                torch.nn.functional.mse_loss(ddp(x), labels).backward()
                grads.append([p.grad.detach().clone() for p in ddp.parameters()])
                local.step()
                params.append([p.detach().clone() for p in ddp.parameters()])
    recorded = [grads, params]
    dist.broadcast_object_list(recorded, src=world_size - 1)
    grads, params = recorded
    after = 2 * (world_size - rank - 1)
    setter = _GradientSetter()
    with Join([setter, zero], zero_optim=zero, grads=grads[len(grads) - after:]):
        step = 0
        for _ in range(2):
            for _x in inputs:
                Join.notify_join_context(setter)
                for p, g in zip(zero_model.parameters(), grads[step]):
                    p.grad = g.clone()
                zero.step()
                for p, q in zip(zero_model.parameters(), params[step]):
                    torch.testing.assert_close(p, q)
                step += 1


def test_uneven_inputs_under_join():
    run_ranks(_uneven_inputs, 2)
