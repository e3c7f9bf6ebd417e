"""What a low-precision wire (DDPConfig.wire) costs in accuracy, measured: a small
character-level language model trained on real text at 2 hosts x 2 ranks (hosts told
apart on this machine by their host identity, so the gradients take the hierarchical
path across hosts), with every wire side by side with float32 and with torch's
bf16_compress_hook algorithm; then the gradient error of one all-reduce at 2, 4 and 8
ranks, one rank per host.

    python benchmarks/wire_accuracy.py --steps 300 --out benchmarks/results/wire_accuracy_cpu

Training: each step every rank computes its local gradient of its own batch, flattened
into one float32 buffer (DDP's buckets in one: the same algorithm per element). The
buffer is all-reduced exactly (float32 over the hierarchy) and through the variant; the
variant's average steps AdamW, and the step records the loss and the variant's relative
L2 error against the exact average. torch's algorithm: cast to bf16, divide by the
world, all-reduce in bf16 over Gloo (bf16_compress_hook's steps; torch's DDP registers
the hook only for NCCL). The text is the Python standard library's source (this
machine's, sorted by path), ASCII only. Final loss: the mean training loss of the last 20
steps; eval loss: the trained model's mean loss on 64 fixed batches drawn from the same
text (the same batches for every variant).

Growth: one gradient of the model at initialisation on each rank, all-reduced by each
method at 2, 4 and 8 ranks (one per host); the error against the float64 sum.

Blocks (also alone with --blocks): int8's error for scale blocks of 64 to 4,096 elements
on the char LM's and the bench transformer's gradients.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

CONTEXT, BATCH, VOCAB = 64, 16, 128
VARIANTS = ("fp32", "bf16", "int8", "int8+ef", "torch_bf16_hook")


def corpus(limit: int = 4 << 20) -> torch.Tensor:
    """The first `limit` ASCII bytes of the standard library's .py files, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        data = path.read_bytes().decode("ascii", "ignore").encode("ascii")
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


class CharLM(nn.Module):
    def __init__(self, d: int = 128, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.zeros(CONTEXT, d))
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(CONTEXT))

    def forward(self, x):
        h = self.body(self.embed(x) + self.pos, mask=self.mask, is_causal=True)
        return self.head(h)


def batch(text: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(text) - CONTEXT - 1, (BATCH,), generator=g)
    idx = starts[:, None] + torch.arange(CONTEXT + 1)
    seq = text[idx]
    return seq[:, :-1], seq[:, 1:]


def loss_of(model, xy) -> torch.Tensor:
    x, y = xy
    return nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def _pretend_hosts(rank: int, per_host: int) -> None:
    import pycomm.shm

    pycomm.shm.host_identity = lambda: f"host{rank // per_host}/boot"


def _groups(rank: int, per_host: int):
    import pycomm.shm

    _pretend_hosts(rank, per_host)
    group = pycomm.shm.hierarchical_group(dist.group.WORLD, one_rank_per_host=True)
    return group, group._get_backend(torch.device("cpu"))


def reduce(variant: str, flat: torch.Tensor, group, backend, residual, world: int):
    """The average of every rank's `flat` by `variant`."""
    if variant == "torch_bf16_hook":
        compressed = flat.to(torch.bfloat16).div_(world)
        dist.all_reduce(compressed)  # the default group: flat Gloo
        return compressed.float()
    out = flat.clone()
    if variant == "fp32":
        dist.all_reduce(out, group=group)
    else:
        wire, ef = variant.split("+")[0], variant.endswith("+ef")
        backend.allreduce_wire(out, wire, error_feedback=ef, residual=residual if ef else None)
    return out.div_(world)


def _train(rank: int, world: int, cfg: dict) -> dict:
    torch.set_num_threads(1)
    group, backend = _groups(rank, cfg["per_host"])
    text = corpus()
    evals = [batch(text, 10_000_000 + i) for i in range(64)]
    curves = {}
    for variant in cfg["variants"]:
        import pycomm

        torch.manual_seed(0)
        model = CharLM()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
        residual = pycomm._C.WireResidual()
        losses, errors = [], []
        start = time.monotonic()
        for step in range(cfg["steps"]):
            model.zero_grad(set_to_none=False)
            loss = loss_of(model, batch(text, step * world + rank))
            loss.backward()
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            exact = flat.clone()
            dist.all_reduce(exact, group=group)
            exact.div_(world)
            avg = reduce(variant, flat, group, backend, residual, world)
            errors.append(((avg - exact).norm() / exact.norm()).item())
            offset = 0
            for g in grads:
                g.copy_(avg[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        with torch.no_grad():
            held = sum(loss_of(model, xy).item() for xy in evals) / len(evals)
        curves[variant] = {"loss": losses, "grad_rel_err": errors, "eval_loss": held,
                           "seconds": time.monotonic() - start}
    return curves


def _growth(rank: int, world: int, cfg: dict) -> dict:
    torch.set_num_threads(1)
    group, backend = _groups(rank, 1)
    torch.manual_seed(0)
    model = CharLM()
    loss_of(model, batch(corpus(), 7919 * rank + 1)).backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    exact = torch.stack(everyone).double().sum(0) / world
    out = {}
    for variant in ("bf16", "int8", "torch_bf16_hook"):
        import pycomm

        avg = reduce(variant, flat, group, backend, pycomm._C.WireResidual(), world)
        out[variant] = ((avg.double() - exact).norm() / exact.norm()).item()
    return out


def block_sizes(sizes=(64, 128, 256, 512, 1024, 4096)) -> dict:
    """int8 with a scale per block of each size, as the wire encodes (symmetric, max / 127,
    nearest), on real gradients: the char LM's at initialisation and the bench
    transformer's, each flattened in parameter order as DDP's buckets lay them out. The
    relative L2 error of one encoding, and the bytes per element with the scales."""
    from pycomm.bench.models import build_model

    torch.manual_seed(0)
    lm = CharLM()
    loss_of(lm, batch(corpus(), 1)).backward()
    bench, x = build_model("transformer")
    bench(x).square().mean().backward()
    grads = {"char_lm": torch.cat([p.grad.reshape(-1) for p in lm.parameters()]),
             "transformer": torch.cat([p.grad.reshape(-1) for p in bench.parameters()])}
    out = {}
    for name, g in grads.items():
        out[name] = {}
        for b in sizes:
            n = (g.numel() + b - 1) // b * b
            blocks = torch.nn.functional.pad(g, (0, n - g.numel())).view(-1, b)
            scale = blocks.abs().amax(1, keepdim=True) / 127
            q = torch.where(scale > 0, torch.round(blocks / scale), 0.0)
            decoded = (q * scale).reshape(-1)[:g.numel()]
            out[name][b] = {"rel_err": ((decoded - g).norm() / g.norm()).item(),
                            "bytes_per_element": 1 + 4 / b}
    return out


def _entry(rank: int, world: int, store_dir: str, fn, cfg: dict) -> None:
    import pycomm  # noqa: F401  (registers the "pycomm" backend)

    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    result = fn(rank, world, cfg)
    if rank == 0:
        with open(os.path.join(store_dir, "result.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def spawn(fn, world: int, cfg: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="pycomm-wire-") as tmp:
        mp.start_processes(_entry, args=(world, tmp, fn, cfg), nprocs=world,
                           start_method="spawn")
        return json.loads(Path(tmp, "result.json").read_text())


def plot(curves: dict, growth: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.5))
    for variant, data in curves.items():
        loss = torch.tensor(data["loss"])
        smooth = torch.nn.functional.avg_pool1d(loss[None, None], 10, 1)[0, 0]
        a.plot(range(9, len(loss)), smooth, label=variant)
        b.semilogy(data["grad_rel_err"], label=variant)
    a.set(title="training loss (10-step mean), 2 hosts x 2 ranks", xlabel="step",
          ylabel="cross-entropy")
    b.set(title="gradient error against float32, per step", xlabel="step",
          ylabel="relative L2 error")
    ranks = sorted(int(k) for k in growth)
    for variant in ("bf16", "int8", "torch_bf16_hook"):
        c.plot(ranks, [growth[str(r)][variant] for r in ranks], marker="o", label=variant)
    c.set(title="one all-reduce's error, one rank per host", xlabel="ranks",
          ylabel="relative L2 error", xticks=ranks)
    for ax in (a, b, c):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=None, help="write OUT.json and OUT.png")
    p.add_argument("--blocks", action="store_true",
                   help="only the int8 block-size table (one process, no ranks)")
    ns = p.parse_args(argv)
    blocks = block_sizes()
    print("# int8 with a scale per block: one encoding's relative L2 error on real gradients")
    print(f"{'block':>6} {'bytes/elem':>10} " + " ".join(f"{k:>12}" for k in blocks))
    for b in next(iter(blocks.values())):
        first = next(iter(blocks.values()))[b]
        print(f"{b:>6} {first['bytes_per_element']:10.4f} "
              + " ".join(f"{blocks[k][b]['rel_err']:12.2e}" for k in blocks))
    if ns.blocks:
        return 0
    cfg = {"steps": ns.steps, "lr": ns.lr, "per_host": 2,
           "variants": ns.variants.split(",")}
    curves = spawn(_train, 4, cfg)
    growth = {str(n): spawn(_growth, n, {}) for n in (2, 4, 8)}
    ref = curves.get("fp32")
    print(f"# {ns.steps} steps, 2 hosts x 2 ranks, char LM on the stdlib's source, AdamW "
          f"lr {ns.lr}")
    print(f"{'variant':>16} {'final loss':>11} {'vs fp32':>8} {'eval':>9} {'vs fp32':>8} "
          f"{'grad err (median)':>18} {'seconds':>8}")
    for variant, data in curves.items():
        final = sum(data["loss"][-20:]) / 20
        errs = sorted(data["grad_rel_err"])
        rel = final / (sum(ref["loss"][-20:]) / 20) - 1 if ref else float("nan")
        held = data["eval_loss"] / ref["eval_loss"] - 1 if ref else float("nan")
        print(f"{variant:>16} {final:11.4f} {rel:+8.2%} {data['eval_loss']:9.4f} "
              f"{held:+8.2%} {errs[len(errs) // 2]:18.2e} {data['seconds']:8.1f}")
    print("# one all-reduce's relative error against the float64 average, one rank per host")
    print(f"{'ranks':>6} " + " ".join(f"{v:>16}" for v in ("bf16", "int8", "torch_bf16_hook")))
    for n, errs in growth.items():
        print(f"{n:>6} " + " ".join(f"{errs[v]:16.2e}" for v in ("bf16", "int8",
                                                                  "torch_bf16_hook")))
    if ns.out:
        Path(ns.out + ".json").write_text(json.dumps({"steps": ns.steps, "lr": ns.lr,
                                                      "blocks": blocks, "curves": curves,
                                                      "growth": growth}))
        plot(curves, growth, ns.out + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
