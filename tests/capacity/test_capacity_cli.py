"""Parsing of `pdserve bench`, `pdserve sweep` and `pdserve plan ...`, and the sweep's configuration list."""

from __future__ import annotations

import math

import pytest

from pdserve.capacity.cli import bench_config
from pdserve.capacity.sweep import best_config, sweep_configs, threads_per_worker
from pdserve.cluster.cli import build_parser


def test_bench_arguments() -> None:
    args = build_parser().parse_args(
        [
            "bench",
            "--url",
            "h:1",
            "--rate",
            "2.5",
            "--burstiness",
            "0.5",
            "--max-concurrency",
            "4",
            "--num-prompts",
            "10",
            "--warmup",
            "2",
            "--seed",
            "3",
            "--input-len",
            "64:512",
            "--output-len",
            "16",
            "--ignore-eos",
            "--slo",
            "ttft_ms=500",
            "--slo",
            "tpot_ms=50",
            "--output",
            "r.json",
        ]
    )
    config = bench_config(args, args.url)
    assert config.rate == 2.5 and config.burstiness == 0.5 and config.max_concurrency == 4
    assert config.input_len.low == 64 and config.input_len.high == 512 and config.output_len.values == (16,)
    assert config.ignore_eos and config.slos == {"ttft": pytest.approx(0.5), "tpot": pytest.approx(0.05)}
    assert args.output == "r.json"
    assert build_parser().parse_args(["bench"]).rate == math.inf
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--rate", "0"])


def test_sweep_and_plan_arguments() -> None:
    args = build_parser().parse_args(["sweep", "--workers", "3", "--rates", "0.5,1,inf", "--output-dir", "d"])
    assert args.workers == 3 and args.rates == [0.5, 1.0, math.inf] and args.output_dir == "d"
    prof = build_parser().parse_args(["plan", "profile", "--output", "p.json", "--threads", "2"])
    assert prof.output == "p.json" and prof.threads == 2
    sim = build_parser().parse_args(
        [
            "plan",
            "simulate",
            "--profile",
            "p.json",
            "--rate",
            "3",
            "--slo",
            "ttft_ms=900",
            "--max-workers",
            "8",
            "--profile-decode",
            "d.json",
        ]
    )
    assert sim.rate == 3.0 and sim.max_workers == 8 and sim.profile_decode == "d.json" and sim.target == 0.9
    val = build_parser().parse_args(["plan", "validate", "--profile", "p.json", "--sweep", "r.json"])
    assert val.sweep == "r.json"
    cal = build_parser().parse_args(["plan", "calibrate", "--profile", "p.json", "--sweep", "r.json", "--output", "o"])
    assert cal.wake_sigma is None and cal.jitter_sigma == 0.0  # default: the factor model, as before
    cal = build_parser().parse_args(
        [
            "plan",
            "calibrate",
            "--profile",
            "p.json",
            "--sweep",
            "r.json",
            "--output",
            "o",
            "--wake-sigma",
            "2.2",
            "--jitter-sigma",
            "0.86",
        ]
    )
    assert cal.wake_sigma == 2.2 and cal.jitter_sigma == 0.86
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "simulate", "--rate", "1"])  # --profile missing


def test_sweep_configs() -> None:
    assert [c.name for c in sweep_configs(2)] == ["1P1D", "colocated x2"]
    assert [(c.prefill, c.decode) for c in sweep_configs(3)[:2]] == [(1, 2), (2, 1)]
    assert threads_per_worker(2, cores=2) == 1 and threads_per_worker(4, cores=2) == 1
    assert threads_per_worker(2, cores=16) == 8
    points = [{"config": "a", "summary": {"goodput": 1.0}}, {"config": "b", "summary": {"goodput": 1.5}}]
    assert best_config(points) == "b"


def test_engine_flags_reach_every_worker_and_the_bench(tmp_path) -> None:  # noqa: ANN001
    from pdserve.capacity.bench import to_profile_time
    from pdserve.capacity.metrics import RequestRecord
    from pdserve.capacity.sweep import select_configs
    from pdserve.cluster.cli import deployment_config
    from pdserve.cluster.deploy_config import worker_document

    profile = tmp_path / "p.json"
    profile.write_text("{}")
    args_list = ["--engine", "sim", "--profile", str(profile), "--speedup", "4", "--prefill", "2", "--decode", "3"]
    args = build_parser().parse_args(["serve", *args_list])
    engine = {"engine": "sim", "profile": str(profile.resolve()), "speedup": 4.0}
    local = deployment_config(args)
    ray = deployment_config(build_parser().parse_args(["serve", "--ray", *args_list]))
    for config in (local, ray):
        for role, worker_id in config.worker_names():
            document = worker_document(config, role, worker_id)
            assert {k: document[k] for k in engine} == engine
    for bad in (
        ["--profile", str(profile)],
        ["--engine", "sim"],
        ["--engine", "sim", "--profile", "missing.json"],
        ["--engine", "sim", "--profile", str(profile), "--speedup", "0"],
    ):
        with pytest.raises(ValueError):
            deployment_config(build_parser().parse_args(["serve", *bad]))
    bench = bench_config(build_parser().parse_args(["bench", "--speedup", "4", "--rate", "2"]), "h:1")
    assert bench.speedup == 4.0 and bench.to_json()["speedup"] == 4.0
    from pdserve.cluster.cli import main

    # bench is a client: --speedup alone is fine (the cluster's); a named profile must exist
    assert main(["bench", "--url", "127.0.0.1:1", "--speedup", "4", "--profile", "missing.json"]) == 2
    wall = RequestRecord(0, 1.0, 10, 3, ttft=0.5, itl=[0.1, 0.2], e2e=0.8)
    scaled = to_profile_time(wall, 4.0)
    assert (scaled.send_time, scaled.ttft, scaled.itl, scaled.e2e) == (4.0, 2.0, [0.4, 0.8], 3.2)
    assert [c.name for c in select_configs(6, "1P5D,colocated x6")] == ["1P5D", "colocated x6"]
    with pytest.raises(ValueError, match="unknown"):
        select_configs(6, "2P2D")


def test_read_sweep_takes_json_or_gzip(tmp_path) -> None:  # noqa: ANN001
    import gzip
    import json

    from pdserve.capacity.cli import read_sweep

    doc = {"bench": {"speedup": 0.05}, "points": [{"config": "1P1D", "records": []}]}
    (tmp_path / "r.json").write_text(json.dumps(doc))
    with gzip.open(tmp_path / "r.json.gz", "wt") as f:
        json.dump(doc, f)
    assert read_sweep(str(tmp_path / "r.json")) == doc == read_sweep(str(tmp_path / "r.json.gz"))


def test_plan_profile_measures_the_grids_it_is_given(tiny_model) -> None:  # noqa: ANN001
    """`--prefill-tokens/--decode-batches/--decode-contexts` set the points measured (a workload's own
    range); a grid too small to fit is refused before anything is measured."""
    from pdserve.capacity.profiler import _profile_compute, check_grid

    args = build_parser().parse_args(
        ["plan", "profile", "--prefill-tokens", "16,32,64", "--decode-batches", "1,2", "--decode-contexts", "32,64"]
    )
    assert (args.prefill_tokens, args.decode_batches, args.decode_contexts) == ([16, 32, 64], [1, 2], [32, 64])
    assert build_parser().parse_args(["plan", "profile"]).decode_batches is None  # the defaults
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "profile", "--decode-batches", "1,x"])
    prefill, decode = _profile_compute(tiny_model, 1, (16, 32, 64), (1, 2), (32, 64))
    assert [p["tokens"] for p in prefill] == [16, 32, 64]
    assert [(p["batch"], p["context"]) for p in decode] == [(1, 32), (1, 64), (2, 32), (2, 64)]
    assert all(p["latency_s"] > 0 for p in prefill + decode)
    assert check_grid("decode batches", [4, 1, 4, 2], 1, 2) == (1, 2, 4)
    with pytest.raises(ValueError, match="decode batches: need at least 2 distinct values"):
        check_grid("decode batches", [4, 4], 1, 2)
    with pytest.raises(ValueError, match=">= 2"):
        check_grid("decode contexts", [1, 8], 2, 1)


def test_comma_lists_name_the_bad_element(capsys) -> None:  # noqa: ANN001
    """--rates and the profile grids share one comma-list parser; a bad element is a clear usage error."""
    for argv, said in (
        (
            ["sweep", "--workers", "2", "--rates", "0.5,-1", "--output-dir", "d"],
            "expected comma-separated rates (each > 0, or inf), got '0.5,-1' (rate must be > 0",
        ),
        (["plan", "profile", "--prefill-tokens", "16,x"], "expected comma-separated integers, got '16,x'"),
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        assert said in capsys.readouterr().err
    assert build_parser().parse_args(["plan", "profile", "--prefill-tokens", " 16, 32 ,"]).prefill_tokens == [16, 32]
