"""Small models and the torch-DDP-vs-pycomm-DDP lockstep harness shared by tests/ddp/.
Each model covers a shape of graph the reducer must handle; `lockstep` trains torch's DDP
and pycomm's side by side on the same data and compares gradients and parameters."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pycomm


class MLP(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, width),
                                 nn.ReLU(), nn.Linear(width, 4))

    def forward(self, x):
        return self.net(x)


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 8 * 8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


class Attn(nn.Module):
    """Embedding + layer norm + attention; returns a dict (outputs may be containers)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 4)

    def forward(self, tokens):
        h = self.norm(self.emb(tokens))
        a, _ = self.attn(h, h, h, need_weights=False)
        return {"logits": self.out(a + h).mean(1)}


class Tied(nn.Module):
    """Input embedding and output projection share one weight."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 16, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.mid(self.emb(tokens)))).mean(1)


@dataclasses.dataclass
class Out:
    value: torch.Tensor
    aux: tuple


class Branchy(nn.Module):
    """`unused` never takes part; which of a/b is used depends on the rank when
    `rank_dependent`; returns a dataclass. A frozen parameter must be ignored."""

    def __init__(self, rank_dependent: bool = False):
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)
        self.unused = nn.Linear(8, 4)
        self.frozen = nn.Parameter(torch.ones(4), requires_grad=False)
        self.rank_dependent = rank_dependent

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        use_a = dist.get_rank() % 2 == 0 if self.rank_dependent else True
        y = (self.a(h) if use_a else self.b(h)) * self.frozen
        return Out(y, (h,))


class Checkpointed(nn.Module):
    """Activation checkpointing (torch.utils.checkpoint): `block` runs in two checkpointed
    segments when `shared`, so with use_reentrant=True its gradient hook fires once per
    segment's nested backward; otherwise two distinct blocks, one segment each."""

    def __init__(self, reentrant: bool, shared: bool):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.block = nn.Linear(16, 16)
        self.other = None if shared else nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.inp(x))
        for layer in (self.block, self.other or self.block):
            h = checkpoint(lambda t, f=layer: torch.tanh(f(t)), h,
                           use_reentrant=self.reentrant)
        return self.head(h)


def make_input(model: str, rank: int, step: int, batch: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    if model in ("attn", "tied"):
        return torch.randint(0, 16, (batch, 5), generator=g)
    if model == "convbn":
        return torch.randn(batch, 2, 8, 8, generator=g)
    return torch.randn(batch, 8, generator=g)


def build(model: str) -> nn.Module:
    torch.manual_seed(7)
    # "wide": 1 MiB weights, past the reducer's streamed-copy threshold (Note [Streaming
    # copies]); the others are all below it.
    return {"mlp": MLP, "wide": lambda: MLP(512), "convbn": ConvBN, "attn": Attn, "tied": Tied,
            "branchy": Branchy, "rankdep": lambda: Branchy(True),
            "ckpt_reentrant_shared": lambda: Checkpointed(True, True),
            "ckpt_reentrant": lambda: Checkpointed(True, False),
            "ckpt_shared": lambda: Checkpointed(False, True)}[model]()


def loss_of(out: Any) -> torch.Tensor:
    if isinstance(out, dict):
        out = out["logits"]
    if isinstance(out, Out):
        out = out.value
    return out.square().mean()


def assert_same(a: nn.Module, b: nn.Module, what: str, exact: bool, grads: bool = True):
    """exact: bitwise (the reduction order is the same); else within 1e-5 relative, the
    fp32 noise of a differently ordered 3-term sum compounded over a few SGD steps."""
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        pairs = [("param", pa, pb)] + ([("grad", pa.grad, pb.grad)] if grads else [])
        for kind, x, y in pairs:
            if x is None or y is None:
                assert x is None and y is None, f"{what}: {kind} of {name}: {x} vs {y}"
            elif exact:
                assert torch.equal(x, y), f"{what}: {kind} of {name} differs by " \
                                          f"{(x - y).abs().max().item()}"
            else:
                torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6, msg=f"{what}: {kind} "
                                           f"of {name}")


def manual_average(module: nn.Module) -> None:
    """The reference reduction written out: grad * (1/world) summed over ranks (torch's
    numerics); a parameter without a grad on every rank keeps None, one with a grad on
    some ranks gets the others' zeros."""
    world = dist.get_world_size()
    for p in module.parameters():
        if not p.requires_grad:
            continue
        has = torch.tensor([p.grad is not None], dtype=torch.int32)
        dist.all_reduce(has)
        if has.item() == 0:
            continue
        g = p.grad * (1.0 / world) if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        p.grad = g


class ManualDDP(nn.Module):
    """Reference for cases where torch's DDP itself is not a sound oracle (see users)."""

    def __init__(self, module: nn.Module, **_: Any):
        super().__init__()
        self.module = module
        self.sync = True

    def forward(self, *args):
        return self.module(*args)

    def no_sync(self):
        import contextlib

        @contextlib.contextmanager
        def off():
            self.sync = False
            yield
            self.sync = True
        return off()


def lockstep(rank: int, model: str, steps: int = 3, exact: bool = True,
             hook: Callable[[], tuple] | None = None, no_sync_every: int = 0,
             zero_to_none: bool = True, manual: bool = False, device: str = "cpu",
             **ddp_kwargs: Any) -> pycomm.DistributedDataParallel:
    """Train torch's DDP (or, with `manual`, a plain module averaged by hand) and pycomm's
    on identical data, on `device`; compare after every step."""
    base = build(model).to(device)
    ref = (ManualDDP if manual else TorchDDP)(copy.deepcopy(base), **ddp_kwargs)
    # The reducer against torch's on the same transport (Gloo): the shared-memory backend
    # adds 3+ terms in rank order, not Gloo's ring order (tests/shm/test_ddp_gradients.py
    # covers it).
    fields = {k: tuple(v) if k == "bucket_cap_mb_list" else v for k, v in ddp_kwargs.items()}
    ours = pycomm.DistributedDataParallel(
        copy.deepcopy(base),
        config=pycomm.DDPConfig(shared_memory_gradients=False, **fields))
    if hook is not None:
        for ddp in (ref, ours):
            ddp.register_comm_hook(*hook())
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, ours)]
    what = f"{model} {ddp_kwargs} hook={hook is not None} no_sync_every={no_sync_every}"
    for step in range(steps):
        for ddp, opt in zip((ref, ours), opts):
            opt.zero_grad(set_to_none=zero_to_none)
            for micro in range(no_sync_every):
                with ddp.no_sync():
                    x = make_input(model, rank, 100 * step + micro + 1).to(device)
                    loss_of(ddp(x)).backward()
            loss_of(ddp(make_input(model, rank, 100 * step).to(device))).backward()
            if isinstance(ddp, ManualDDP):
                manual_average(ddp.module)
        assert_same(ref, ours, f"{what} step {step}", exact)
        for opt in opts:
            opt.step()
    assert_same(ref, ours, f"{what} final", exact, grads=False)
    for (name, x), (_, y) in zip(ref.module.named_buffers(), ours.module.named_buffers()):
        if exact:
            assert torch.equal(x, y), f"{what}: buffer {name} differs"
        else:
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6, msg=f"{what}: buffer {name}")
    return ours


def tanh_mlp() -> nn.Module:
    """A 3-layer tanh MLP (24 -> 300 -> 300 -> 3) with fixed weights: several buckets at
    small caps, cheap enough for many ranks."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 300), nn.Tanh(), nn.Linear(300, 300), nn.Tanh(),
                         nn.Linear(300, 3))


def train_sgd(ddp: nn.Module, rank: int, steps: int = 3) -> list[torch.Tensor]:
    """`steps` SGD+momentum steps of `ddp` (a tanh_mlp) on rank-dependent data; the
    parameters after them."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 24, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in ddp.parameters()]


def train_against(ref: nn.Module, ours: nn.Module, rank: int, steps: int, exact: bool,
                  model: str = "mlp") -> None:
    """`steps` SGD steps of both DDP modules on the same inputs, gradients and then
    parameters compared after each (assert_same's `exact`)."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, ours)]
    for step in range(steps):
        for ddp, opt in zip((ref, ours), opts):
            opt.zero_grad()
            loss_of(ddp(make_input(model, rank, step))).backward()
        assert_same(ref, ours, f"step {step}", exact=exact)
        for opt in opts:
            opt.step()
    assert_same(ref, ours, "final", exact=exact, grads=False)
