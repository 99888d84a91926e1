"""`pdserve` argument parsing, LocalClusterConfig validation, worker/router command lines, client helpers."""

from __future__ import annotations

import sys

import pytest

from cluster.cli import build_parser, cluster_config, format_table
from cluster.client import build_request, collect, sampling_params
from cluster.local import LocalClusterConfig, WorkerProcess, router_argv, worker_argv
from pdserve.v1 import common_pb2, router_pb2


def _parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_serve_defaults() -> None:
    config = cluster_config(_parse("serve"))
    assert (config.prefill, config.decode, config.colocated) == (1, 1, 0)
    assert (config.host, config.port) == ("127.0.0.1", 50051)
    assert config.prefill_policy == config.decode_policy == "round_robin"


def test_serve_colocated_only_defaults_pd_to_zero() -> None:
    config = cluster_config(_parse("serve", "--colocated", "2"))
    assert (config.prefill, config.decode, config.colocated) == (0, 0, 2)


def test_serve_all_flags() -> None:
    args = _parse(
        "serve",
        "--prefill",
        "2",
        "--decode",
        "3",
        "--colocated",
        "1",
        "--model",
        "m",
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        "--threads-per-worker",
        "2",
        "--prefill-policy",
        "least_loaded",
        "--decode-policy",
        "least_loaded",
        "--kv-cache-mb",
        "64",
    )
    config = cluster_config(args)
    assert (config.prefill, config.decode, config.colocated, config.model) == (2, 3, 1, "m")
    assert (config.threads_per_worker, config.kv_cache_mb, config.port) == (2, 64, 0)
    assert config.decode_policy == "least_loaded"


def test_serve_rejects_unknown_policy() -> None:
    with pytest.raises(SystemExit):
        _parse("serve", "--decode-policy", "random")


def test_generate_flags() -> None:
    args = _parse(
        "generate",
        "--url",
        "h:1",
        "--max-tokens",
        "5",
        "--temperature",
        "0.7",
        "--top-p",
        "0.9",
        "--top-k",
        "40",
        "--seed",
        "7",
        "--stop",
        "a",
        "--stop",
        "bc",
        "--chat",
        "--json",
        "--ignore-eos",
        "--timeout",
        "3",
        "hello there",
    )
    assert (args.url, args.prompt, args.max_tokens, args.stop, args.chat, args.json) == (
        "h:1",
        "hello there",
        5,
        ["a", "bc"],
        True,
        True,
    )
    assert (args.temperature, args.top_p, args.top_k, args.seed, args.ignore_eos, args.timeout) == (
        0.7,
        0.9,
        40,
        7,
        True,
        3.0,
    )


def test_generate_request_id() -> None:
    assert _parse("generate", "--request-id", "job-7/item-3", "hi").request_id == "job-7/item-3"
    assert _parse("generate", "hi").request_id == ""  # the router makes one


def test_generate_and_status_defaults() -> None:
    args = _parse("generate", "hi")
    assert (args.url, args.max_tokens, args.stop, args.chat, args.json) == ("127.0.0.1:50051", None, [], False, False)
    status = _parse("status", "--json")
    assert (status.url, status.json) == ("127.0.0.1:50051", True)


def test_model_fetch_is_kept() -> None:
    args = _parse("model", "fetch", "--force")
    assert args.force and args.func.__name__ == "_cmd_model_fetch"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prefill": -1}, "prefill must be >= 0"),
        ({"decode": -1}, "decode must be >= 0"),
        ({"colocated": -1}, "colocated must be >= 0"),
        ({"prefill": 0, "decode": 1}, "need prefill >= 1 and decode >= 1"),
        ({"prefill": 1, "decode": 0}, "need prefill >= 1 and decode >= 1"),
        ({"prefill": 0, "decode": 0, "colocated": 0}, "need prefill >= 1"),
        ({"port": 70000}, "port"),
        ({"threads_per_worker": 0}, "threads_per_worker"),
        ({"decode_policy": "random"}, "decode_policy"),
        ({"kv_cache_mb": 0}, "kv_cache_mb"),
        ({"startup_timeout_s": 0}, "startup_timeout_s"),
    ],
)
def test_local_cluster_config_validation(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LocalClusterConfig(**fields)


def test_valid_topologies() -> None:
    assert LocalClusterConfig(prefill=0, decode=0, colocated=1).num_workers == 1
    assert LocalClusterConfig(prefill=2, decode=2).num_workers == 4


def test_threads_default_splits_cpus() -> None:
    assert LocalClusterConfig(threads_per_worker=3).threads == 3
    assert LocalClusterConfig(prefill=50, decode=50).threads >= 1


def test_worker_argv() -> None:
    config = LocalClusterConfig(model="/m", threads_per_worker=2, kv_cache_mb=64, colocated=1)
    names = config.worker_names()
    assert names == [("prefill", "prefill-0"), ("decode", "decode-0"), ("colocated", "colocated-0")]
    argv = worker_argv(config, "colocated", "colocated-0")
    assert argv[:3] == [sys.executable, "-m", "decode_worker"]
    assert argv[3:] == [
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--worker-id",
        "colocated-0",
        "--threads",
        "2",
        "--device",
        "cpu",
        "--dtype",
        "auto",
        "--colocated",
        "--model",
        "/m",
        "--kv-cache-mb",
        "64",
    ]
    prefill = worker_argv(LocalClusterConfig(threads_per_worker=1), "prefill", "prefill-0")
    assert prefill[2] == "prefill_worker" and "--model" not in prefill and "--colocated" not in prefill


def test_router_argv() -> None:
    workers = [
        WorkerProcess("prefill", "prefill-0", "127.0.0.1:1", 1),
        WorkerProcess("decode", "decode-0", "127.0.0.1:2", 2),
    ]
    argv = router_argv(LocalClusterConfig(port=0, decode_policy="least_loaded"), workers)
    assert argv[1:] == [
        "-m",
        "router",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--prefill",
        "127.0.0.1:1",
        "--decode",
        "127.0.0.1:2",
        "--prefill-policy",
        "round_robin",
        "--decode-policy",
        "least_loaded",
        "--max-queued-requests",
        "4096",
    ]
    queued = router_argv(LocalClusterConfig(max_queued_requests=7), workers)
    assert queued[queued.index("--max-queued-requests") + 1] == "7"
    with pytest.raises(ValueError, match="max_queued_requests"):
        LocalClusterConfig(max_queued_requests=0)


def test_build_request_forms() -> None:
    params = sampling_params(max_tokens=4, seed=0, stop=["x"])
    assert params.HasField("seed") and not params.HasField("temperature")
    chat = build_request(messages=[("user", "hi")], params=params)
    assert chat.WhichOneof("input") == "messages" and chat.messages.messages[0].role == "user"
    assert build_request(token_ids=[1, 2]).token_ids.ids == [1, 2]
    with pytest.raises(ValueError):
        build_request(prompt="a", token_ids=[1])


def test_collect_assembles_stream() -> None:
    stream = [
        router_pb2.GenerateResponse(request_id="r", text="a", token_ids=[1]),
        router_pb2.GenerateResponse(
            request_id="r",
            text="b",
            token_ids=[2],
            finish_reason=common_pb2.FINISH_REASON_STOP_STRING,
            usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=2),
            timings=common_pb2.Timings(ttft_s=0.5),
        ),
    ]
    result = collect(stream).to_json_dict()
    assert result["text"] == "ab" and result["token_ids"] == [1, 2] and result["finish_reason"] == "stop_string"
    assert result["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 0}
    assert result["timings"]["ttft_s"] == 0.5
    assert set(result) == {"request_id", "text", "token_ids", "finish_reason", "usage", "timings"}
    assert result["request_id"] == "r"


def test_format_table_aligns() -> None:
    table = format_table(("a", "bb"), [["xxx", "1"], ["y", "22"]])
    assert table.splitlines() == ["a    bb", "xxx  1", "y    22"]


def test_serve_ray_flags_and_scale() -> None:
    from cluster.cli import ray_cluster_config

    args = _parse("serve", "--ray", "--address", "auto", "--prefill", "2", "--decode", "3", "--kv-backend", "ray",
                  "--gpus-per-worker", "1", "--placement", "spread", "--decode-resource", "decode_gpu")
    config = ray_cluster_config(args)
    assert (config.prefill, config.decode, config.kv_backend, config.placement) == (2, 3, "ray", "spread")
    assert config.address == "auto" and config.resources("decode") == {"GPU": 1.0, "decode_gpu": 1.0}
    assert config.resources("prefill") == {"GPU": 1.0}
    assert "--kv-target" in config.worker_argv("decode", "decode-0", "127.0.0.1")
    assert ray_cluster_config(_parse("serve", "--ray")).resources("prefill") == {"CPU": 1.0}
    assert ray_cluster_config(_parse("serve", "--ray", "--max-queued-requests", "9")).max_queued_requests == 9
    with pytest.raises(ValueError):
        ray_cluster_config(_parse("serve", "--ray", "--colocated", "1"))
    for unsupported in (["--metrics"], ["--metrics-host", "0.0.0.0"]):  # refused, never silently ignored
        with pytest.raises(ValueError, match="not supported with --ray"):
            ray_cluster_config(_parse("serve", "--ray", *unsupported))
    with pytest.raises(SystemExit):
        _parse("serve", "--ray", "--kv-backend", "shm")
    scale = _parse("scale", "--prefill", "2", "--decode", "1")
    assert (scale.prefill, scale.decode, scale.address) == (2, 1, "auto")


def test_serve_ray_multinode_flags() -> None:
    from cluster.cli import ray_cluster_config
    from cluster.ray_cluster import PLACEMENTS, check_reachable

    config = ray_cluster_config(_parse("serve", "--ray", "--placement", "strict_spread",
                                       "--router-resource", "pdserve_router"))
    assert PLACEMENTS[config.placement] == "STRICT_SPREAD"
    assert config.router_resources() == {"CPU": 1.0, "pdserve_router": 1.0}
    assert ray_cluster_config(_parse("serve", "--ray")).router_resources() == {"CPU": 1.0}
    with pytest.raises(SystemExit):
        _parse("serve", "--ray", "--placement", "strict_pack")
    assert _parse("status", "--address", "auto").address == "auto" and _parse("status").address is None
    for address in (None, "auto", "ray://head:10001"):
        check_reachable(address)  # left to Ray
    with pytest.raises(ConnectionError, match="must be host:port"):
        check_reachable("head")
    with pytest.raises(ConnectionError, match="no Ray cluster at 127.0.0.1:1"):
        check_reachable("127.0.0.1:1", timeout_s=2)


def test_scale_without_deployment_fails_cleanly(capsys) -> None:  # noqa: ANN001
    from cluster.cli import main

    assert main(["scale", "--prefill", "0", "--decode", "1"]) == 2
