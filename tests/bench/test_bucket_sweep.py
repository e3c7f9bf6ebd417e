"""`pycomm-bench ddp --sweep-bucket-cap` on a small model, 2 Gloo ranks."""

import importlib.util

import torch
import torch.distributed as dist
from torch import nn

from pycomm.bench import bucket_sweep
from pycomm.bench.bucket_sweep import SweepConfig
from pycomm.overlap import AlphaBeta
from pycomm.overlap.advice import TORCH_CAP_MB, format_sweep
from tests.support.multirank import run_ranks


def _model():
    # 0.87 MB of gradients: one torch-sized bucket, 2 of 0.5 MiB, 4 of 0.05 MiB.
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 16))


def _loss(ddp):
    torch.manual_seed(dist.get_rank())
    return ddp(torch.randn(8, 64)).square().mean()


def _sweep(rank, world_size, plot):
    # A given network (Gloo on this machine, roughly) instead of the fit, to stay fast.
    cfg = SweepConfig(caps_mb=(0.05, 0.5), rounds=2, steps=2, warmup=1,
                      network=AlphaBeta(alpha_s=300e-6, busbw_Bps=1e9))
    result, steps = bucket_sweep.run(cfg, _model, _loss)
    assert [r.cap_mb for r in result.rows] == [0.05, 0.5, TORCH_CAP_MB]
    assert result.recommended_mb in (0.05, 0.5, TORCH_CAP_MB) and result.reason
    by_cap = {r.cap_mb: r for r in result.rows}
    assert [by_cap[c].buckets for c in (0.05, 0.5, TORCH_CAP_MB)] == [4, 2, 1]
    assert by_cap[TORCH_CAP_MB].vs_torch == 1 and by_cap[TORCH_CAP_MB].wins == 0
    grad_bytes = sum(p.numel() * 4 for p in _model().parameters())
    for r in result.rows:
        assert 0 <= r.exposed_comm_s <= r.comm_s and 0 <= r.overlap <= 1
        assert r.predicted_backward_s > 0 and r.step_s >= r.backward_s
        assert 0 <= r.wins <= cfg.rounds
    assert all(s.nbytes == grad_bytes for s in steps.values())
    # The in-backward bandwidth is fitted unless the collectives took less than the given
    # latency (then the given network predicts); either way one table line says which.
    assert result.in_backward is None or result.in_backward.alpha_s == cfg.network.alpha_s
    text = format_sweep(result)
    assert f"recommended bucket cap: {result.recommended_mb:g} MiB" in text
    assert len(text.splitlines()) == (2 if result.in_backward else 1) + 2 + 3 + 1
    if rank == 0:
        said = bucket_sweep.draw(plot, result, steps)
        # matplotlib is the optional `plot` extra: without it the table stands alone.
        assert said == (f"# timeline picture: {plot}" if HAVE_MATPLOTLIB else
                        "# no picture: drawing the timeline needs matplotlib: pip install "
                        "matplotlib (pycomm's `plot` extra)"), said


HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_sweep_measures_every_cap_and_draws_with_matplotlib(tmp_path):
    plot = tmp_path / "sweep.png"
    run_ranks(_sweep, world_size=2, plot=str(plot))
    assert plot.exists() == HAVE_MATPLOTLIB
    if HAVE_MATPLOTLIB:
        assert plot.read_bytes()[:4] == b"\x89PNG"


def test_sweep_is_a_mode_of_pycomm_bench_ddp():
    import argparse

    from pycomm.bench import ddp

    p = argparse.ArgumentParser()
    ddp.add_arguments(p)
    ns = p.parse_args(["--sweep-bucket-cap", "--caps", "2,8", "--plot", "", "--reps", "3"])
    assert ns.sweep_bucket_cap and ns.caps == (2.0, 8.0) and ns.plot == ""
    cfg = bucket_sweep.config_from(ns)
    assert (cfg.caps_mb, cfg.rounds, cfg.network) == ((2.0, 8.0), 3, None)
    assert not p.parse_args([]).sweep_bucket_cap
