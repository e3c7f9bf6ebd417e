"""pycomm works on a bare install: torch's CPU wheel and pycomm, no numpy, no matplotlib
(neither is a dependency of either). Two real ranks, each a fresh interpreter where both
are unimportable (tests/support/bare_rank.py), construct pycomm's DDP, train it against torch's
DDP, join with uneven inputs and gather a Chrome trace across ranks."""

import os
import subprocess
import sys

from tests.support.paths import REPO

RANK_SCRIPT = REPO / "tests" / "support" / "bare_rank.py"


def test_ddp_trains_without_numpy_or_matplotlib(tmp_path):
    world = 2
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(RANK_SCRIPT), str(rank), str(world),
                               str(tmp_path / "store"), str(tmp_path / "trace.json")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env)
             for rank in range(world)]
    try:
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{out}"
    assert (tmp_path / "trace.json").exists()
