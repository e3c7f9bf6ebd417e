"""How torch finds the "pycomm" backend: `import pycomm` registers it (every torch), and on
a torch that reads the `torch.distributed.backends` entry points (2.15) a script that never
imports pycomm gets it too (pyproject.toml's entry point; pycomm.shm.register)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch.distributed as dist

# A rank of a script that only names the backend: 2 ranks over a FileStore, one all-reduce.
_SCRIPT = """
import datetime, sys
import torch, torch.distributed as dist
rank, world, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
assert "pycomm" not in sys.modules
dist.init_process_group("pycomm", store=dist.FileStore(path, world), rank=rank,
                        world_size=world, timeout=datetime.timedelta(seconds=60))
t = torch.full((3,), float(rank + 1))
dist.all_reduce(t)
assert torch.equal(t, torch.full((3,), world * (world + 1) / 2)), t
backend = dist.group.WORLD._get_backend(torch.device("cpu"))
print(dist.get_backend(), type(backend).__module__, type(backend).__name__)
dist.destroy_process_group()
"""


@pytest.mark.skipif(not hasattr(dist.Backend, "_ensure_backend_registered"),
                    reason="this torch reads no torch.distributed.backends entry points "
                           "(torch 2.15 does); `import pycomm` registers the backend there")
def test_a_script_that_never_imports_pycomm_gets_the_backend(tmp_path):
    world = 2
    # The temp dir as working directory: pycomm comes from the installation, not the tree.
    procs = [subprocess.Popen([sys.executable, "-c", _SCRIPT, str(rank), str(world),
                               str(tmp_path / "store")], cwd=tmp_path, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for rank in range(world)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank}:\n{err[-3000:]}"
        assert out.split() == ["pycomm", "pycomm._C", "ShmBackend"], out


def test_import_registers_the_backend():
    import pycomm.shm

    pycomm.shm.register()  # again: idempotent
    assert "pycomm" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["pycomm"] == ["cpu"]
