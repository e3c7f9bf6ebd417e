"""Lightning with pycomm (pycomm/lightning.py): Trainer.fit through the registered
"pycomm_ddp" strategy, with gradient accumulation and clipping, against the same fit
through Lightning's own DDPStrategy (torch's DDP): same losses, same final parameters, a
checkpoint that loads into the bare module."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import pycomm
from tests.support.multirank import free_port, run_ranks, set_launcher_env

_LIGHTNING = "the integrations extra (lightning) is absent"
_CLIP = 0.05
_STEPS, _ACCUMULATE, _BATCH = 3, 2, 4


def _module_class():
    from lightning.pytorch import LightningModule

    class Regressor(LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
            self.losses, self.norms, self.synced_steps = [], [], None

        def training_step(self, batch, _):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.detach().clone())
            return loss

        def on_before_optimizer_step(self, optimizer):  # before Lightning clips
            grads = [p.grad for p in self.parameters()]
            self.norms.append(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))

        def on_train_end(self):  # before the strategy unwraps its DDP
            ddp = self.trainer.strategy.model
            if isinstance(ddp, pycomm.DistributedDataParallel):
                self.synced_steps = len(ddp.timelines(64))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return Regressor


def _fit(strategy, world_size, root):
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(1)
    n = world_size * _STEPS * _ACCUMULATE * _BATCH
    data = TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 2, generator=g))
    torch.manual_seed(0)
    model = _module_class()()
    trainer = Trainer(accelerator="cpu", devices=world_size, num_nodes=1, strategy=strategy,
                      max_steps=_STEPS, accumulate_grad_batches=_ACCUMULATE,
                      gradient_clip_val=_CLIP, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=root)
    trainer.fit(model, DataLoader(data, batch_size=_BATCH))
    path = os.path.join(root, "last.ckpt")
    trainer.save_checkpoint(path)
    return trainer, model, path


def _fit_both(rank, world_size, port, root):
    set_launcher_env(rank, world_size, port)
    from lightning.pytorch.strategies import DDPStrategy

    import pycomm.lightning  # registers "pycomm_ddp"

    _, theirs, _ = _fit(DDPStrategy(), world_size, os.path.join(root, "torch"))
    trainer, ours, path = _fit("pycomm_ddp", world_size, os.path.join(root, "pycomm"))
    assert isinstance(trainer.strategy, pycomm.lightning.DDPStrategy)
    assert trainer.strategy.model is ours  # teardown unwrapped it: isinstance of torch's DDP
    assert isinstance(trainer.precision_plugin.clip_grad_by_norm, pycomm.lightning.FusedNormClip)
    # Accumulation ran the first micro-batch of each step under no_sync: only the last
    # backward of each step was synchronized.
    assert len(ours.losses) == _STEPS * _ACCUMULATE and ours.synced_steps == _STEPS
    # Every step clipped (so a clip that did nothing, or clipped otherwise, would show).
    assert min(theirs.norms) > _CLIP
    # Two ranks: gradients average bit-exactly as torch's do; the clip's fused norm sums
    # squares in another order than torch's foreach norm, a few fp32 ulp per step, which
    # the next steps carry: 1e-5 relative is far above that and far below any real error.
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.stack(ours.losses), torch.stack(theirs.losses), **tol)
    torch.testing.assert_close(torch.stack(ours.norms), torch.stack(theirs.norms), **tol)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, **tol)
    state = torch.load(path, weights_only=True)["state_dict"]
    assert not any(k.startswith("module.") for k in state)
    bare = _module_class()()
    bare.load_state_dict(state)
    for a, b in zip(bare.parameters(), ours.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fit_with_accumulation_and_clipping_matches_torch_ddp(tmp_path):
    pytest.importorskip("lightning", reason=_LIGHTNING)
    run_ranks(_fit_both, port=free_port(), root=str(tmp_path))


def test_strategy_by_name_and_by_instance():
    pytest.importorskip("lightning", reason=_LIGHTNING)
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import StrategyRegistry

    import pycomm.lightning

    for name, start_method in pycomm.lightning._REGISTERED:
        strategy = StrategyRegistry.get(name)
        assert type(strategy) is pycomm.lightning.DDPStrategy
        assert strategy._start_method == start_method
    config = pycomm.DDPConfig(bucket_cap_mb=1.0)
    strategy = pycomm.lightning.DDPStrategy(config=config)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False,
                      enable_progress_bar=False)
    assert trainer.strategy is strategy and strategy._ddp_kwargs == {"config": config}
    assert isinstance(trainer.precision_plugin.clip_grad_by_norm, pycomm.lightning.FusedNormClip)


def _sharded_module_class(sharded):
    from lightning.pytorch import LightningModule

    class ShardedRegressor(LightningModule):
        """AdamW, sharded by pycomm.ZeroRedundancyOptimizer ("kept": torch's contract, or
        "released": a rank keeps only its shard of the gradients, docs/zero.md) or not
        (False). No hook reads .grad. eps=0.1, far
        above sqrt(v) here, makes the step follow the gradients' scale, so that a clip that
        did not scale would show (with a tiny eps AdamW undoes a uniform scale)."""

        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 2))
            self.losses = []

        def training_step(self, batch, _):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            if sharded:  # after the strategy wrapped the module: the DDP's buckets are sharded
                return pycomm.ZeroRedundancyOptimizer(
                    self.parameters(), torch.optim.AdamW, lr=0.05, eps=0.1,
                    release_gradients=sharded == "released")
            return torch.optim.AdamW(self.parameters(), lr=0.05, eps=0.1)

    return ShardedRegressor


def _fit_sharded(rank, world_size, port, root):
    """Trainer.fit with the sharded optimizer on "pycomm_ddp" (accumulation through no_sync,
    Lightning's gradient clipping) against Lightning's DDPStrategy with torch's AdamW; the
    checkpoint's optimizer state is consolidated (Lightning calls consolidate_state_dict)
    into one that torch's AdamW loads."""
    set_launcher_env(rank, world_size, port)
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    import pycomm.lightning  # noqa: F401  registers "pycomm_ddp"

    g = torch.Generator().manual_seed(1)
    n = world_size * _STEPS * _ACCUMULATE * _BATCH
    data = TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 2, generator=g))
    fitted = {}
    for name, strategy, sharded in (("torch", DDPStrategy(), False),
                                    ("pycomm", "pycomm_ddp", "kept")):
        torch.manual_seed(0)
        model = _sharded_module_class(sharded)()
        trainer = Trainer(accelerator="cpu", devices=world_size, num_nodes=1, strategy=strategy,
                          max_steps=_STEPS, accumulate_grad_batches=_ACCUMULATE,
                          gradient_clip_val=_CLIP, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=os.path.join(root, name))
        trainer.fit(model, DataLoader(data, batch_size=_BATCH))
        path = os.path.join(root, name, "last.ckpt")
        trainer.save_checkpoint(path)
        fitted[name] = (model, trainer.optimizers[0], path)
    ours, zero, path = fitted["pycomm"]
    theirs, _, ref_path = fitted["torch"]
    assert isinstance(zero, pycomm.ZeroRedundancyOptimizer)
    assert zero._ddp is not None and not zero.grads_in_shards  # torch's contract
    assert len(ours.losses) == _STEPS * _ACCUMULATE
    # Two ranks: the averaged gradients are the same bits; the clip's fused norm adds in
    # another order than torch's foreach norm (a few fp32 ulp), carried by later steps.
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.stack(ours.losses), torch.stack(theirs.losses), **tol)
    zero.wait_for_params()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, **tol)
    if rank == 0:
        mine = torch.load(path, weights_only=True)["optimizer_states"][0]
        ref = torch.load(ref_path, weights_only=True)["optimizer_states"][0]
        plain = torch.optim.AdamW(_sharded_module_class(False)().parameters(), lr=0.05, eps=0.1)
        plain.load_state_dict(mine)  # the consolidated state loads into torch's AdamW
        assert sorted(mine["state"]) == sorted(ref["state"])
        for i, want in ref["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(mine["state"][i][key], want[key], **tol)
            assert float(mine["state"][i]["step"]) == float(want["step"]) == _STEPS


def test_fit_with_the_sharded_optimizer_matches_torch_ddp_and_adamw(tmp_path):
    pytest.importorskip("lightning", reason=_LIGHTNING)
    run_ranks(_fit_sharded, port=free_port(), root=str(tmp_path))


def _fit_scaled(rank, world_size, port, root):
    """fp16 autocast through Lightning's MixedPrecision plugin, its scaler passed in: on
    "pycomm_ddp" the sharded optimizer keeping the gradients with torch's GradScaler, and
    releasing them with pycomm.ShardedGradScaler, against torch's GradScaler with torch's
    AdamW on Lightning's DDPStrategy. An initial scale of 2^20
    overflows fp16 in the first steps, so both scalers must skip the same steps on every
    rank (the found-inf flag all-reduced over the shards: Note [Loss scaling over shards])
    and end at the same scale; the losses and parameters then agree."""
    set_launcher_env(rank, world_size, port)
    from lightning.pytorch import Trainer
    from lightning.pytorch.plugins.precision import MixedPrecision
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    import pycomm.lightning  # noqa: F401  registers "pycomm_ddp"

    steps = 8
    g = torch.Generator().manual_seed(2)
    n = world_size * steps * _BATCH
    data = TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 2, generator=g))
    fitted = {}
    for name, strategy, sharded, scaler_class in (
            ("torch", DDPStrategy(), False, torch.amp.GradScaler),
            ("kept", "pycomm_ddp", "kept", torch.amp.GradScaler),
            ("pycomm", "pycomm_ddp", "released", pycomm.ShardedGradScaler)):
        torch.manual_seed(0)
        model = _sharded_module_class(sharded)()
        scaler = scaler_class("cpu", init_scale=2.0 ** 20)
        trainer = Trainer(accelerator="cpu", devices=world_size, num_nodes=1, strategy=strategy,
                          plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
                          max_steps=steps, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=os.path.join(root, name))
        trainer.fit(model, DataLoader(data, batch_size=_BATCH))
        fitted[name] = (model, trainer.optimizers[0], scaler)
    (theirs, _, their_scaler) = fitted["torch"]
    kept, kept_zero, kept_scaler = fitted["kept"]
    (ours, zero, our_scaler) = fitted["pycomm"]
    assert zero.grads_in_shards and not kept_zero.grads_in_shards
    kept_zero.wait_for_params()
    assert kept_scaler.get_scale() == their_scaler.get_scale()
    for a, b in zip(kept.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert our_scaler.get_scale() == their_scaler.get_scale() < 2.0 ** 20, (
        our_scaler.get_scale(), their_scaler.get_scale())
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.stack(ours.losses), torch.stack(theirs.losses), **tol)
    zero.wait_for_params()
    torch.manual_seed(0)
    moved = False
    for (_, a), b, start in zip(ours.named_parameters(), theirs.parameters(),
                                _sharded_module_class(False)().parameters()):
        torch.testing.assert_close(a, b, **tol)
        moved = moved or not torch.equal(a, start)
    assert moved, "every step was skipped: the test needs some taken"


def test_fit_with_loss_scaling_over_the_shards_matches_torch(tmp_path):
    pytest.importorskip("lightning", reason=_LIGHTNING)
    run_ranks(_fit_scaled, port=free_port(), root=str(tmp_path))
