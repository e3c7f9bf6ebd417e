"""Validate pycomm.overlap's alpha-beta model on links of known rate (issue 14).

For each rate: make 2 hosts joined by a link shaped to that rate (pycomm/hosts.py, root),
1. sweep `pycomm-bench collectives all_reduce` across the link (Gloo, one rank per host)
   and fit the model (pycomm.overlap.fit_alpha_beta): its bus bandwidth should be the
   link's rate;
2. train pycomm's DDP on the benchmark MLP across the same link, keep every rank's step
   timelines, and replay each step through the fitted model (pycomm.overlap.replay): the
   predicted backward should be the measured one.

    sudo python benchmarks/hosts_alpha_beta.py --rates 1,10 [--json out.json]

The rate under tbf counts Ethernet frames; a TCP stream carries about 94-97% of it as
payload (headers, ACKs), which the fit sees as a lower bus bandwidth. There is no added
latency (no netem in this kernel): alpha is the stack's own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

from pycomm.hosts import Hosts, available
from pycomm.overlap import fit_alpha_beta, replay
from pycomm.overlap.model import load_collectives_json

STEPS, SKIP = 8, 3  # DDP steps per run; the first SKIP (bucket rebuild, warm-up) not judged


def _ddp_rank(rank: int, world_size: int, steps: int) -> list[dict]:
    import pycomm
    from pycomm.bench.ddp import _model

    torch.set_num_threads(1)
    module, x = _model("mlp")
    ddp = pycomm.DistributedDataParallel(module, bucket_cap_mb=25.0)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-6)
    for _ in range(steps):
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
    return [dict(t) for t in ddp.timelines(steps - SKIP)]


def validate(rate_gbit: float, tmp: str) -> dict:
    out = os.path.join(tmp, f"collectives_{rate_gbit:g}.json")
    with Hosts(2, link_gbit=rate_gbit) as hosts:
        hosts.run([sys.executable, "-m", "pycomm.bench", "collectives", "all_reduce",
                   "-b", "1M", "-e", "64M", "-w", "2", "-n", "5", "--backend", "gloo",
                   "--json", out], timeout=900)
        ranks = hosts.run("benchmarks.hosts_alpha_beta:_ddp_rank", kwargs={"steps": STEPS},
                          timeout=900,
                          group_timeout_s=300)
    samples = load_collectives_json(out)
    model = fit_alpha_beta(samples)
    fitted_gbit = model.busbw_Bps * 8 / 1e9
    rows = []
    for r in ranks:
        for raw in r.value:
            measured = (raw["finalize_end_ns"] - raw["backward_start_ns"]) * 1e-9
            predicted = replay(raw, model, world_size=2).backward_s
            rows.append({"rank": r.rank, "step": raw["step"], "measured_s": measured,
                         "predicted_s": predicted, "error": predicted / measured - 1})
    return {"link_gbit": rate_gbit, "fit": {"alpha_us": model.alpha_s * 1e6,
                                            "busbw_gbit": fitted_gbit},
            "rate_error": fitted_gbit / rate_gbit - 1,
            "sweep": [{"bytes": s.nbytes, "seconds": s.seconds} for s in samples],
            "steps": rows,
            "median_step_error": statistics.median(abs(x["error"]) for x in rows),
            "worst_step_error": max(abs(x["error"]) for x in rows)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="1,10", help="link rates in Gbit/s, comma-separated")
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    reason = available()
    if reason is not None:
        print(f"skipped: this machine cannot make hosts: {reason}")
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="pycomm-ab-") as tmp:
        for rate in (float(r) for r in ns.rates.split(",")):
            load = os.getloadavg()
            res = validate(rate, tmp)
            res["load_before"] = load
            res["load_after"] = os.getloadavg()
            results.append(res)
            print(f"link {rate:g} Gbit/s: fitted busbw {res['fit']['busbw_gbit']:.3f} Gbit/s "
                  f"({res['rate_error']:+.1%}), alpha {res['fit']['alpha_us']:.0f} us; "
                  f"replayed backward vs measured: median |error| "
                  f"{res['median_step_error']:.1%}, worst {res['worst_step_error']:.1%} over "
                  f"{len(res['steps'])} rank-steps (load {load[0]:.1f} -> "
                  f"{res['load_after'][0]:.1f})", flush=True)
            for row in res["steps"]:
                print(f"  rank {row['rank']} step {row['step']}: measured "
                      f"{row['measured_s'] * 1e3:.1f} ms, predicted "
                      f"{row['predicted_s'] * 1e3:.1f} ms ({row['error']:+.1%})", flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"torch": torch.__version__, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
