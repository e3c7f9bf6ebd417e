"""The benchmark models of `pycomm-bench ddp` (and of its --sweep-bucket-cap mode and the
scripts under benchmarks/): each ~25M parameters, built from one seed, with one rank's
input. What is timed on them is ddp.py's and bucket_sweep.py's."""

from __future__ import annotations

import torch
from torch import nn

MODELS = ("mlp", "transformer", "transformer_b1")
_TRANSFORMER_BATCH = {"transformer": 4, "transformer_b1": 1}
_SEQ = 64


class BenchModel(nn.Module):
    """A benchmark network behind a forward of its own, as a user's model is: dynamo
    compiles a DDP-wrapped module's forward through torch's DDP only when that forward is
    not torch's own code (nn.Sequential's, nn.TransformerEncoder's)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build_model(name: str, samples: int = 32) -> tuple[nn.Module, torch.Tensor]:
    """The model and one rank's input; `samples` is the MLP's batch per rank."""
    torch.manual_seed(0)
    if name == "mlp":  # 6 x (2048 x 2048) ~ 25.2M parameters
        layers = [m for _ in range(6) for m in (nn.Linear(2048, 2048), nn.ReLU())]
        return BenchModel(nn.Sequential(*layers)), torch.randn(samples, 2048)
    if name in _TRANSFORMER_BATCH:  # 8 encoder layers, d_model 512, ff 2048 ~ 25.2M params
        layer = nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, batch_first=True)
        return (BenchModel(nn.TransformerEncoder(layer, 8, enable_nested_tensor=False)),
                torch.randn(_TRANSFORMER_BATCH[name], _SEQ, 512))
    raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")


def per_rank(name: str, x: torch.Tensor) -> str:
    """One rank's share of a step's work, in the model's own unit."""
    if name == "mlp":
        return f"{x.shape[0]} samples"
    return f"{x.shape[0]}x{x.shape[1]}={x.shape[0] * x.shape[1]} tokens"
