"""The alpha-beta network model, its fit, and the replay of recorded steps through it."""

import json
import random

import pytest

from pycomm.overlap import (
    AlphaBeta,
    Sample,
    WireCost,
    fit_alpha_beta,
    fit_in_backward,
    fit_wire_cost,
    load_collectives_json,
    param_nbytes_from,
    rebucket,
    relative_errors,
    replay,
    step_report,
)
from pycomm.overlap.model import allreduce_bus_factor, latency_steps
from pycomm.overlap.whatif import format_what_if, what_if
from tests.support.overlap_timelines import MS, random_timeline, two_bucket_timeline

# 1 ms per collective, 1 byte per ns: every hand-computed time below is a whole number of ns.
HAND = AlphaBeta(alpha_s=1e-3, busbw_Bps=1e9)


def _ms(seconds):
    # The replay computes in ns (integers here), then reports seconds: exact to the ns.
    return round(seconds * 1e9) / MS


def test_bus_factor_and_latency_steps():
    assert [allreduce_bus_factor(n) for n in (1, 2, 4, 8)] == [0, 1, 1.5, 1.75]
    assert latency_steps(8, "ring") == 14 and latency_steps(8, "tree") == 6
    assert latency_steps(1000, "tree") == 20 and latency_steps(5, "constant") == 1
    with pytest.raises(ValueError, match="latency must be one of"):
        AlphaBeta(1e-6, 1e9, latency="star")


def test_allreduce_time_by_hand():
    assert HAND.allreduce_s(4_000_000, 2) == pytest.approx(5e-3, rel=1e-15)
    ring = AlphaBeta(alpha_s=0.5e-3, busbw_Bps=1e9, latency="ring")
    assert ring.allreduce_s(4_000_000, 4) == pytest.approx(3e-3 + 6e-3, rel=1e-15)
    assert HAND.allreduce_s(10**9, 1) == 0  # nothing to exchange alone
    link = AlphaBeta.from_link(gbit_s=100, latency_us=5)
    assert link.busbw_Bps == 12.5e9 and link.alpha_s == pytest.approx(5e-6)
    with pytest.raises(ValueError, match="busbw_Bps > 0"):
        AlphaBeta(1e-6, 0)


def test_hand_computed_two_bucket_replay():
    # b0: 4 MB ready 10 ms -> 5 ms on the wire: 10..15. b1: 2 MB ready 12 ms, waits for b0:
    # 15..18. Backward's compute ends at 12 ms: exposed 6 of comm 8 ([10,15] U [12,18]).
    # Finalize reached 12.5 ms, worked 1 ms after the recorded last collective: ends 19 ms.
    p = replay(two_bucket_timeline(), HAND, world_size=2)
    assert [(_ms(b.launch_s), _ms(b.start_s), _ms(b.done_s)) for b in p.buckets] == [
        (10, 10, 15), (12, 15, 18)]
    assert (_ms(p.compute_s), _ms(p.comm_s), _ms(p.exposed_comm_s)) == (12, 8, 6)
    assert p.overlap == 0.25
    assert (_ms(p.backward_s), _ms(p.finalize_s)) == (19, 6.5)


def test_hand_computed_replay_with_a_low_precision_wire():
    # bf16 halves the bandwidth term, keeps the latency: b0 1 + 2 ms (10..13), b1 1 + 1 ms
    # (13..15). int8 sends a byte per element and a 4-byte scale per 256: b0's 1,000,000
    # elements as 1,000,000 + 4 x 3,907 = 1,015,628 bytes.
    p = replay(two_bucket_timeline(), HAND, world_size=2, wire="bf16")
    assert [(_ms(b.start_s), _ms(b.done_s)) for b in p.buckets] == [(10, 13), (13, 15)]
    p = replay(two_bucket_timeline(), HAND, world_size=2, wire="int8")
    assert _ms(p.buckets[0].done_s) == pytest.approx(10 + 1 + 1.015628, abs=1e-6)
    assert replay(two_bucket_timeline(), HAND, 2, wire="fp32") == replay(
        two_bucket_timeline(), HAND, 2)
    with pytest.raises(ValueError, match="wire must be 'fp32', 'bf16' or 'int8'"):
        replay(two_bucket_timeline(), HAND, 2, wire="fp8")


def test_hand_computed_replay_with_a_wire_cost():
    # bf16 with 0.5 ms a bucket and 1 ns a float32 byte on top: b0 (4 MB) 3 + 0.5 + 4 ms
    # (10..17.5), b1 (2 MB) 2 + 0.5 + 2 ms (17.5..22).
    cost = WireCost(wire="bf16", alpha_s=0.5e-3, s_per_byte=1e-9)
    p = replay(two_bucket_timeline(), HAND, world_size=2, wire=cost)
    assert [(_ms(b.start_s), _ms(b.done_s)) for b in p.buckets] == [(10, 17.5), (17.5, 22)]
    assert replay(two_bucket_timeline(), HAND, 2, wire=WireCost("bf16", 0, 0)) == replay(
        two_bucket_timeline(), HAND, 2, wire="bf16")
    with pytest.raises(ValueError, match="wire must be 'fp32', 'bf16' or 'int8'"):
        replay(two_bucket_timeline(), HAND, 2, wire=WireCost("fp8", 0, 0))


def test_fit_wire_cost_recovers_what_the_wire_adds():
    # Times made by the model itself plus 2 ms + 3 ns a float32 byte come back as that cost;
    # a wire that only saves its bytes costs nothing more; one size is not enough.
    sizes = (1 << 20, 8 << 20, 32 << 20)

    def made(alpha, per_byte):
        return [Sample(n, HAND.allreduce_s(n / 2, 2) + alpha + per_byte * n, 2) for n in sizes]

    cost = fit_wire_cost("bf16", made(2e-3, 3e-9), HAND)
    assert (cost.wire, cost.alpha_s, cost.s_per_byte) == ("bf16", pytest.approx(2e-3),
                                                         pytest.approx(3e-9))
    cost = fit_wire_cost("bf16", made(0.0, 0.0), HAND)
    assert cost.alpha_s == pytest.approx(0, abs=1e-12)
    assert cost.s_per_byte == pytest.approx(0, abs=1e-18)
    with pytest.raises(ValueError, match="two different sizes"):
        fit_wire_cost("bf16", made(0, 0)[:1], HAND)
    # a line through a negative intercept: refitted through the origin, not cut at it
    cost = fit_wire_cost("bf16", made(-2e-3, 4e-9), HAND)
    rows = [(n, -2e-3 + 4e-9 * n) for n in sizes]
    through_origin = sum(n * e for n, e in rows) / sum(n * n for n, _ in rows)
    assert (cost.alpha_s, cost.s_per_byte) == (0, pytest.approx(through_origin))
    # one rank all-reduces nothing, so its wire costs nothing
    alone = replay(two_bucket_timeline(), HAND, 1, wire=WireCost("bf16", 1e-3, 1e-9))
    assert alone == replay(two_bucket_timeline(), HAND, 1)


def test_hand_computed_replay_at_four_ranks_on_a_ring():
    # L(4) = 6 steps of 0.5 ms = 3 ms; factor 1.5: b0 3 + 6 = 9 ms (10..19), b1 3 + 3 = 6 ms
    # (19..25); exposed 25 - 12 = 13 of comm 15.
    ring = AlphaBeta(alpha_s=0.5e-3, busbw_Bps=1e9, latency="ring")
    p = replay(two_bucket_timeline(), ring, world_size=4)
    assert [(_ms(b.start_s), _ms(b.done_s)) for b in p.buckets] == [(10, 19), (19, 25)]
    assert (_ms(p.comm_s), _ms(p.exposed_comm_s), _ms(p.backward_s)) == (15, 13, 26)
    assert p.overlap == pytest.approx(2 / 15, abs=1e-12)


def test_hand_computed_replay_with_one_big_bucket():
    # Cap 8 MB: both parameters in one 6 MB bucket, complete at 12 ms: 12..19, all exposed.
    p = replay(two_bucket_timeline(), HAND, 2, cap_bytes=8_000_000,
               param_nbytes=[4_000_000, 2_000_000])
    assert [(b.param_indices, b.nbytes) for b in p.buckets] == [((0, 1), 6_000_000)]
    assert (_ms(p.exposed_comm_s), _ms(p.comm_s), p.overlap, _ms(p.backward_s)) == (7, 7, 0, 20)


def test_launch_waits_for_earlier_buckets():
    raw = two_bucket_timeline()
    raw["buckets"][0]["ready_ns"] = raw["buckets"][0]["launch_ns"] = (
        raw["backward_start_ns"] + 11 * MS)
    raw["buckets"][1]["ready_ns"] = raw["buckets"][1]["launch_ns"] = (
        raw["backward_start_ns"] + 9 * MS)
    raw["param_ready_ns"] = [raw["backward_start_ns"] + 11 * MS, raw["backward_start_ns"] + 9 * MS]
    p = replay(raw, HAND, 2)
    assert [_ms(b.launch_s) for b in p.buckets] == [11, 11]  # b1 ready at 9, launched after b0


@pytest.mark.parametrize("seed", range(20))
def test_replay_reproduces_a_step_that_followed_the_model(seed):
    model = AlphaBeta(alpha_s=0.2e-3, busbw_Bps=2e9)
    raw, _ = random_timeline(seed, comm_ns=lambda n: round(model.allreduce_s(n, 2) * 1e9))
    p, r = replay(raw, model, 2), step_report(raw)
    for sim, rec in zip(p.buckets, r.buckets):
        # The generator rounded each duration to the ns; the replay did not: <= 1 ns apart
        # per collective, so a few ns at the end of the chain.
        assert abs(sim.done_s - rec.done_s) < 50e-9
    assert abs(p.exposed_comm_s - r.exposed_comm_s) < 50e-9
    assert abs(p.comm_s - r.comm_s) < 50e-9


@pytest.mark.parametrize("seed", range(30))
def test_rebucket_keeps_every_parameter_once(seed):
    raw, nbytes = random_timeline(seed, n_params=20)
    cap = random.Random(seed).choice([1, 1 << 20, 4 << 20, 1 << 40])
    buckets = rebucket(raw, nbytes, cap, first_cap_bytes=1 << 20)
    assert sorted(i for _, _, ps in buckets for i in ps) == list(range(20))
    assert sum(size for _, size, _ in buckets) == sum(nbytes)
    readies = [r for r, _, _ in buckets]
    assert readies == sorted(readies)
    for k, (_, size, ps) in enumerate(buckets[:-1]):
        limit = (1 << 20) if k == 0 else cap
        assert size >= limit and size - nbytes[ps[-1]] < limit  # closed at the first >= cap


def test_replay_errors_name_the_argument():
    raw = two_bucket_timeline()
    with pytest.raises(ValueError, match="needs param_nbytes"):
        replay(raw, HAND, 2, cap_bytes=1 << 20)
    with pytest.raises(ValueError, match="param_nbytes has 1 entries for 2"):
        replay(raw, HAND, 2, cap_bytes=1 << 20, param_nbytes=[4])


def test_fit_recovers_alpha_and_bandwidth():
    truth = AlphaBeta(alpha_s=30e-6, busbw_Bps=1.3e9, latency="ring")
    sizes = [4 << k for k in range(0, 26, 2)]
    samples = [Sample(s, truth.allreduce_s(s, n), n) for s in sizes for n in (2, 3, 4)]
    fit = fit_alpha_beta(samples, latency="ring")
    assert fit.alpha_s == pytest.approx(truth.alpha_s, rel=1e-9)  # noiseless: exact up to fp
    assert fit.busbw_Bps == pytest.approx(truth.busbw_Bps, rel=1e-9)
    rng = random.Random(0)
    noisy = [Sample(s.nbytes, s.seconds * rng.uniform(0.95, 1.05), s.world_size) for s in samples]
    fit = fit_alpha_beta(noisy, latency="ring")
    # +-5% noise on every sample moves the fitted parameters by a few percent at most.
    assert fit.alpha_s == pytest.approx(truth.alpha_s, rel=0.1)
    assert fit.busbw_Bps == pytest.approx(truth.busbw_Bps, rel=0.1)
    assert max(abs(e) for e in relative_errors(fit, noisy)) < 0.12


def test_fit_clamps_latency_at_zero_and_refuses_nonsense():
    # Times below a straight line through the origin: the free fit wants alpha < 0.
    samples = [Sample(1000, 0.5e-6, 2), Sample(10**6, 1e-3, 2), Sample(10**7, 1e-2, 2)]
    fit = fit_alpha_beta(samples)
    assert fit.alpha_s == 0 and fit.busbw_Bps > 0
    with pytest.raises(ValueError, match="two different sizes"):
        fit_alpha_beta([Sample(8, 1e-4, 2), Sample(8, 2e-4, 2)])
    with pytest.raises(ValueError, match="do not grow with size"):
        fit_alpha_beta([Sample(8, 2e-4, 2), Sample(10**6, 1e-4, 2)])
    with pytest.raises(ValueError, match="at least 2 samples"):
        fit_alpha_beta([Sample(8, 1e-4, 1)])


def test_load_collectives_json(tmp_path):
    doc = {"world_size": 3, "rows": [
        {"collective": "all_reduce", "size": 1024, "time_us": 250.0},
        {"collective": "broadcast", "size": 1024, "time_us": 100.0},
        {"collective": "all_reduce", "size": 1 << 20, "time_us": 900.0}]}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    assert load_collectives_json(path) == [Sample(1024, 250e-6, 3), Sample(1 << 20, 900e-6, 3)]
    bench = {"schema": "pycomm-bench/collectives/1", "meta": {"world": 2}, "rows": [
        {"collective": "all_reduce", "size": 64, "type": "float", "redop": "sum",
         "measures": [{"placement": "in-place", "time_us": 300.0}]},
        {"collective": "all_reduce", "size": 64, "type": "float", "redop": "max",
         "measures": [{"placement": "in-place", "time_us": 310.0}]},
        {"collective": "all_reduce", "size": 64, "type": "half", "redop": "sum",
         "measures": [{"placement": "in-place", "time_us": 320.0}]}]}
    path.write_text(json.dumps(bench))
    assert load_collectives_json(path) == [Sample(64, 300e-6, 2)]
    path.write_text(json.dumps({"rows": [{"size": 8}]}))
    with pytest.raises(ValueError, match="lacks size, time_us or a world size"):
        load_collectives_json(path)


def test_what_if_table_replays_every_combination():
    nets = {"100G": AlphaBeta.from_link(100, 5, "tree"), "hand": HAND}
    rows = what_if(two_bucket_timeline(), nets, [2, 8], [None, 8_000_000],
                   param_nbytes=[4_000_000, 2_000_000])
    assert len(rows) == 2 * 2 * 2
    hand2 = [r for r in rows if r.network == "hand" and r.world_size == 2]
    assert [_ms(r.prediction.backward_s) for r in hand2] == [19, 20]  # the examples above
    text = format_what_if(rows).splitlines()
    assert len(text) == 2 + 4
    assert text[2 + 2].split()[0] == "hand" and text[2 + 2].endswith("recorded")


def test_reports_and_raw_timelines_replay_alike():
    raw = two_bucket_timeline()
    report = step_report(raw)
    assert report.timeline is raw
    assert replay(report, HAND, 2) == replay(raw, HAND, 2)


def test_param_nbytes_from_bucket_element_sizes():
    raw = two_bucket_timeline()  # 4 MB and 2 MB buckets of one parameter each
    assert param_nbytes_from(raw, [1_000_000, 500_000]) == [4_000_000, 2_000_000]  # fp32
    assert param_nbytes_from(raw, [2_000_000, 1_000_000]) == [4_000_000, 2_000_000]  # bf16
    with pytest.raises(ValueError, match="bucket 0: 4000000 bytes is not a whole"):
        param_nbytes_from(raw, [3_000_000, 500_000])


def test_fit_in_backward_inverts_the_replay():
    # Steps that followed a known network exactly (serial collectives): the fit recovers it.
    truth = AlphaBeta(alpha_s=0.4e-3, busbw_Bps=0.5e9)
    steps = [random_timeline(seed, comm_ns=lambda n: round(truth.allreduce_s(n, 2) * 1e9))[0]
             for seed in range(5)]
    fit = fit_in_backward(steps, world_size=2, alpha_s=truth.alpha_s)
    # Durations were rounded to the ns: the bandwidth agrees to ~1e-6 relative.
    assert fit.alpha_s == truth.alpha_s
    assert fit.busbw_Bps == pytest.approx(truth.busbw_Bps, rel=1e-4)
    with pytest.raises(ValueError, match="less than the latency alone"):
        fit_in_backward(steps, world_size=2, alpha_s=1.0)


def test_fit_in_backward_counts_concurrent_collectives_once():
    # Two 4 MB buckets in flight together (as Gloo's two threads run them), both done 10 ms
    # after launch: the network was busy 10 ms for 8 MB, i.e. 0.8 GB/s with no latency.
    raw = two_bucket_timeline()
    t0 = raw["backward_start_ns"]
    for b in raw["buckets"]:
        b.update(nbytes=4_000_000, ready_ns=t0 + 12 * MS, launch_ns=t0 + 12 * MS,
                 done_ns=t0 + 22 * MS)
    assert fit_in_backward([raw], 2, alpha_s=0).busbw_Bps == pytest.approx(0.8e9, rel=1e-12)
