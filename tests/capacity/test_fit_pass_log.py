"""`pdserve plan fit`: a profile's pass model fitted to a serving run's pass log."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from sim_profiles import make_profile

from pdserve.capacity.profiler import fit_pass_log, nonnegative_lstsq
from pdserve.cluster.cli import main
from pdserve.engine.pass_log import COLUMNS
from pdserve.engine.sim_profile import Overhead, load_profile

TRUE = (0.08, 0.004, 2e-6, 0.015, 1e-5)  # a, prefill per token, attention, decode per sequence, per context token


def _passes(n: int, seed: int = 0, noise_s: float = 0.0) -> list[dict[str, float]]:
    """Prefill-only, decode-only and mixed passes timed by TRUE (plus noise)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        kind = i % 3
        tokens = int(rng.integers(8, 128)) if kind != 1 else 0
        batch = int(rng.integers(1, 9)) if kind != 0 else 0
        context = batch * int(rng.integers(16, 160))
        attention = tokens * tokens
        seconds = TRUE[0] + TRUE[1] * tokens + TRUE[2] * attention + TRUE[3] * batch + TRUE[4] * context
        rows.append(
            {
                "start_s": float(i),
                "seconds": seconds + float(rng.normal(0, noise_s)),
                "decode_batch": batch,
                "decode_context": context,
                "prefill_tokens": tokens,
                "prefill_attention": attention,
            }
        )
    return rows


def test_fit_recovers_the_pass_model_and_counts_the_constant_once() -> None:
    base = make_profile(
        prefill=(1.0, 1.0, 1.0),
        decode=(1.0, 1.0, 1.0),
        transfer_s=0.003,
        overhead=Overhead(per_pass_s=0.01, per_seq_s=0.001),
    )
    fitted = fit_pass_log(base, _passes(300))
    assert np.allclose(
        [fitted.prefill.a, fitted.prefill.b, fitted.prefill.c, fitted.decode.b, fitted.decode.c],
        TRUE,
        rtol=1e-6,
        atol=1e-12,
    )
    assert fitted.prefill.a == fitted.decode.a
    # a mixed pass of 64 tokens beside 4 sequences of 100 tokens: the constant once
    expected = TRUE[0] + TRUE[1] * 64 + TRUE[2] * 64 * 64 + TRUE[3] * 4 + TRUE[4] * 400
    assert fitted.pass_s([(64, 0)], 4, 400) == pytest.approx(expected)
    # the pass log times the loop's whole pass: no overhead on top; noise-free passes do not spread
    assert replace(fitted.overhead, pass_sigma=0.0) == Overhead() and fitted.overhead.pass_sigma < 1e-9
    assert fitted.transfer == base.transfer and fitted.engine == base.engine  # the rest is the base's
    assert fitted.points["pass_log"]["passes"] == 300
    assert {k: v["passes"] for k, v in fitted.points["pass_log"]["by_kind"].items()} == {
        "prefill only": 100,
        "decode only": 100,
        "mixed": 100,
    }


def test_fit_is_close_under_noise_and_never_negative() -> None:
    fitted = fit_pass_log(make_profile(), _passes(3000, seed=1, noise_s=0.005))
    assert fitted.prefill.a == pytest.approx(TRUE[0], rel=0.05)
    assert fitted.prefill.b == pytest.approx(TRUE[1], rel=0.05)
    assert fitted.decode.b == pytest.approx(TRUE[3], rel=0.05)
    # a term the data pull below zero is dropped (0), and the others refitted
    x = np.array([[1.0, t] for t in range(10)])
    y = 5.0 - 0.1 * np.arange(10)  # falls with t: the slope would be negative
    coef = nonnegative_lstsq(x, y)
    assert coef[1] == 0 and coef[0] == pytest.approx(float(np.mean(y)))


def test_fit_measures_how_far_the_passes_spread_around_it() -> None:
    rows = _passes(3000, seed=2)
    rng = np.random.default_rng(3)
    for r in rows:  # each pass's time times a lognormal factor of log-space deviation 0.2
        r["seconds"] *= float(rng.lognormal(0.0, 0.2))
    fitted = fit_pass_log(make_profile(), rows)
    assert fitted.overhead.pass_sigma == pytest.approx(0.2, rel=0.1)
    assert fitted.points["pass_log"]["pass_sigma"] == fitted.overhead.pass_sigma


def test_fit_refuses_too_little_or_one_sided_data() -> None:
    with pytest.raises(ValueError, match="at least 20 passes"):
        fit_pass_log(make_profile(), _passes(10))
    decode_only = [r for r in _passes(90) if not r["prefill_tokens"]]
    with pytest.raises(ValueError, match="passes with prompt tokens and passes with decoding"):
        fit_pass_log(make_profile(), decode_only)


def test_plan_fit_command(tmp_path, capsys) -> None:  # noqa: ANN001
    base = tmp_path / "base.json"
    make_profile(transfer_s=0.003).save(base)
    logs = tmp_path / "log"
    logs.mkdir()
    rows = _passes(60)
    for part in range(2):  # two workers' files
        lines = [",".join(COLUMNS)] + [",".join(str(r[c]) for c in COLUMNS) for r in rows[part::2]]
        (logs / f"passes-{part}-0.csv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "fitted.json"
    assert main(["plan", "fit", "--pass-log", str(logs), "--profile", str(base), "--output", str(out)]) == 0
    fitted = load_profile(out)
    assert fitted.decode.b == pytest.approx(TRUE[3])
    assert json.loads(out.read_text())["points"]["pass_log"]["passes"] == 60
    printed = capsys.readouterr().out
    assert "fitted 60 passes from 2 file(s)" in printed and "mixed: 20 passes" in printed
    assert (
        main(["plan", "fit", "--pass-log", str(tmp_path / "nothing"), "--profile", str(base), "--output", str(out)])
        == 2
    )
    assert "no pass-log file there" in capsys.readouterr().err
