"""Validate pycomm.overlap's alpha-beta model on links of known rate (issue 14).

For each rate: make 2 hosts joined by a link shaped to that rate (pycomm/testing/hosts.py, root),
1. sweep `pycomm-bench collectives all_reduce` across the link (Gloo, one rank per host)
   and fit the model (pycomm.overlap.fit_alpha_beta): its bus bandwidth should be the
   link's rate;
2. train pycomm's DDP on the benchmark MLP across the same link, keep every rank's step
   timelines, and replay each step through the fitted model (pycomm.overlap.replay): the
   predicted backward should be the measured one.

    python benchmarks/hosts_alpha_beta.py --rates 1,10 [--json out.json]    # as root
    python benchmarks/hosts_alpha_beta.py --rates 1 --wires fp32,bf16,int8 --ranks-per-host 2

With --wires each DDP run sends its buckets across in that DDPConfig.wire, and its steps
are replayed with the same wire (pycomm.overlap.replay(..., wire=)), at 2 hosts of
--ranks-per-host ranks: once with the wire's bytes only, and once with its WireCost,
fitted (pycomm.overlap.fit_wire_cost) from a sweep of that wire's all-reduce across the
same hosts (the hierarchy's allreduce_wire, WIRE_SIZES).

The rate under tbf counts Ethernet frames; a TCP stream carries about 94-97% of it as
payload (headers, ACKs), which the fit sees as a lower bus bandwidth. There is no added
latency (no netem in this kernel): alpha is the stack's own.

Where the machine cannot fill the shaped rate, the link is not what bounds the bytes: so
each rate also gets a TCP probe (both hosts streaming to each other at once, as a 2-rank
all-reduce does, for --probe-s seconds, plain sockets), and the fit is judged against
what the link delivers, min(tbf rate, probe), as well as against the tbf rate.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time

import torch

from pycomm.overlap import Sample, fit_alpha_beta, fit_wire_cost, replay
from pycomm.overlap.model import load_collectives_json
from pycomm.testing.hosts import Hosts, available

STEPS, SKIP = 8, 3  # DDP steps per run; the first SKIP (bucket rebuild, warm-up) not judged


def _error_feedback(wire: str) -> bool:
    """Whether a run in `wire` keeps int8's residuals (the DDP runs and the sweeps alike)."""
    return wire == "int8"


def _ddp_rank(rank: int, world_size: int, steps: int, wire: str = "fp32") -> list[dict]:
    import pycomm
    from pycomm.bench.models import build_model

    torch.set_num_threads(1)
    module, x = build_model("mlp")
    ddp = pycomm.DistributedDataParallel(
        module, config=pycomm.DDPConfig(bucket_cap_mb=25.0, wire=wire,
                                        wire_error_feedback=_error_feedback(wire)))
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-6)
    for _ in range(steps):
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
    return [dict(t) for t in ddp.timelines(steps - SKIP)]


# float32 bytes of the buckets a wire sweep all-reduces: the bench MLP's buckets are 25 MiB
WIRE_SIZES = (1 << 20, 4 << 20, 16 << 20, 32 << 20)


def _wire_sweep_rank(rank: int, world_size: int, wire: str, reps: int = 3) -> list[dict]:
    """Median seconds of the hierarchy's all-reduce of each WIRE_SIZES bucket in `wire`
    (with error feedback as the DDP run has it)."""
    import torch.distributed as dist

    import pycomm.shm
    from pycomm import _C

    torch.set_num_threads(1)
    group = pycomm.shm.hierarchical_group(dist.group.WORLD, one_rank_per_host=True)
    backend = group._get_backend(torch.device("cpu"))
    rows = []
    for nbytes in WIRE_SIZES:
        x = torch.randn(nbytes // 4) * 1e-3
        feedback = _error_feedback(wire)
        residual = _C.WireResidual() if feedback else None
        backend.allreduce_wire(x, wire, error_feedback=feedback, residual=residual)
        times = []
        for _ in range(reps):
            dist.barrier()
            t = time.perf_counter()
            backend.allreduce_wire(x, wire, error_feedback=feedback, residual=residual)
            times.append(time.perf_counter() - t)
        rows.append({"bytes": nbytes, "seconds": statistics.median(times)})
    return rows


PROBE_PORT = 41000


def _tcp_probe(rank: int, world_size: int, addrs: list[str], seconds: float) -> float:
    """Payload Gbit/s this rank received while both ranks streamed to each other."""
    import torch.distributed as dist

    server = socket.create_server((addrs[rank], PROBE_PORT))
    dist.barrier()  # both listening
    out = socket.create_connection((addrs[1 - rank], PROBE_PORT))
    conn, _ = server.accept()
    chunk = bytes(1 << 20)
    stop = time.monotonic() + seconds

    def send() -> None:
        while time.monotonic() < stop:
            out.sendall(chunk)
        out.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=send)
    sender.start()
    got, window, buf = 0, (stop - seconds + 0.25, stop - 0.1), bytearray(1 << 20)
    while True:  # count only the middle of the window: no slow start, no tail
        n = conn.recv_into(buf)
        if not n:
            break
        if window[0] <= time.monotonic() <= window[1]:
            got += n
    sender.join()
    for s in (out, conn, server):
        s.close()
    return got * 8 / (window[1] - window[0]) / 1e9


def validate(rate_gbit: float, tmp: str, probe_s: float = 2.0, wires: tuple = ("fp32",),
             ranks_per_host: int = 1) -> dict:
    out = os.path.join(tmp, f"collectives_{rate_gbit:g}.json")
    with Hosts(2, link_gbit=rate_gbit) as hosts:
        addrs = [hosts.addr(0), hosts.addr(1)]
        probe = hosts.run("benchmarks.hosts_alpha_beta:_tcp_probe",
                          kwargs={"addrs": addrs, "seconds": probe_s}, timeout=120)
        delivered = min(r.value for r in probe)
        hosts.run([sys.executable, "-m", "pycomm.bench", "collectives", "all_reduce",
                   "-b", "1M", "-e", "64M", "-w", "2", "-n", "5", "--backend", "gloo",
                   "--json", out], timeout=900)
        runs = {wire: hosts.run("benchmarks.hosts_alpha_beta:_ddp_rank",
                                kwargs={"steps": STEPS, "wire": wire}, timeout=900,
                                ranks_per_host=ranks_per_host, group_timeout_s=300)
                for wire in wires}
        sweeps = {wire: hosts.run("benchmarks.hosts_alpha_beta:_wire_sweep_rank",
                                  kwargs={"wire": wire}, timeout=900,
                                  ranks_per_host=ranks_per_host, group_timeout_s=300)
                  for wire in wires if wire != "fp32"}
    samples = load_collectives_json(out)
    model = fit_alpha_beta(samples)
    fitted_gbit = model.busbw_Bps * 8 / 1e9
    costs = {}
    for wire, ranks in sweeps.items():  # a collective takes as long as its slowest rank
        by_size = zip(*(r.value for r in ranks))
        costs[wire] = fit_wire_cost(wire, [Sample(rows[0]["bytes"],
                                                  max(x["seconds"] for x in rows), 2)
                                           for rows in by_size], model)
    rows = []
    for wire, ranks in runs.items():
        for r in ranks:
            for raw in r.value:
                measured = (raw["finalize_end_ns"] - raw["backward_start_ns"]) * 1e-9
                # across 2 hosts: the link is the model's, the hosts its world
                predicted = replay(raw, model, world_size=2, wire=costs.get(wire, wire)
                                   ).backward_s
                bytes_only = replay(raw, model, world_size=2, wire=wire).backward_s
                rows.append({"wire": wire, "rank": r.rank, "step": raw["step"],
                             "measured_s": measured, "predicted_s": predicted,
                             "error": predicted / measured - 1,
                             "bytes_only_error": bytes_only / measured - 1})
    return {"link_gbit": rate_gbit, "fit": {"alpha_us": model.alpha_s * 1e6,
                                            "busbw_gbit": fitted_gbit},
            "rate_error": fitted_gbit / rate_gbit - 1,
            "tcp_probe_gbit": delivered,
            "delivered_gbit": min(rate_gbit, delivered),
            "delivered_error": fitted_gbit / min(rate_gbit, delivered) - 1,
            "sweep": [{"bytes": s.nbytes, "seconds": s.seconds} for s in samples],
            "wire_sweeps": {wire: [r.value for r in ranks] for wire, ranks in sweeps.items()},
            "wire_costs": {wire: {"alpha_ms": c.alpha_s * 1e3, "ns_per_byte": c.s_per_byte * 1e9}
                           for wire, c in costs.items()},
            "steps": rows,
            "median_step_error": statistics.median(abs(x["error"]) for x in rows),
            "worst_step_error": max(abs(x["error"]) for x in rows)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="1,10", help="link rates in Gbit/s, comma-separated")
    p.add_argument("--probe-s", type=float, default=2.0,
                   help="seconds of the TCP probe of each link (default 2)")
    p.add_argument("--wires", default="fp32",
                   help="DDPConfig.wire values the DDP runs take, comma-separated (int8 with "
                        "error feedback); each step is replayed with its wire")
    p.add_argument("--ranks-per-host", type=int, default=1)
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
            res = validate(rate, tmp, ns.probe_s, tuple(ns.wires.split(",")),
                           ns.ranks_per_host)
            res["load_before"] = load
            res["load_after"] = os.getloadavg()
            results.append(res)
            print(f"link {rate:g} Gbit/s: fitted busbw {res['fit']['busbw_gbit']:.3f} Gbit/s "
                  f"({res['rate_error']:+.1%} of the rate; the TCP probe delivered "
                  f"{res['tcp_probe_gbit']:.2f} Gbit/s each way, fit "
                  f"{res['delivered_error']:+.1%} of what the link delivers), "
                  f"alpha {res['fit']['alpha_us']:.0f} us; "
                  f"replayed backward vs measured: median |error| "
                  f"{res['median_step_error']:.1%}, worst {res['worst_step_error']:.1%} over "
                  f"{len(res['steps'])} rank-steps (load {load[0]:.1f} -> "
                  f"{res['load_after'][0]:.1f})", flush=True)
            for wire in ns.wires.split(","):
                errs = sorted(abs(x["error"]) for x in res["steps"] if x["wire"] == wire)
                plain = sorted(abs(x["bytes_only_error"]) for x in res["steps"]
                               if x["wire"] == wire)
                cost = res["wire_costs"].get(wire)
                print(f"  wire {wire}: median |error| {errs[len(errs) // 2]:.1%}, worst "
                      f"{errs[-1]:.1%} over {len(errs)} rank-steps; bytes only "
                      f"{plain[len(plain) // 2]:.1%}, worst {plain[-1]:.1%}"
                      + (f"; its cost {cost['alpha_ms']:.2f} ms + {cost['ns_per_byte']:.3f} "
                         f"ns/byte a bucket" if cost else ""), flush=True)
            for row in res["steps"]:
                print(f"  wire {row['wire']} rank {row['rank']} step {row['step']}: measured "
                      f"{row['measured_s'] * 1e3:.1f} ms, predicted "
                      f"{row['predicted_s'] * 1e3:.1f} ms ({row['error']:+.1%})", flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"torch": torch.__version__, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
