"""One rank of tests/packaging/test_bare_install.py, run as a script: what a bare install of pycomm
(torch's CPU wheel, no numpy, no matplotlib) must do. numpy and matplotlib are made
unimportable before torch is imported, which is what their absence looks like to torch
("Failed to initialize NumPy") and to pycomm; so the check holds in any environment.

usage: python bare_rank.py RANK WORLD STORE_PATH TRACE_PATH
"""

import sys

for _name in ("numpy", "matplotlib"):
    sys.modules[_name] = None  # import raises ImportError, as when not installed

import copy  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: E402

import pycomm  # noqa: E402


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def main(rank: int, world: int, store_path: str, trace_path: str) -> None:
    try:
        torch.zeros(1).numpy()
    except RuntimeError:
        pass
    else:
        raise AssertionError("numpy is reachable from torch: this run proves nothing")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    ref = TorchDDP(copy.deepcopy(_model()))
    ours = pycomm.DistributedDataParallel(copy.deepcopy(_model()))  # same-host shm group
    assert dist.get_backend(ours.gradient_group) == "pycomm", ours.gradient_group
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(6, 8, generator=g)
        for ddp, opt in zip((ref, ours), opts):
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()
        for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
            # 2 ranks: each element one sum of two terms, so bitwise equal.
            assert torch.equal(a, b), f"step {step}: {name}"
    with ours.join():  # uneven inputs: rank 1 has one batch more
        for _ in range(1 + rank):
            ours(torch.randn(6, 8)).square().mean().backward()
    assert ours.last_step_report() is not None
    written = ours.export_chrome_trace(trace_path, all_ranks=True)
    if rank == 0:
        with open(written) as f:
            ranks = {e.get("pid") for e in json.load(f)["traceEvents"]}
        assert len(ranks - {None}) >= world, ranks
    assert sys.modules.get("numpy") is None, "something imported numpy"
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
