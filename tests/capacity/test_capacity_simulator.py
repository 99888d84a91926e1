"""The discrete-event simulator: an M/D/1 queue, hand-checkable timelines of the workers' code paths,
the planner's search (deterministic under a seed) and trace-replay validation."""

from __future__ import annotations

import numpy as np
import pytest
from sim_profiles import make_profile

from pdserve.capacity.arrivals import arrival_times
from pdserve.capacity.metrics import RequestRecord
from pdserve.capacity.planner import Slos, Workload, parse_tail_slo, plan, slices, timing_for, validate
from pdserve.capacity.simulator import Deployment, Timing, simulate
from pdserve.capacity.workload import LengthDist
from pdserve.engine.sim_profile import Overhead


def test_md1_mean_wait() -> None:
    service, rate, n = 0.1, 5.0, 20_000  # rho = 0.5
    rho, mu = rate * service, 1 / service
    # one prefill worker, one prompt per pass (the budget), no transfer, one output token
    timing = timing_for(make_profile(prefill=(service, 0.0, 0.0), max_batched_tokens=8))
    records = simulate(Deployment(1, 1), arrival_times(n, rate, 1.0, 3), [8] * n, [1] * n, timing)
    wq = float(np.mean([r.ttft for r in records])) - service
    assert wq == pytest.approx(rho / (2 * mu * (1 - rho)), rel=0.08)


def test_single_request_timeline() -> None:
    # prefill pass 0.5 s, transfer 0.1 s, decode steps 0.05 s; 4 output tokens
    timing = timing_for(make_profile(prefill=(0.5, 0.0, 0.0), decode=(0.05, 0.0, 0.0), transfer_s=0.1))
    (r,) = simulate(Deployment(1, 1), [1.0], [100], [4], timing)
    assert r.ttft == pytest.approx(0.6) and r.itl == pytest.approx([0.05] * 3)
    assert r.e2e == pytest.approx(0.75) and r.tpot == pytest.approx(0.05) and r.output_tokens == 4
    (c,) = simulate(Deployment(colocated=1), [1.0], [100], [4], timing)
    assert c.ttft == pytest.approx(0.5) and c.e2e == pytest.approx(0.65)


def test_overhead_is_scaled_and_added_per_pass_and_per_request() -> None:
    profile = make_profile(prefill=(0.5, 0.0, 0.0), decode=(0.05, 0.0, 0.0), overhead=Overhead(0.01, 0.1))
    (r,) = simulate(Deployment(colocated=1), [0.0], [100], [3], Timing(profile, profile, overhead_scale=2.0))
    assert r.ttft == pytest.approx(0.5 + 0.02 + 0.2) and r.itl == pytest.approx([0.07, 0.07])


def test_chunked_prefill_lets_a_short_prompt_pass_a_long_one() -> None:
    # 1 ms per token, chunks of 100 tokens: the 1000-token prompt takes 10 passes, the short one
    # arriving just after shares the second pass and finishes long before
    timing = timing_for(make_profile(prefill=(0.0, 0.001, 0.0), prefill_chunk_tokens=100))
    long, short = simulate(Deployment(1, 1), [0.0, 0.01], [1000, 10], [1, 1], timing)
    assert short.ttft == pytest.approx(0.1 + 0.11 - 0.01)
    assert long.ttft == pytest.approx(1.0 + 0.01)


def test_colocated_prompt_joins_the_decode_pass() -> None:
    # request 0 decodes; request 1's 1000-token prefill runs inside one mixed pass: one ITL of about 1 s
    timing = timing_for(make_profile(prefill=(0.0, 0.001, 0.0), decode=(0.01, 0.0, 0.0)))
    r0, _ = simulate(Deployment(colocated=1), [0.0, 0.1], [10, 1000], [20, 2], timing)
    assert max(r0.itl) == pytest.approx(1.0 + 0.01 - 0.0, abs=0.011)
    d0, _ = simulate(Deployment(1, 1), [0.0, 0.1], [10, 1000], [20, 2], timing)
    assert max(d0.itl) == pytest.approx(0.01)


def test_kv_capacity_parks_the_reservation() -> None:
    # the decode pool holds 2 blocks: the second request (16 + 1 tokens -> 2 blocks) waits for the first
    timing = timing_for(make_profile(decode=(0.1, 0.0, 0.0), kv_capacity_tokens=32))
    a, b = simulate(Deployment(1, 1), [0.0, 0.0], [16, 16], [10, 10], timing)
    assert a.output_tokens == 10 and b.ttft == pytest.approx(a.e2e)


def test_preemption_recomputes_and_every_request_finishes() -> None:
    # 8 blocks for 4 requests that each grow to 4 blocks: the newest are preempted and recomputed
    timing = timing_for(make_profile(prefill=(0.01, 0.0, 0.0), decode=(0.01, 0.0, 0.0), kv_capacity_tokens=128))
    records = simulate(Deployment(colocated=1), [0.0] * 4, [16] * 4, [48] * 4, timing)
    assert [r.output_tokens for r in records] == [48] * 4


def test_planner_is_deterministic_and_recommends_a_deployment_that_holds() -> None:
    timing = timing_for(make_profile(prefill=(0.02, 2e-4, 0.0), decode=(0.01, 1e-3, 0.0)))
    workload = Workload(LengthDist.parse("64:256"), LengthDist.parse("8:32"))
    slos = Slos({}, tuple(parse_tail_slo(["ttft_p90_ms=300", "tpot_p90_ms=40"])))
    first = plan(timing, workload, rate=40.0, slos=slos, max_workers=256, num_requests=150, seed=7, max_slice=3)
    again = plan(timing, workload, rate=40.0, slos=slos, max_workers=256, num_requests=150, seed=7, max_slice=3)
    assert first == again
    rec = first["recommended"]
    assert rec["sustains"] >= 40.0 and rec["verified"]["slos_met"]
    assert rec["verified"]["ttft_p90_ms"] <= 300 and rec["verified"]["tpot_p90_ms"] <= 40
    front = first["pareto_front"]
    assert [p["workers"] for p in front] == sorted(p["workers"] for p in front)
    assert all(a["goodput"] < b["goodput"] for a, b in zip(front, front[1:], strict=False))
    assert front[-1]["workers"] <= 256 and front[-1]["workers"] > 128
    assert [d.name for d in slices(3)] == ["colocated x1", "1P1D", "1P2D", "2P1D"]
    with pytest.raises(ValueError):
        Slos({})
    with pytest.raises(ValueError, match="tail SLO"):
        parse_tail_slo(["ttft_p95_ms=1"])


def test_validate_replays_the_measured_trace() -> None:
    profile = make_profile(prefill=(0.05, 0.0, 0.0), decode=(0.01, 0.0, 0.0))
    timing = timing_for(profile)
    arrivals, inputs, outputs = [0.0, 0.3, 0.6], [32, 32, 32], [5, 5, 5]
    measured = simulate(Deployment(1, 1), arrivals, inputs, outputs, timing)
    for r in measured:  # the "measurement" is 10% slower in TPOT than the model
        r.itl = [g * 1.1 for g in r.itl]
        r.e2e = r.ttft + sum(r.itl)
    from pdserve.capacity.metrics import summarize

    slos = {"ttft": 1.0}
    duration = max(r.send_time + r.e2e for r in measured)
    sweep = {
        "bench": {"output_len": {"uniform": [5, 5]}, "slos_ms": {"ttft": 1000.0}, "speedup": 1.0, "warmup": 0},
        "points": [
            {
                "config": "1P1D",
                "prefill": 1,
                "decode": 1,
                "colocated": 0,
                "rate": 3.3,
                "summary": summarize(measured, duration, slos),
                "records": [r.to_json() for r in measured],
            }
        ],
    }
    result = validate(timing, sweep)
    (point,) = result["points"]
    assert point["tpot_ms_mean"]["rel_error"] == pytest.approx(1 / 1.1 - 1)
    assert point["ttft_ms_p90"]["rel_error"] == pytest.approx(0.0)
    assert point["goodput_ci95"][0] <= point["goodput"]["measured"] <= point["goodput_ci95"][1]
    assert set(result["mean_abs_rel_error"]) >= {"goodput", "ttft_ms_p90", "tpot_ms_mean", "itl_ms_p99"}
    assert isinstance(RequestRecord.from_json(sweep["points"][0]["records"][0]), RequestRecord)


def test_prefix_cache_skips_the_cached_blocks_of_a_repeated_prompt() -> None:
    from pdserve.capacity.simulator import PrefixCache

    # 1 ms per prompt token; the same 160-token prompt twice: the second computes only its last block
    timing = timing_for(make_profile(prefill=(0.0, 0.001, 0.0)))
    hashes = [list(range(1, 11))] * 2  # ten full blocks of 16 tokens
    caches = [PrefixCache(capacity_blocks=100)]
    first, second = simulate(Deployment(1, 1), [0.0, 1.0], [160, 160], [1, 1], timing, hashes, caches)
    assert first.ttft == pytest.approx(0.16) and second.ttft == pytest.approx(0.016)
    (third,) = simulate(Deployment(1, 1), [0.0], [160], [1], timing, hashes[:1], caches)  # the cache persists
    assert third.ttft == pytest.approx(0.016)
    small = PrefixCache(capacity_blocks=3)
    small.add([1, 2, 3, 4])
    assert small.hits([1, 2]) == 0 and small.hits([2, 3, 4]) == 3  # least recently used went first


def test_colocated_workers_prefix_cache_shortens_the_prefill_and_the_mixed_pass() -> None:
    """A colocated worker prefills too, with the same prefix cache (the real engine's `BlockPool`):
    a repeated prompt computes its last block only, alone or inside another request's decode step."""
    from pdserve.capacity.simulator import PrefixCache

    timing = timing_for(make_profile(prefill=(0.0, 0.001, 0.0), decode=(0.01, 0.0, 0.0)))
    hashes = [list(range(1, 11))] * 2  # ten full blocks of 16 tokens
    caches = [PrefixCache(capacity_blocks=100)]
    first, second = simulate(Deployment(colocated=1), [0.0, 1.0], [160, 160], [1, 1], timing, hashes, caches)
    assert first.ttft == pytest.approx(0.16) and second.ttft == pytest.approx(0.016)
    # the repeat joins a running decode: its mixed pass costs 16 prompt tokens, not 160
    cold = simulate(Deployment(colocated=1), [0.0, 0.1], [160, 160], [20, 2], timing, hashes, [PrefixCache(100)])
    assert max(cold[1].itl) == pytest.approx(0.01)
    assert max(cold[0].itl) == pytest.approx(0.016 + 0.01, abs=0.011)
    # without hashes (no prompts known) nothing is cached, as before
    plain = simulate(Deployment(colocated=1), [0.0, 1.0], [160, 160], [1, 1], timing)
    assert plain[1].ttft == pytest.approx(0.16)


def test_overhead_per_sequence_grows_with_the_batch() -> None:
    # decode steps of 10 ms; the stack adds 1 ms per pass and 2 ms per sequence in it (scale 1)
    profile = make_profile(decode=(0.01, 0.0, 0.0), overhead=Overhead(per_pass_s=0.001, per_seq_s=0.002))
    (alone,) = simulate(Deployment(colocated=1), [0.0], [16], [4], timing_for(profile))
    assert alone.itl == pytest.approx([0.01 + 0.001 + 0.002] * 3)
    pair = simulate(Deployment(colocated=1), [0.0, 0.0], [16, 16], [4, 4], timing_for(profile))
    assert pair[0].itl == pytest.approx([0.01 + 0.001 + 2 * 0.002] * 3)
    # disaggregated: the commit of arrived KV costs one sequence in the decode worker's next pass
    (d,) = simulate(Deployment(1, 1), [0.0], [16], [3], timing_for(profile))
    assert d.itl == pytest.approx([0.013 + 0.002, 0.013])


def _decode_run(sigma: float, seed: int) -> list[float]:
    profile = make_profile(decode=(0.01, 0.0, 0.0), overhead=Overhead(per_pass_s=0.004, jitter_sigma=sigma))
    timing = Timing(profile, profile, overhead_scale=1.0, seed=seed)
    (r,) = simulate(Deployment(colocated=1), [0.0], [16], [2001], timing)
    return r.itl


def test_overhead_jitter_is_seeded_has_mean_one_and_a_heavy_tail() -> None:
    assert _decode_run(0.0, 1) == pytest.approx([0.014] * 2000)  # sigma 0: the constant overhead
    first, again, other = _decode_run(1.5, 1), _decode_run(1.5, 1), _decode_run(1.5, 2)
    assert first == again and first != other  # same seed, same timeline
    extra = np.array(first) - 0.01
    assert extra.min() > 0 and float(np.mean(extra)) == pytest.approx(0.004, rel=0.2)  # factor of mean 1
    assert float(np.percentile(extra, 99)) > 5 * 0.004 > 5 * float(np.median(extra))  # most passes cheap, a few slow


def _simulated_sweep(
    base,
    truth: Overhead,
    rates: tuple[float, ...],
    n: int,  # noqa: ANN001
    **timing: object,
) -> dict:
    """A sim-engine sweep's results.json as a 1P2D deployment with `truth` as its overhead would
    measure it (`timing`: extra Timing arguments, e.g. another seed than the calibration's)."""
    from dataclasses import replace

    from pdserve.capacity.metrics import summarize

    speedup, slos, points = 0.5, {"ttft": 1.0}, []
    true_profile = replace(base, overhead=truth)
    for rate_index, rate in enumerate(rates):
        arrivals = arrival_times(n, rate, 1.0, 5 + rate_index)
        rng = np.random.default_rng(rate_index)
        inputs, outputs = list(rng.integers(64, 256, n)), list(rng.integers(16, 48, n))
        measured = simulate(
            Deployment(1, 2),
            arrivals,
            inputs,
            outputs,
            Timing(true_profile, true_profile, overhead_scale=speedup, **timing),
        )
        duration = max(r.send_time + r.e2e for r in measured)
        points.append(
            {
                "config": "1P2D",
                "prefill": 1,
                "decode": 2,
                "colocated": 0,
                "rate": rate,
                "rate_index": rate_index,
                "summary": summarize(measured, duration, slos),
                "records": [r.to_json() for r in measured],
            }
        )
    return {
        "bench": {"output_len": {"uniform": [16, 48]}, "slos_ms": {"ttft": 1000.0}, "speedup": speedup, "warmup": 0},
        "points": points,
    }


def test_calibration_recovers_the_overhead_of_a_simulated_measurement() -> None:
    from pdserve.capacity.planner import calibrate_overhead

    base = make_profile(prefill=(0.005, 1e-5, 0.0), decode=(0.006, 1e-4, 0.0))
    truth = Overhead(per_pass_s=0.002, per_seq_s=0.0005, per_request_s=0.01)
    sweep = _simulated_sweep(base, truth, (20.0, 120.0), 150)
    fitted = calibrate_overhead(base, sweep).overhead
    assert fitted.per_pass_s == pytest.approx(truth.per_pass_s, abs=5e-4)
    assert fitted.per_seq_s == pytest.approx(truth.per_seq_s, rel=0.2)
    assert fitted.per_request_s == pytest.approx(truth.per_request_s, abs=2e-3)
    assert fitted.jitter_sigma < 0.2  # (nearly) none: the constant overhead already reaches the ITL p99


def _wake_run(over: Overhead, seed: int, batch: int = 1) -> list[float]:
    """Inter-token latencies of the first of `batch` requests decoded together (10 ms steps)."""
    profile = make_profile(decode=(0.01, 0.0, 0.0), overhead=over)
    timing = Timing(profile, profile, overhead_scale=1.0, seed=seed)
    return simulate(Deployment(colocated=1), [0.0] * batch, [16] * batch, [2001] * batch, timing)[0].itl


def test_wake_delay_is_seeded_has_its_mean_and_does_not_grow_with_the_batch() -> None:
    assert _wake_run(Overhead(wake_s=0.003), 1) == pytest.approx([0.013] * 2000)  # wake_sigma 0: constant
    over = Overhead(wake_s=0.003, wake_sigma=1.5)
    first, again, other = _wake_run(over, 1), _wake_run(over, 1), _wake_run(over, 2)
    assert first == again and first != other  # same seed, same timeline
    extra = np.array(first) - 0.01
    assert extra.min() > 0 and float(np.mean(extra)) == pytest.approx(0.003, rel=0.2)
    assert float(np.percentile(extra, 99)) > 5 * 0.003 > 5 * float(np.median(extra))  # a heavy tail
    # the same delay at 8 sequences per pass: same draws, so the same timeline (a factor would scale)
    assert _wake_run(over, 1, batch=8) == pytest.approx(first)
    # beside a per-sequence overhead with its own factor: the delay adds, and the timeline stays seeded
    both = Overhead(per_seq_s=0.001, jitter_sigma=0.8, wake_s=0.003, wake_sigma=1.5)
    eight = np.array(_wake_run(both, 1, batch=8)) - 0.01
    assert float(np.mean(eight)) == pytest.approx(0.003 + 8 * 0.001, rel=0.2)
    assert list(eight) == list(np.array(_wake_run(both, 1, batch=8)) - 0.01)


def test_older_profiles_keep_their_timelines() -> None:
    # the wake delay draws nothing when absent: a jittered profile without it gives the old timeline
    old = _decode_run(1.5, 3)
    profile = make_profile(
        decode=(0.01, 0.0, 0.0), overhead=Overhead(per_pass_s=0.004, jitter_sigma=1.5, wake_sigma=2.0)
    )  # wake_s 0: no delay
    (r,) = simulate(Deployment(colocated=1), [0.0], [16], [2001], Timing(profile, profile, seed=3))
    assert r.itl == old


def test_calibration_recovers_a_wake_delay_of_a_simulated_measurement() -> None:
    from pdserve.capacity.planner import calibrate_overhead

    base = make_profile(prefill=(0.005, 1e-5, 0.0), decode=(0.006, 1e-4, 0.0))
    truth = Overhead(per_pass_s=0.001, per_seq_s=0.0003, per_request_s=0.01, wake_s=0.004, wake_sigma=1.5)
    # another seed than the calibration's replay: the measurement's draws are not the model's
    sweep = _simulated_sweep(base, truth, (20.0, 100.0), 200, seed=7)
    fitted = calibrate_overhead(base, sweep, wake_sigma=1.5).overhead
    assert fitted.wake_sigma == 1.5 and fitted.jitter_sigma == 0.0  # the shapes are held, not fitted
    assert fitted.wake_s == pytest.approx(truth.wake_s, rel=0.3)
    # TPOT fixes the pass terms' total at the measured batch sizes
    assert fitted.per_seq_s == pytest.approx(truth.per_seq_s, rel=0.2)
    assert fitted.per_pass_s + fitted.wake_s == pytest.approx(truth.per_pass_s + truth.wake_s, abs=1e-3)


def test_pass_spread_multiplies_the_pass_models_time_is_seeded_and_keeps_the_mean() -> None:
    # 10 ms decode steps (the pass model) beside a constant 4 ms pass overhead that the spread leaves alone
    def run(spread: float, seed: int) -> np.ndarray:
        return np.array(_wake_run(Overhead(per_pass_s=0.004, pass_sigma=spread), seed)) - 0.004

    assert list(run(0.0, 1)) == pytest.approx([0.01] * 2000)  # 0: the pass model's time, no draw
    first, again, other = run(0.3, 1), run(0.3, 1), run(0.3, 2)
    assert list(first) == list(again) and list(first) != list(other)  # same seed, same timeline
    assert first.min() > 0 and float(np.mean(first)) == pytest.approx(0.01, rel=0.05)  # factor of mean 1
    assert float(np.std(np.log(first))) == pytest.approx(0.3, rel=0.1)  # lognormal with that deviation


def test_calibration_keeps_the_measured_pass_spread() -> None:
    from dataclasses import replace

    from pdserve.capacity.planner import calibrate_overhead

    base = make_profile(prefill=(0.005, 1e-5, 0.0), decode=(0.006, 1e-4, 0.0), overhead=Overhead(pass_sigma=0.2))
    sweep = _simulated_sweep(
        replace(base, overhead=Overhead()), Overhead(per_pass_s=0.002, per_request_s=0.01), (20.0, 120.0), 100
    )
    for wake_sigma in (None, 1.5):
        assert calibrate_overhead(base, sweep, iterations=1, wake_sigma=wake_sigma).overhead.pass_sigma == 0.2
