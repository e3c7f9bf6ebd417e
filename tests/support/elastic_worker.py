"""A torchrun worker for tests/ddp/test_elastic_restart.py.

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 \
        tests/support/elastic_worker.py OUT_DIR --impl pycomm --steps 8 --kill-rank 1 --kill-step 4

Trains a small model with `--impl`'s DDP on a Gloo world (pycomm's DDP then reduces its
gradients over its same-host shared-memory group, whose segment lives in /dev/shm while
the ranks map it). Rank 0 checkpoints model and optimizer after every step (written
atomically); at start every rank resumes from the checkpoint if there is one. In the
first generation (TORCHELASTIC_RESTART_COUNT=0) rank `--kill-rank` SIGKILLs itself after
step `--kill-step`, so torchrun stops the survivors and starts a new generation.

Writes OUT_DIR/gen{G}_rank{R}.json (its pid, the step it resumed at, the world it saw,
the gradient group's backend) when it starts and, at the end, OUT_DIR/final_rank{R}.pt
(the module's parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
import torch.distributed as dist

import pycomm


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 4))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _save(path: str, state: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)  # a reader sees the old checkpoint or the new one, never half


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--impl", choices=["pycomm", "torch"], default="pycomm")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    args = p.parse_args()

    generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    if args.impl == "pycomm":
        ddp = pycomm.DistributedDataParallel(model)
        grad_backend = dist.get_backend(ddp.gradient_group)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        grad_backend = "gloo"
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

    ckpt = os.path.join(args.out, "ckpt.pt")
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        ddp.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    with open(os.path.join(args.out, f"gen{generation}_rank{rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "start": start, "world": world,
                   "grad_backend": grad_backend}, f)

    for step in range(start, args.steps):
        x, y = _batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        if rank == 0:
            _save(ckpt, {"model": ddp.state_dict(), "opt": opt.state_dict(), "step": step + 1})
        if generation == 0 and rank == args.kill_rank and step == args.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)

    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
               os.path.join(args.out, f"final_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
