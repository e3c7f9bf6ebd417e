"""`pycomm-bench ddp --hosts`: both DDPs trained across two hosts made on this machine, with
what crossed the link per step."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.hosts_fixture import needs_hosts, nothing_left_behind  # noqa: F401
from tests.support.paths import REPO

pytestmark = needs_hosts
ROOT = str(REPO)


def test_ddp_bench_across_two_hosts(tmp_path):
    out = tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, "-m", "pycomm.bench", "ddp", "--hosts", "2", "--link-gbit", "10",
         "--models", "mlp", "--reps", "1", "--steps", "1", "--warmup", "1",
         "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "hosts 2 hosts x 1 ranks, link 10 Gbit/s (tbf)" in done.stdout, done.stdout
    assert "wire_MB" in done.stdout
    doc = json.loads(out.read_text())
    assert doc["world"] == 2 and doc["config"]["hosts"].startswith("2 hosts x 1 ranks")
    rows = {r["impl"]: r for r in doc["results"]}
    assert set(rows) == {"torch", "pycomm"}
    grad_mb = rows["pycomm"]["params"] * 4 / 1e6
    for impl, r in rows.items():
        # Two ranks: each host sends its whole gradient once per step, 2(n-1)/n = 1, plus
        # TCP/IP headers and the ACKs of what it receives.
        assert grad_mb <= r["wire_mb"] <= grad_mb * 1.06, (impl, r["wire_mb"], grad_mb)


def test_released_sharded_optimizer_with_the_wire_across_hosts(tmp_path):
    # pycomm_zero_released_wire_*: the released optimizer's reduce-scatter carries the
    # wire, and the parameters' all-gather stays float32: out of each host per step, bf16
    # sends the gradients' half at half the bytes (S/4) and the parameters' half whole (S/2)
    out = tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, "-m", "pycomm.bench", "ddp", "--hosts", "2", "--ranks-per-host", "2",
         "--link-gbit", "1", "--models", "mlp", "--optimizer", "adamw", "--impls",
         "pycomm_zero_released_wire_bf16,pycomm_zero_released_wire_int8", "--reps", "1",
         "--steps", "2", "--warmup", "1", "--json", str(out)], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["impl"]: r for r in json.loads(out.read_text())["results"]}
    grad_mb = rows["pycomm_zero_released_wire_bf16"]["params"] * 4 / 1e6
    for impl, share in (("pycomm_zero_released_wire_bf16", 0.75),
                        ("pycomm_zero_released_wire_int8", 0.5 + 0.254 / 2)):
        r = rows[impl]
        assert abs(r["state_mb"] / (2 * grad_mb) - 0.25) < 0.01, (impl, r["state_mb"])
        assert share * grad_mb * 0.97 <= r["wire_mb"] <= share * grad_mb * 1.08, (
            impl, r["wire_mb"], grad_mb)
