"""pycomm.optim.AdamW / Adam and one_pass(): torch's optimizer contract (torch's
test_optim.py behaviours: state_dict both ways, add_param_group, LR schedulers, step
hooks, closures, GradScaler, deepcopy) with torch's for-loop bits, stepped by the one-pass
kernel; torch's own step, with one warning naming why, wherever the kernel does not apply;
the same through pycomm's and torch's DDP and through the Lightning, Accelerate and HF
Trainer construction paths."""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import pycomm
from pycomm.optim import ONE_PASS_STEP
from tests.support.multirank import run_ranks

SIZES = ((300, 40), (40,), (513,), (7, 5))


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in SIZES]


def _grads(step, params):
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for p in params:
        grad = torch.randn(p.shape, generator=g) * 10.0 ** (step % 3 - 1)
        grad.view(-1)[: p.numel() // 4] = 0.0  # exp_avg_sq zero there
        out.append(grad)
    return out


def _assert_same(theirs, ours, ref, mine):
    for i, (a, b) in enumerate(zip(theirs, ours)):
        assert torch.equal(a, b), f"param {i}"
        for key, value in ref.state[a].items():
            assert torch.equal(value, mine.state[b][key]), f"{key} of param {i}"


@pytest.mark.parametrize("cls, options", [
    (torch.optim.AdamW, {"weight_decay": 0.05}),
    (torch.optim.Adam, {}),
    (torch.optim.Adam, {"weight_decay": 0.1, "decoupled_weight_decay": True}),
], ids=["adamw", "adam", "adam-decoupled"])
@pytest.mark.parametrize("how", ["class", "one_pass"])
def test_bitwise_torch_with_groups_a_scheduler_and_a_group_added(cls, options, how):
    """Two groups, a StepLR built on the optimizer, a third group added after two steps:
    every parameter and state tensor equals torch's for-loop, and the kernel ran."""
    theirs, ours = _params(), _params()

    def build(ps, which):
        groups = [{"params": ps[:1], "lr": 3e-3}, {"params": ps[1:3]}]
        if which is None:
            return cls(groups, lr=1e-3, **options)
        if which == "class":
            return {torch.optim.AdamW: pycomm.optim.AdamW,
                    torch.optim.Adam: pycomm.optim.Adam}[cls](groups, lr=1e-3, **options)
        return pycomm.optim.one_pass(cls(groups, lr=1e-3, **options))

    ref, mine = build(theirs, None), build(ours, how)
    assert isinstance(mine, cls) and mine.one_pass_reason() is None
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (ref, mine)]
    for step in range(6):
        if step == 2:
            ref.add_param_group({"params": theirs[3:], "lr": 2e-3})
            mine.add_param_group({"params": ours[3:], "lr": 2e-3})
        for a, b, g in zip(theirs, ours, _grads(step, theirs)):
            a.grad, b.grad = g, g.clone()
        ref.step()
        mine.step()
        assert mine.step_kernel == ONE_PASS_STEP
        for s in scheds:
            s.step()
        _assert_same(theirs, ours, ref, mine)


def test_one_pass_keeps_the_state_and_both_state_dicts_load():
    """one_pass() on an optimizer that already stepped carries on from its state; its
    state_dict loads into torch's class and torch's into it, each run bitwise one run."""
    runs = [_params() for _ in range(3)]
    opts = [torch.optim.AdamW(p, lr=1e-2) for p in runs]
    for step in range(6):
        if step == 2:
            opts[1] = pycomm.optim.one_pass(opts[1])
        if step == 4:  # hand the state across, both ways
            fresh_torch = torch.optim.AdamW(runs[1], lr=1e-2)
            fresh_torch.load_state_dict(opts[1].state_dict())
            fresh_ours = pycomm.optim.AdamW(runs[2], lr=1e-2)
            fresh_ours.load_state_dict(opts[2].state_dict())
            opts[1], opts[2] = fresh_torch, fresh_ours
        for run in runs:
            for p, g in zip(run, _grads(step, run)):
                p.grad = g
        for o in opts:
            o.step()
    for which in (1, 2):
        _assert_same(runs[0], runs[which], opts[0], opts[which])


def test_step_hooks_run_once_around_the_kernel_and_closures_return_their_loss():
    ps = _params()
    opt = pycomm.optim.AdamW(ps, lr=1e-3)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(("pre", o.step_kernel)))
    opt.register_step_post_hook(lambda o, a, k: seen.append(("post", o.step_kernel)))
    handle = register_optimizer_step_post_hook(
        lambda o, a, k: seen.append(("global", o.step_kernel)))
    try:
        calls = []

        def closure():
            calls.append(torch.is_grad_enabled())
            loss = sum((p * p).sum() for p in ps)
            opt.zero_grad()
            loss.backward()
            return loss

        loss = opt.step(closure)
    finally:
        handle.remove()
    assert calls == [True] and isinstance(loss, torch.Tensor)
    assert seen == [("pre", None), ("post", ONE_PASS_STEP), ("global", ONE_PASS_STEP)]


def test_grad_scaler_and_deepcopy_as_torch():
    """torch's GradScaler steps it (skipping the step whose gradients overflowed), and a
    deepcopy steps on as the original."""
    theirs, ours = _params(), _params()
    ref, mine = torch.optim.AdamW(theirs, lr=1e-3), pycomm.optim.AdamW(ours, lr=1e-3)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    for step in range(4):
        grads = _grads(step, theirs)
        if step == 1:
            grads[0].view(-1)[-1] = float("inf")
        for scaler, opt, ps in zip(scalers, (ref, mine), (theirs, ours)):
            opt.zero_grad()
            loss = sum((p * g).sum() for p, g in zip(ps, grads))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert scalers[1].get_scale() == scalers[0].get_scale() == 2.0**9  # one step skipped
    _assert_same(theirs, ours, ref, mine)
    assert mine.step_kernel == ONE_PASS_STEP
    twin = copy.deepcopy(mine)
    assert type(twin) is pycomm.optim.AdamW
    for p, q, g in zip(mine.param_groups[0]["params"], twin.param_groups[0]["params"],
                       _grads(9, ours)):
        p.grad, q.grad = g, g.clone()
    mine.step()
    twin.step()
    for p, q in zip(mine.param_groups[0]["params"], twin.param_groups[0]["params"]):
        assert torch.equal(p, q)


@pytest.mark.parametrize("options, expect", [
    ({"fused": True}, "fused"),
    ({"amsgrad": True}, "amsgrad"),
    ({"maximize": True}, "maximize"),
    ({"lr": torch.tensor(1e-3)}, "tensor hyperparameter"),
], ids=["fused", "amsgrad", "maximize", "tensor-lr"])
def test_what_the_kernel_does_not_take_runs_torch_s_step_and_warns_once(options, expect):
    theirs, ours = _params(), _params()
    ref = torch.optim.AdamW(theirs, **{"lr": 1e-3, **options})
    mine = pycomm.optim.AdamW(ours, **{"lr": 1e-3, **options})
    assert expect in mine.one_pass_reason()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            for a, b, g in zip(theirs, ours, _grads(step, theirs)):
                a.grad, b.grad = g, g.clone()
            ref.step()
            mine.step()
    ours_warned = [w for w in caught if "pycomm.optim.AdamW" in str(w.message)]
    assert len(ours_warned) == 1 and expect in str(ours_warned[0].message)
    assert mine.step_kernel.startswith("AdamW.step (") and expect in mine.step_kernel
    _assert_same(theirs, ours, ref, mine)


def test_a_float64_model_steps_as_torch():
    theirs = [p.detach().double().requires_grad_() for p in _params()]
    ours = [p.detach().clone().requires_grad_() for p in theirs]
    ref, mine = torch.optim.AdamW(theirs), pycomm.optim.AdamW(ours)
    with pytest.warns(UserWarning, match="torch.float64"):
        for step in range(2):
            for a, b, g in zip(theirs, ours, _grads(step, theirs)):
                a.grad, b.grad = g.double(), g.double()
            ref.step()
            mine.step()
    _assert_same(theirs, ours, ref, mine)


def test_one_pass_refusals_name_the_class_or_the_scheduler():
    with pytest.raises(TypeError, match="got torch.optim.sgd.SGD"):
        pycomm.optim.one_pass(torch.optim.SGD(_params(), lr=0.1))

    class MyAdamW(torch.optim.AdamW):
        pass

    with pytest.raises(TypeError, match=r"\(exactly, built\), got .*MyAdamW"):
        pycomm.optim.one_pass(MyAdamW(_params()))
    opt = torch.optim.AdamW(_params())
    torch.optim.lr_scheduler.StepLR(opt, 1)
    with pytest.raises(TypeError, match="call one_pass\\(\\) before building the scheduler"):
        pycomm.optim.one_pass(opt)
    built = pycomm.optim.AdamW(_params())
    assert pycomm.optim.one_pass(built) is built


# ---- through DDP, and through the libraries that build the optimizer --------------------

def _ddp_bitwise(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    runs = []
    for wrap, make in ((TorchDDP, torch.optim.AdamW), (pycomm.DistributedDataParallel,
                                                        pycomm.optim.AdamW)):
        model = wrap(copy.deepcopy(net))
        runs.append((model, make(model.parameters(), lr=1e-2, weight_decay=0.1)))
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        x = torch.randn(8, 16, generator=g)
        for model, opt in runs:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    assert runs[1][1].step_kernel == ONE_PASS_STEP
    for a, b in zip(runs[0][0].parameters(), runs[1][0].parameters()):
        assert torch.equal(a, b)


def test_pycomm_ddp_with_the_one_pass_adamw_matches_torch_ddp_and_adamw_bitwise():
    run_ranks(_ddp_bitwise, 2)


def _tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g),
                                          torch.randn(64, 2, generator=g))


def test_lightning_configure_optimizers_with_one_pass_and_a_scheduler(tmp_path):
    pytest.importorskip("lightning")
    from lightning.pytorch import LightningModule, Trainer

    class Module(LightningModule):
        def __init__(self, one_pass):
            super().__init__()
            self.net, self.one_pass, self.kernels = _tiny(), one_pass, []

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def on_train_batch_end(self, *args):
            self.kernels.append(getattr(self.optimizers().optimizer, "step_kernel", None))

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            if self.one_pass:
                opt = pycomm.optim.one_pass(opt)
            return {"optimizer": opt,
                    "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)}

    finals = []
    for one_pass in (False, True):
        module = Module(one_pass)
        trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, default_root_dir=str(tmp_path))
        trainer.fit(module, torch.utils.data.DataLoader(_data(), batch_size=8))
        finals.append([p.detach().clone() for p in module.parameters()])
    assert module.kernels == [ONE_PASS_STEP] * 8
    for a, b in zip(*finals):
        assert torch.equal(a, b)


def test_accelerate_prepare_steps_the_one_pass_optimizer():
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    finals, kernels = [], None
    for make in (torch.optim.AdamW, pycomm.optim.AdamW):
        accelerator = Accelerator(cpu=True)
        model = _tiny()
        opt = make(model.parameters(), lr=1e-2)
        loader = torch.utils.data.DataLoader(_data(), batch_size=8)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        for x, y in loader:
            opt.zero_grad()
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
        kernels = getattr(opt.optimizer, "step_kernel", None)
        finals.append([p.detach().clone() for p in model.parameters()])
    assert kernels == ONE_PASS_STEP
    for a, b in zip(*finals):
        assert torch.equal(a, b)


def test_hf_trainer_builds_the_one_pass_adamw_from_its_class(tmp_path):
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    class Regressor(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _tiny()

        def forward(self, x, labels):
            return {"loss": nn.functional.mse_loss(self.net(x), labels)}

    class Rows(torch.utils.data.Dataset):
        def __init__(self):
            self.data = _data()

        def __len__(self):
            return len(self.data)

        def __getitem__(self, i):
            x, y = self.data[i]
            return {"x": x, "labels": y}

    finals = []
    for custom in (False, True):
        model = Regressor()
        args = TrainingArguments(
            output_dir=os.fspath(tmp_path), use_cpu=True, max_steps=6,
            per_device_train_batch_size=8, learning_rate=1e-2, weight_decay=0.01,
            lr_scheduler_type="linear", max_grad_norm=1.0, logging_steps=100,
            save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
            dataloader_num_workers=0, optim="adamw_torch")
        extra = ({"optimizer_cls_and_kwargs": (pycomm.optim.AdamW, {"lr": 1e-2,
                                                                    "weight_decay": 0.01})}
                 if custom else {})
        trainer = Trainer(model=model, args=args, train_dataset=Rows(), **extra)
        trainer.train()
        inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        assert isinstance(inner, pycomm.optim.AdamW) == custom
        if custom:
            assert inner.step_kernel == ONE_PASS_STEP
        finals.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*finals):
        assert torch.equal(a, b)
