"""The classic DistributedDataParallel recipe with pycomm in place of torch's DDP: a small
model on synthetic data, DistributedSampler (+ set_epoch), a checkpoint saved on rank 0 and
loaded back on every rank, destroy_process_group at the end.

    torchrun --nproc_per_node 2 examples/train.py     # under a launcher (env://)
    python examples/train.py                          # spawns 2 local ranks itself
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from pycomm import DistributedDataParallel as DDP  # was: torch.nn.parallel's


def make_data(n: int = 512) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 1, generator=g)
    return TensorDataset(x, x @ w + 0.01 * torch.randn(n, 1, generator=g))


def train(rank: int, world_size: int, epochs: int, checkpoint: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    ddp = DDP(model)
    dataset = make_data()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2)
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            opt.step()
            total += torch.tensor([loss.item() * len(x), len(x)])
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch} loss {total[0] / total[1]:.5f}", flush=True)
    if rank == 0:
        torch.save(ddp.state_dict(), checkpoint)
    dist.barrier()
    ddp.load_state_dict(torch.load(checkpoint, map_location="cpu"))
    flat = torch.cat([p.detach().flatten() for p in ddp.parameters()])
    copies = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(copies, flat)
    assert all(torch.equal(c, copies[0]) for c in copies), "replicas diverged"
    if rank == 0:
        print(f"checkpoint {checkpoint} reloaded on {world_size} ranks: replicas identical")


def _spawned(rank: int, world_size: int, store_path: str, epochs: int, checkpoint: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size)
    train(rank, world_size, epochs, checkpoint)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn without torchrun")
    args = parser.parse_args()
    if "RANK" in os.environ:  # torchrun: env:// rendezvous, one process per rank
        # Every rank must name the same file: key it by the rendezvous port.
        checkpoint = os.path.join(tempfile.gettempdir(),
                                  f"pycomm-example-{os.environ['MASTER_PORT']}.pt")
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        train(dist.get_rank(), dist.get_world_size(), args.epochs, checkpoint)
        dist.barrier()
        if dist.get_rank() == 0:
            os.remove(checkpoint)
        dist.destroy_process_group()
        return
    with tempfile.TemporaryDirectory(prefix="pycomm-example-") as tmp:
        mp.spawn(_spawned, args=(args.nproc, os.path.join(tmp, "store"), args.epochs,
                                 os.path.join(tmp, "model.pt")), nprocs=args.nproc)


if __name__ == "__main__":
    main()
