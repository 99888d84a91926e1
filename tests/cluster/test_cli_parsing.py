"""`pdserve` argument parsing, `local_deployment` validation, worker/router config documents, client helpers."""

from __future__ import annotations

import pytest

from pdserve.cluster.cli import build_parser, deployment_config, format_table
from pdserve.cluster.client import build_request, collect, sampling_params
from pdserve.cluster.deploy_config import ConfigError
from pdserve.cluster.launch import LaunchOptions, local_deployment, ray_deployment
from pdserve.cluster.local import WorkerProcess, local_router_document, local_worker_document, worker_threads
from pdserve.v1 import common_pb2, router_pb2


def _parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_serve_defaults() -> None:
    config = deployment_config(_parse("serve"))
    assert (config.prefill.count, config.decode.count, config.colocated.count) == (1, 1, 0)
    assert (config.router.host, config.router.port, config.mode) == ("127.0.0.1", 50051, "local")
    assert config.router.prefill_policy == config.router.decode_policy == "round_robin"


def test_serve_colocated_only_defaults_pd_to_zero() -> None:
    config = deployment_config(_parse("serve", "--colocated", "2"))
    assert (config.prefill.count, config.decode.count, config.colocated.count) == (0, 0, 2)


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
        "prefix_affinity",
        "--kv-cache-mb",
        "64",
        "--decode-kv-cache-mb",
        "96",
    )
    config = deployment_config(args)
    assert (config.prefill.count, config.decode.count, config.colocated.count, config.model.path) == (2, 3, 1, "m")
    assert (config.prefill.threads, config.colocated.threads, config.prefill.kv_cache_mb, config.router.port) == (
        2,
        2,
        64,
        0,
    )
    assert config.decode.kv_cache_mb == 96  # a pool's own flag wins over the every-pool one
    assert config.router.decode_policy == "prefix_affinity"


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


def test_migrate_takes_a_request_id_and_an_optional_target() -> None:
    args = _parse("migrate", "req-1")
    assert (args.url, args.request_id, args.to, args.json) == ("127.0.0.1:50051", "req-1", "", False)
    args = _parse("migrate", "--url", "h:1", "--to", "decode-1", "--json", "req-2")
    assert (args.url, args.request_id, args.to, args.json) == ("h:1", "req-2", "decode-1", True)
    assert args.func.__name__ == "_cmd_migrate"
    with pytest.raises(SystemExit):
        _parse("migrate")


def test_role_and_migrate_are_both_commands() -> None:
    args = _parse("role", "--url", "h:1", "decode-1", "prefill")
    assert (args.url, args.worker_id, args.role, args.func.__name__) == ("h:1", "decode-1", "prefill", "_cmd_role")
    assert _parse("migrate", "r").func.__name__ == "_cmd_migrate"
    with pytest.raises(SystemExit):
        _parse("role", "decode-1", "sideways")


def test_elastic_flags_are_the_elastic_section() -> None:
    config = deployment_config(
        _parse(
            "serve",
            "--autoscale",
            "--slo",
            "ttft_ms=500,tpot_ms=50",
            "--max-workers",
            "4",
            "--autoscale-interval",
            "0.5",
        )
    )
    assert config.elastic.switchable and not config.elastic.enabled
    options = config.autoscale_options()
    assert (options.slo, options.min_workers, options.max_workers, options.interval_s) == (
        {"ttft_ms": 500.0, "tpot_ms": 50.0},
        2,
        4,
        0.5,
    )
    assert deployment_config(_parse("serve", "--elastic")).autoscale_options() is None
    assert local_deployment(elastic=True).elastic.enabled
    assert not local_deployment().elastic.switchable


def test_elastic_worker_takes_both_documents_or_flags(tmp_path) -> None:  # noqa: ANN001
    import json

    from pdserve.elastic_worker.process import parse_args as elastic_args

    config = local_deployment(model="/m", threads_per_worker=2, elastic=True, local_prefill_threshold=5)
    document = local_worker_document(config, "decode", "decode-0")
    assert set(document) == {"prefill", "decode"}
    path = tmp_path / "decode-0.config.json"
    path.write_text(json.dumps(document))
    role, prefill, decode = elastic_args(["--role", "decode", "--config", str(path), "--max-num-seqs", "3"])
    assert (role, prefill.model, decode.model, prefill.worker_id, decode.worker_id) == (
        "decode",
        "/m",
        "/m",
        "decode-0",
        "decode-0",
    )
    assert (decode.local_prefill_threshold, decode.max_num_seqs, decode.threads, prefill.threads) == (5, 3, 2, 2)
    # standalone flags without --config, as before
    role, prefill, decode = elastic_args(
        [
            "--role",
            "prefill",
            "--model",
            "/x",
            "--prefill-chunk-tokens",
            "64",
            "--max-num-seqs",
            "7",
            "--worker-id",
            "w",
        ]
    )
    assert (role, prefill.model, decode.model, prefill.prefill_chunk_tokens, decode.max_num_seqs) == (
        "prefill",
        "/x",
        "/x",
        64,
        7,
    )
    with pytest.raises(SystemExit):  # one role's document only
        elastic_args(["--role", "decode"], document={"decode": document["decode"]})
    with pytest.raises(SystemExit):  # a key the role's parser does not know
        elastic_args(["--role", "decode"], document={**document, "prefill": {"max_num_seqs": 3}})
    with pytest.raises(SystemExit):  # a flag neither role knows
        elastic_args(["--role", "decode", "--no-such-flag"])


def test_model_fetch_is_kept() -> None:
    args = _parse("model", "fetch", "--force")
    assert args.force and args.func.__name__ == "_cmd_model_fetch"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prefill": -1}, "prefill.count: must be >= 0"),
        ({"decode": -1}, "decode.count: must be >= 0"),
        ({"colocated": -1}, "colocated.count: must be >= 0"),
        ({"prefill": 0, "decode": 1}, "need prefill >= 1 and decode >= 1"),
        ({"prefill": 1, "decode": 0}, "need prefill >= 1 and decode >= 1"),
        ({"prefill": 0, "decode": 0, "colocated": 0}, "need prefill >= 1"),
        ({"port": 70000}, "router.port"),
        ({"threads_per_worker": 0}, "prefill.threads"),
        ({"decode_policy": "random"}, "router.decode_policy"),
        ({"kv_cache_mb": 0}, "prefill.kv_cache_mb"),
        ({"startup_timeout_s": 0}, "startup_timeout_s"),
        ({"max_queued_requests": 0}, "router.max_queued_requests"),
        ({"decode_args": ("--x",)}, "decode_args: unknown setting name"),  # flags go in LaunchOptions
        ({"address": "auto"}, "ray.address .* not supported without --ray"),
        ({"kv_backend": "ray"}, "kv.backend: ray"),
    ],
)
def test_local_deployment_validation(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        local_deployment(**fields)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kv_backend": "shm"}, "kv.backend: shm is not supported with --ray"),
        ({"colocated": 1}, "colocated.count .* not supported with --ray"),
        ({"drain_timeout_s": -1.0}, "prefill.drain_timeout_s: must be > 0"),
        ({"placement": "nowhere"}, "ray.placement: must be one of"),
    ],
)
def test_ray_deployment_validation(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ray_deployment(**fields)


def test_short_names_set_every_pool_of_the_mode() -> None:
    local = local_deployment(threads_per_worker=2, kv_cache_mb=64, colocated=1)
    assert [(p.threads, p.kv_cache_mb) for p in (local.prefill, local.decode, local.colocated)] == [(2, 64)] * 3
    assert local_deployment(kv_cache_mb=None).prefill.kv_cache_mb == local_deployment().prefill.kv_cache_mb
    ray = ray_deployment(threads_per_worker=2, drain_timeout_s=20.0)
    assert (ray.prefill.threads, ray.decode.threads, ray.colocated.threads) == (2, 2, None)
    assert (ray.prefill.drain_timeout_s, ray.decode.drain_timeout_s, ray.mode) == (20.0, 20.0, "ray")


def test_launch_options_give_decode_flags_to_colocated_workers() -> None:
    options = LaunchOptions(prefill_args=("--a",), decode_args=("--b",), router_args=("--c",))
    assert [options.args_for(kind) for kind in ("prefill", "decode", "colocated", "router")] == [
        ("--a",),
        ("--b",),
        ("--b",),
        ("--c",),
    ]


def test_valid_topologies() -> None:
    assert local_deployment(prefill=0, decode=0, colocated=1).num_workers == 1
    assert local_deployment(prefill=2, decode=2).num_workers == 4


def test_threads_default_splits_cpus() -> None:
    assert worker_threads(local_deployment(threads_per_worker=3), "decode") == 3
    assert worker_threads(local_deployment(prefill=50, decode=50), "decode") >= 1


def test_worker_documents_parse_in_the_worker() -> None:
    from pdserve.decode_worker.process import parse_args as decode_args
    from pdserve.prefill_worker.process import parse_args as prefill_args

    config = local_deployment(model="/m", threads_per_worker=2, kv_cache_mb=64, colocated=1)
    assert config.worker_names() == [("prefill", "prefill-0"), ("decode", "decode-0"), ("colocated", "colocated-0")]
    colocated = decode_args([], document=local_worker_document(config, "colocated", "colocated-0"))
    assert (colocated.colocated, colocated.model, colocated.threads, colocated.kv_cache_mb) == (True, "/m", 2, 64)
    assert (colocated.host, colocated.port, colocated.worker_id, colocated.device) == (
        "127.0.0.1",
        0,
        "colocated-0",
        "cpu",
    )
    prefill = prefill_args(["--kv-cache-mb", "8"], document=local_worker_document(config, "prefill", "prefill-0"))
    assert prefill.kv_cache_mb == 8 and prefill.model == "/m"  # flags override the document
    with pytest.raises(SystemExit):  # an unknown key fails on arrival
        prefill_args([], document={"kv_cache_mbb": 8})
    with pytest.raises(SystemExit):  # so does a value of the wrong type
        decode_args([], document={"max_num_seqs": "8"})


def test_router_document() -> None:
    from pdserve.router.process import config_from_args, parse_args

    workers = [
        WorkerProcess("prefill", "prefill-0", "127.0.0.1:1", 1),
        WorkerProcess("decode", "decode-0", "127.0.0.1:2", 2),
    ]
    document = local_router_document(
        local_deployment(port=0, decode_policy="least_loaded", max_queued_requests=7), workers
    )
    router = config_from_args(parse_args([], document=document))
    assert (router.port, router.prefill, router.decode) == (0, ("127.0.0.1:1",), ("127.0.0.1:2",))
    assert (router.prefill_policy, router.decode_policy, router.max_queued_requests) == (
        "round_robin",
        "least_loaded",
        7,
    )


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
    from pdserve.cluster.deploy_config import worker_document
    from pdserve.cluster.ray_cluster import worker_resources

    args = _parse(
        "serve",
        "--ray",
        "--address",
        "auto",
        "--prefill",
        "2",
        "--decode",
        "3",
        "--kv-backend",
        "ray",
        "--gpus-per-worker",
        "1",
        "--placement",
        "spread",
        "--decode-resource",
        "decode_gpu",
    )
    config = deployment_config(args)
    assert (config.prefill.count, config.decode.count, config.kv.backend, config.ray.placement) == (
        2,
        3,
        "ray",
        "spread",
    )
    assert config.ray.address == "auto" and worker_resources(config, "decode") == {"GPU": 1.0, "decode_gpu": 1.0}
    assert worker_resources(config, "prefill") == {"GPU": 1.0}
    assert worker_document(config, "decode", "decode-0")["kv_target"] == "ray:decode-0"
    assert worker_resources(deployment_config(_parse("serve", "--ray")), "prefill") == {"CPU": 1.0}
    assert deployment_config(_parse("serve", "--ray", "--max-queued-requests", "9")).router.max_queued_requests == 9
    for unsupported in (
        ["--colocated", "1"],
        ["--metrics"],
        ["--metrics-host", "0.0.0.0"],
        ["--log-dir", "x"],
        ["--kv-backend", "shm"],
    ):  # refused, never silently ignored
        with pytest.raises(ValueError, match="not supported with --ray"):
            deployment_config(_parse("serve", "--ray", *unsupported))
    for unsupported in (["--placement", "spread"], ["--address", "auto"], ["--router-resource", "x"]):
        with pytest.raises(ValueError, match="not supported without --ray"):
            deployment_config(_parse("serve", *unsupported))
    with pytest.raises(ValueError, match="kv.backend: ray"):
        deployment_config(_parse("serve", "--kv-backend", "ray"))
    scale = _parse("scale", "--prefill", "2", "--decode", "1")
    assert (scale.prefill, scale.decode, scale.address) == (2, 1, "auto")


def test_serve_ray_multinode_flags() -> None:
    from pdserve.cluster.ray_cluster import PLACEMENTS, check_reachable, router_resources

    config = deployment_config(
        _parse("serve", "--ray", "--placement", "strict_spread", "--router-resource", "pdserve_router")
    )
    assert PLACEMENTS[config.ray.placement] == "STRICT_SPREAD"
    assert router_resources(config) == {"CPU": 1.0, "pdserve_router": 1.0}
    assert router_resources(deployment_config(_parse("serve", "--ray"))) == {"CPU": 1.0}
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
    from pdserve.cluster.cli import main

    assert main(["scale", "--prefill", "0", "--decode", "1"]) == 2
