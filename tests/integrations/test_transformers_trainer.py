"""The HF Trainer with pycomm.patch() (the Trainer wraps its model through Accelerate):
fine-tuning a tiny GPT-2 built from a config (nothing downloaded), with
gradient_accumulation_steps and max_grad_norm, against the same run on torch's DDP: same
logged losses and gradient norms, same final parameters, and `save_model` writes a
checkpoint that from_pretrained loads into the bare model."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import pycomm
from tests.support.multirank import free_port, run_ranks, set_launcher_env

_STEPS, _ACCUMULATE, _BATCH, _SEQ, _VOCAB = 3, 2, 2, 12, 64


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, _VOCAB, (n, _SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _config():
    from transformers import GPT2Config

    # No dropout: the two runs must not depend on how many random numbers each draws.
    return GPT2Config(vocab_size=_VOCAB, n_positions=_SEQ, n_embd=16, n_layer=2, n_head=2,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                      eos_token_id=0)


def _train(use_pycomm, world_size, out_dir):
    from transformers import GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(_config())
    args = TrainingArguments(
        output_dir=out_dir, use_cpu=True, max_steps=_STEPS, per_device_train_batch_size=_BATCH,
        gradient_accumulation_steps=_ACCUMULATE, max_grad_norm=0.1, learning_rate=1e-2,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=0, dataloader_num_workers=0)
    with pycomm.patch() if use_pycomm else contextlib.nullcontext():
        trainer = Trainer(model=model, args=args,
                          train_dataset=_Tokens(world_size * _STEPS * _ACCUMULATE * _BATCH))
        trainer.train()
        assert isinstance(trainer.model_wrapped, pycomm.DistributedDataParallel) == use_pycomm
        if use_pycomm:  # only the last micro-batch of each step synchronized (no_sync)
            assert len(trainer.model_wrapped.timelines(64)) == _STEPS
        trainer.save_model(out_dir)  # rank 0 writes, the others go on
    torch.distributed.barrier()
    # Outside the patch, where torch.nn.parallel.DistributedDataParallel is torch's again.
    assert trainer.accelerator.unwrap_model(trainer.model_wrapped) is model
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return (torch.tensor([e["loss"] for e in logs]), torch.tensor([e["grad_norm"] for e in logs]),
            [p.detach().clone() for p in model.parameters()])


def _train_both(rank, world_size, port, root):
    set_launcher_env(rank, world_size, port)
    from transformers import GPT2LMHeadModel

    theirs = _train(False, world_size, os.path.join(root, "torch"))
    ours = _train(True, world_size, os.path.join(root, "pycomm"))
    assert len(ours[0]) == _STEPS and min(theirs[1]) > 0.1  # every step clipped
    # Two ranks: gradients average bit-exactly as torch's do; the clip's fused norm sums
    # squares in another order than torch's foreach norm, a few fp32 ulp per step, which
    # AdamW's next steps carry: 1e-5 relative is far above that, far below a real error.
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    bare, info = GPT2LMHeadModel.from_pretrained(os.path.join(root, "pycomm"),
                                                 output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    for a, b in zip(bare.parameters(), ours[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_trainer_with_accumulation_and_clipping_matches_torch_ddp(tmp_path):
    pytest.importorskip("transformers", reason="the integrations extra (transformers) is absent")
    run_ranks(_train_both, port=free_port(), root=str(tmp_path))
