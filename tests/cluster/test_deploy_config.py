"""DeploymentConfig: every setting is reachable from `pdserve serve` (flag and config file) and reaches
the process that uses it, in local and Ray mode; bad files fail naming the key; the examples load."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.cluster.cli import build_parser, deployment_config, main
from pdserve.cluster.deploy_config import (
    ConfigError,
    DeploymentConfig,
    _field_of,
    field_names,
    flag_of,
    load_file,
    router_document,
)
from pdserve.cluster.local import (
    ClusterStartError,
    LocalCluster,
    WorkerProcess,
    local_router_document,
    local_worker_document,
    worker_threads,
)
from pdserve.constants import METRICS_ANY_PORT
from pdserve.decode_worker.process import parse_args as decode_parse
from pdserve.elastic_worker.process import parse_args as elastic_parse
from pdserve.prefill_worker.process import parse_args as prefill_parse
from pdserve.router.process import config_from_args
from pdserve.router.process import parse_args as router_parse

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
PARSERS: dict[str, Callable[..., argparse.Namespace]] = {
    "prefill": prefill_parse,
    "decode": decode_parse,
    "colocated": decode_parse,
    "router": router_parse,
}

Received = list[tuple[str, argparse.Namespace]]  # (process kind, the options it parsed from its document)
ELASTIC = "elastic"  # kind of an elastic worker's entry (its decode-side options; the role's own entry as well)


def received(config: DeploymentConfig) -> Received:
    """What every process of `config` gets, parsed by that process's own parser (as on arrival)."""
    out: Received = []
    workers: dict[str, list[str]] = {}
    for i, (role, worker_id) in enumerate(config.worker_names()):
        if config.mode == "local":
            document = local_worker_document(config, role, worker_id)
        else:  # what a worker actor gets (cluster.ray_cluster.ray_worker_document)
            from pdserve.cluster.ray_cluster import worker_actor_document

            document = worker_actor_document(config, role, worker_id, config.ray.worker_host)
        if config.elastic.switchable:  # `python -m pdserve.elastic_worker --role ROLE` (an elastic actor too)
            started, prefill_ns, decode_ns = elastic_parse(["--role", role], json.loads(json.dumps(document)))
            assert started == role
            out.append((role, prefill_ns if role == "prefill" else decode_ns))
            out.append((ELASTIC, decode_ns))
        else:
            out.append((role, PARSERS[role]([], document=json.loads(json.dumps(document)))))
        workers.setdefault(role, []).append(f"127.0.0.1:{20000 + i}")
    if config.mode == "local":
        processes = [WorkerProcess(r, f"{r}-{i}", a, 0) for r, addrs in workers.items() for i, a in enumerate(addrs)]
        document = local_router_document(config, processes)
    else:
        document = router_document(config, workers)
    out.append(("router", router_parse([], document=json.loads(json.dumps(document)))))
    return out


def _all(kinds: tuple[str, ...], attr: str, value: Any) -> Callable[[DeploymentConfig, Received], bool]:  # noqa: ANN401
    """Every process of these kinds got `attr` == `value` (and at least one such process exists)."""

    def check(_config: DeploymentConfig, got: Received) -> bool:
        values = [getattr(ns, attr) for kind, ns in got if kind in kinds]
        return bool(values) and all(v == value for v in values)

    return check


WORKERS = ("prefill", "decode", "colocated")
DECODERS = ("decode", "colocated")


def _ray(check: Callable[[DeploymentConfig], bool]) -> Callable[[DeploymentConfig, Received], bool]:
    return lambda config, _got: check(config)


def _ray_options() -> dict[str, Any]:
    from pdserve.cluster import ray_cluster

    return {
        "worker": ray_cluster.worker_actor_options,
        "router": ray_cluster.router_actor_options,
        "resources": ray_cluster.worker_resources,
        "PLACEMENTS": ray_cluster.PLACEMENTS,
    }


# dotted name -> (a value other than the default, companions it needs, the check that it arrived)
# Companions: settings another one needs to be valid (a colocated pool to carry colocated.* values,
# engine sim for a profile, a token for metrics beyond loopback).
SIM = {"model.engine": "sim"}
CASES: dict[str, tuple[Any, dict[str, Any], Callable[[DeploymentConfig, Received], bool]]] = {  # noqa: ANN401
    "mode": (
        "ray",
        {},
        lambda c, got: all(ns.kv_backend == "grpc" for k, ns in got if k == "decode") and c.mode == "ray",
    ),
    # startup_timeout_s and observability.log_dir are the local launcher's own: see test_local_launcher_*
    "startup_timeout_s": (42.0, {}, lambda c, _got: c.startup_timeout_s == 42.0),
    "model.path": ("/models/m", {}, _all(WORKERS, "model", "/models/m")),
    "model.name": ("my-model", {}, _all(("router",), "model_name", "my-model")),
    "model.device": ("cpu", {}, _all(WORKERS, "device", "cpu")),
    "model.dtype": ("bfloat16", {}, _all(WORKERS, "dtype", "bfloat16")),
    "model.block_size": (32, {}, _all(WORKERS, "block_size", 32)),
    "model.compile": (True, {}, _all(WORKERS, "compile", True)),
    "model.deterministic": (True, {}, _all(WORKERS, "deterministic", True)),
    "model.kernel_table": ('{"version": 1}', {}, _all(WORKERS, "kernel_table", '{"version": 1}')),
    "model.engine": ("sim", {"model.profile": "PROFILE"}, _all(WORKERS, "engine", "sim")),
    "model.profile": (
        "PROFILE",
        SIM,
        lambda c, got: all(Path(ns.profile).name == "profile.json" for k, ns in got if k != "router"),
    ),
    "model.speedup": (3.0, {**SIM, "model.profile": "PROFILE"}, _all(WORKERS, "speedup", 3.0)),
    "router.host": ("0.0.0.0", {}, _all(("router",), "host", "0.0.0.0")),
    "router.port": (4321, {}, _all(("router",), "port", 4321)),
    "router.prefill_policy": ("prefix_affinity", {}, _all(("router",), "prefill_policy", "prefix_affinity")),
    "router.decode_policy": ("least_loaded", {}, _all(("router",), "decode_policy", "least_loaded")),
    "router.max_queued_requests": (17, {}, _all(("router",), "max_queued_requests", 17)),
    "router.max_concurrent_streams": (19, {}, _all(("router",), "max_concurrent_streams", 19)),
    "router.max_stream_timeout_s": (99.0, {}, _all(("router",), "max_stream_timeout", 99.0)),
    "router.max_attempts": (5, {}, _all(("router",), "max_attempts", 5)),
    "router.drain_timeout_s": (1.5, {}, _all(("router",), "router_drain_timeout", 1.5)),
    "router.http_port": (8123, {}, _all(("router",), "http_port", 8123)),
    "router.decode_mux": (True, {}, _all(("router",), "decode_mux", True)),
    "router.kv_aware_request_tokens": (64.0, {}, _all(("router",), "kv_aware_request_tokens", 64.0)),
    "router.kv_aware_kv_tokens": (32.0, {}, _all(("router",), "kv_aware_kv_tokens", 32.0)),
    "router.conditional_disagg_tokens": (200, {}, _all(("router",), "conditional_disagg_tokens", 200)),
    "router.slo_ttft_s": (2.5, {}, _all(("router",), "slo_ttft", 2.5)),
    "router.grpc_calls_per_peer": (33, {}, _all(("router",), "grpc_calls_per_peer", 33)),
    "router.grpc_calls_total": (44, {}, _all(("router",), "grpc_calls_total", 44)),
    "router.grpc_connection_idle_s": (7.5, {}, _all(("router",), "grpc_connection_idle", 7.5)),
    "router.grpc_connection_age_s": (900.0, {}, _all(("router",), "grpc_connection_age", 900.0)),
    "prefill.count": (
        2,
        {},
        lambda c, got: sum(k == "prefill" for k, _ in got) == 2 and len(router_of(got).prefill) == 2,
    ),
    "decode.count": (3, {}, lambda c, got: sum(k == "decode" for k, _ in got) == 3 and len(router_of(got).decode) == 3),
    "colocated.count": (
        2,
        {},
        lambda c, got: (
            sum(k == "colocated" and ns.colocated for k, ns in got) == 2 and len(router_of(got).colocated) == 2
        ),
    ),
    "prefill.chunk_tokens": (64, {}, _all(("prefill",), "prefill_chunk_tokens", 64)),
    "decode.chunk_tokens": (96, {}, _all(("decode",), "prefill_chunk_tokens", 96)),
    "colocated.chunk_tokens": (80, {"colocated.count": 1}, _all(("colocated",), "prefill_chunk_tokens", 80)),
    "decode.local_prefill_threshold": (12, {}, _all(("decode",), "local_prefill_threshold", 12)),
    "kv.backend": ("grpc", {}, _all(DECODERS, "kv_backend", "grpc")),
    "kv.streaming": ("layer", {}, _all(("prefill",), "kv_streaming", "layer")),
    "kv.checksum": ("crc32", {}, _all(DECODERS, "kv_checksum", "crc32")),
    "kv.shared_cache": (False, {}, _all(("prefill",), "shared_kv_cache", False)),
    "ray.address": ("auto", {}, lambda c, _got: c.ray.address == "auto"),  # RayCluster: ray.init(address=...)
    "ray.placement": (
        "strict_spread",
        {},
        _ray(lambda c: _ray_options()["PLACEMENTS"][c.ray.placement] == "STRICT_SPREAD"),
    ),
    "ray.worker_host": ("10.1.2.3", {}, _all(("prefill", "decode"), "host", "10.1.2.3")),
    "ray.gpus_per_worker": (0.5, {}, _ray(lambda c: _ray_options()["worker"](c, "decode", "d")["num_gpus"] == 0.5)),
    "ray.prefill_resource": ("pgpu", {}, _ray(lambda c: _ray_options()["resources"](c, "prefill").get("pgpu") == 1)),
    "ray.decode_resource": ("dgpu", {}, _ray(lambda c: _ray_options()["resources"](c, "decode").get("dgpu") == 1)),
    "ray.router_resource": ("head", {}, _ray(lambda c: _ray_options()["router"](c)["resources"] == {"head": 1.0})),
    "ray.max_restarts": (7, {}, _ray(lambda c: _ray_options()["worker"](c, "prefill", "p")["max_restarts"] == 7)),
    "ray.restart_wait_s": (15.0, {}, _all(("router",), "worker_restart_wait", 15.0)),
    "ray.router_max_restarts": (6, {}, _ray(lambda c: _ray_options()["router"](c)["max_restarts"] == 6)),
    "ray.poll_interval_s": (0.25, {}, lambda c, _got: c.ray.poll_interval_s == 0.25),  # the controller's watcher
    "security.auth_token_file": (
        "TOKEN",
        {},
        lambda c, got: (
            Path(router_of(got).auth_token_file).name == "token.txt"
            if c.mode == "local"
            else router_of(got).auth_token_file is None
        ),
    ),  # Ray: the driver reads it, the actor gets the token
    "security.tls_cert": (
        "CERT",
        {"security.tls_key": "KEY"},
        lambda c, got: router_of(got).tls_cert.endswith("c.pem"),
    ),
    "security.tls_key": ("KEY", {"security.tls_cert": "CERT"}, lambda c, got: router_of(got).tls_key.endswith("k.pem")),
    "security.internal_token_file": (
        "TOKEN",
        {},
        lambda c, got: all(
            (Path(ns.internal_token_file).name == "token.txt") if c.mode == "local" else ns.internal_token_file is None
            for _k, ns in got
        ),
    ),
    "security.auth_tokens_file": (
        "TOKENS",
        {},
        lambda c, got: (
            Path(router_of(got).auth_tokens_file).name == "tokens.txt"
            if c.mode == "local"
            else router_of(got).auth_tokens_file is None
        ),
    ),  # Ray: the driver reads it, the actor gets the tokens
    "security.internal_grpc_calls_per_peer": (55, {}, _all(WORKERS, "grpc_calls_per_peer", 55)),
    "security.internal_grpc_calls_total": (66, {}, _all(WORKERS, "grpc_calls_total", 66)),
    "observability.log_level": ("DEBUG", {}, lambda c, got: all(ns.log_level == "DEBUG" for _k, ns in got)),
    "observability.log_format": ("json", {}, lambda c, got: all(ns.log_format == "json" for _k, ns in got)),
    "observability.log_dir": ("LOGDIR", {}, lambda c, _got: c.observability.log_dir is not None),
    # each process binds a free port itself and announces it (none picked by the launcher beforehand)
    "observability.metrics": (True, {}, lambda c, got: all(ns.metrics_port == METRICS_ANY_PORT for _k, ns in got)),
    "observability.metrics_host": (
        "0.0.0.0",
        {"security.auth_token_file": "TOKEN"},
        _all(("router",), "metrics_host", "0.0.0.0"),
    ),
}


def _elastic_workers(c: DeploymentConfig, got: Received) -> bool:
    """Every worker runs as an elastic worker (and parsed its role's document)."""
    workers = [k for k, _ns in got if k in WORKERS]
    return bool(workers) and sum(k == ELASTIC for k, _ns in got) == len(workers) == c.num_workers


def _autoscaler(**expected: Any) -> Callable[[DeploymentConfig, Received], bool]:  # noqa: ANN401
    """Elastic workers, and the autoscaler (`serve` starts it with these options) has `expected`."""

    def check(c: DeploymentConfig, got: Received) -> bool:
        options = c.autoscale_options()
        return (
            _elastic_workers(c, got)
            and options is not None
            and all(getattr(options, k) == v for k, v in expected.items())
        )

    return check


AUTOSCALE = {"elastic.autoscale": True, "elastic.slo": "ttft_ms=500"}
CASES.update(
    {
        "elastic.enabled": (True, {}, _elastic_workers),
        "elastic.autoscale": (
            True,
            {"elastic.slo": "ttft_ms=500,tpot_ms=50"},
            _autoscaler(slo={"ttft_ms": 500.0, "tpot_ms": 50.0}),
        ),
        "elastic.slo": ("tpot_ms=40", {"elastic.autoscale": True}, _autoscaler(slo={"tpot_ms": 40.0})),
        "elastic.min_workers": (3, {**AUTOSCALE, "decode.count": 2}, _autoscaler(min_workers=3)),  # --ray: 3 start
        "elastic.max_workers": (5, AUTOSCALE, _autoscaler(max_workers=5)),
        "elastic.interval_s": (0.5, AUTOSCALE, _autoscaler(interval_s=0.5)),
    }
)
POOL_CASES: dict[str, tuple[Any, str]] = {  # pool setting -> (value, the worker option it becomes)  # noqa: ANN401
    "threads": (3, "threads"),
    "kv_cache_mb": (77, "kv_cache_mb"),
    "max_batched_tokens": (999, "max_batched_tokens"),
    "prefix_caching": (False, "prefix_caching"),
    "request_timeout_s": (11.0, "request_timeout_s"),
    "kv_timeout_s": (13.0, "kv_timeout_s"),
    "drain_timeout_s": (9.0, "drain_timeout_s"),
    "max_num_seqs": (5, "max_num_seqs"),
    "admission_timeout_s": (4.0, "admission_timeout_s"),
}
for _pool in WORKERS:
    for _name, (_value, _attr) in POOL_CASES.items():
        if f"{_pool}.{_name}" in field_names() and f"{_pool}.{_name}" not in CASES:
            CASES[f"{_pool}.{_name}"] = (_value, {}, _all((_pool,), _attr, _value))


def router_of(got: Received) -> argparse.Namespace:
    return next(ns for kind, ns in got if kind == "router")


def _files(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "token.txt").write_text("secret\n")
    (tmp_path / "tokens.txt").write_text("alice secret-a\nbob secret-b\n")
    (tmp_path / "profile.json").write_text("{}")
    (tmp_path / "c.pem").write_text("")
    (tmp_path / "k.pem").write_text("")
    return {
        "TOKEN": str(tmp_path / "token.txt"),
        "TOKENS": str(tmp_path / "tokens.txt"),
        "PROFILE": str(tmp_path / "profile.json"),
        "CERT": str(tmp_path / "c.pem"),
        "KEY": str(tmp_path / "k.pem"),
        "LOGDIR": str(tmp_path / "logs"),
    }


def _flag_argv(dotted: str, value: Any) -> list[str]:  # noqa: ANN401
    if dotted == "mode":
        return ["--ray"] if value == "ray" else []
    if isinstance(value, bool):
        flag = flag_of(dotted)
        return [flag] if value else ["--no-" + flag[2:]]
    return [flag_of(dotted), str(value)]


def _modes(dotted: str) -> tuple[str, ...]:
    if dotted == "mode":
        return ("ray",)
    return ("local",) if dotted.startswith("colocated.") else _field_of(dotted).metadata["modes"]


def _value(config: DeploymentConfig, dotted: str) -> Any:  # noqa: ANN401
    section, _, name = dotted.rpartition(".")
    return getattr(getattr(config, section) if section else config, name)


def test_every_setting_has_a_case() -> None:
    assert sorted(CASES) == sorted(field_names())


@pytest.mark.parametrize("dotted", field_names())
def test_every_setting_reaches_its_process(dotted: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Set one setting to a non-default value by its flag and by a config file, in each mode that
    honours it; the process that uses it receives it (parsed by that process's own parser)."""
    monkeypatch.delenv("PDSERVE_AUTH_TOKEN", raising=False)
    paths = _files(tmp_path)
    value, companions, check = CASES[dotted]
    value = paths.get(value, value) if isinstance(value, str) else value
    companions = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in companions.items()}
    assert value != _field_of(dotted).default
    for mode in _modes(dotted):
        settings = {dotted: value, **companions}
        if dotted.startswith("colocated.") and dotted != "colocated.count":
            settings["colocated.count"] = 1
        base = ["--ray"] if mode == "ray" else []
        argv = base + [a for key, v in settings.items() for a in _flag_argv(key, v)]
        from_flags = deployment_config(build_parser().parse_args(["serve", *argv]))
        nested: dict[str, Any] = {"mode": mode}
        for key, v in settings.items():
            section, _, name = key.rpartition(".")
            (nested.setdefault(section, {}) if section else nested)[name] = v
        config_file = tmp_path / "deploy.yaml"
        config_file.write_text(yaml.safe_dump(nested))
        from_file = deployment_config(build_parser().parse_args(["serve", "--config", str(config_file)]))
        assert from_flags == from_file, dotted
        assert _value(from_flags, dotted) == value
        got = received(from_flags)
        assert check(from_flags, got), f"{dotted}={value!r} did not reach its process in mode {mode}"


def test_unknown_keys_and_bad_values_fail_naming_the_key(tmp_path: Path) -> None:
    cases = {
        "decode:\n  max_num_sqs: 3\n": "decode.max_num_sqs: unknown key",
        "routr:\n  port: 1\n": "routr: unknown key",
        "router:\n  port: 70000\n": "router.port: must be <= 65535",
        "router:\n  prefill_policy: random\n": "router.prefill_policy: must be one of",
        "prefill:\n  prefix_caching: maybe\n": "prefill.prefix_caching: expected bool",
        "kv: grpc\n": "kv: expected a mapping",
        "mode: ray\ncolocated:\n  count: 1\n": "colocated.count .* not supported with --ray",
        "mode: ray\ncolocated:\n  max_num_seqs: 8\n": "colocated.max_num_seqs .* not supported with --ray",
        "ray:\n  placement: spread\n": "ray.placement .* not supported without --ray",
        "mode: ray\nobservability:\n  metrics: true\n": "observability.metrics .* not supported with --ray",
        "kv:\n  backend: ray\n": "kv.backend: ray .* needs --ray",
        "mode: ray\nelastic:\n  autoscale: true\n  slo: ttft_ms=5\n  min_workers: 3\n": (
            "elastic.min_workers/max_workers: the deployment starts with 2 workers, outside 3..8"
        ),
        "elastic:\n  slo: ttft_ms=5\n": "elastic.slo .* needs elastic.autoscale",
        "elastic:\n  autoscale: true\n": "elastic.autoscale .* needs elastic.slo",
        "elastic:\n  autoscale: true\n  slo: ttft=5\n": "elastic: --slo items look like",
        "elastic:\n  autoscale: true\n  slo: ttft_ms=5\n  min_workers: 9\n": "elastic: need 2 <= --min-workers",
    }
    for text, message in cases.items():
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            deployment_config(build_parser().parse_args(["serve", "--config", str(path)]))
    toml = tmp_path / "bad.toml"
    toml.write_text('[decode]\nmax_num_seqs = "8"\n')
    with pytest.raises(ConfigError, match="decode.max_num_seqs: expected int"):
        DeploymentConfig.from_dict(load_file(toml))


def test_flags_override_the_file_and_print_config_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "deploy.toml"
    path.write_text('[router]\nport = 1234\nprefill_policy = "prefix_affinity"\n[decode]\ncount = 3\n')
    assert main(["serve", "--config", str(path), "--decode", "2", "--kv-streaming", "layer", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert (printed["router"]["port"], printed["router"]["prefill_policy"]) == (1234, "prefix_affinity")
    assert (printed["decode"]["count"], printed["kv"]["streaming"]) == (2, "layer")
    again = tmp_path / "printed.yaml"
    again.write_text(yaml.safe_dump(printed))
    assert DeploymentConfig.from_dict(load_file(again)) == DeploymentConfig.from_dict(printed)
    assert main(["serve", "--config", str(path), "--ray", "--colocated", "1", "--print-config"]) == 2
    assert "colocated.count (--colocated) is not supported with --ray" in capsys.readouterr().err


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_load(example: Path) -> None:
    config = deployment_config(build_parser().parse_args(["serve", "--config", str(example)]))
    received(config)  # every process takes its document
    assert {p.name for p in EXAMPLES} >= {"1p1d.yaml", "2p2d-prefix-layer.yaml", "ray-multinode.yaml"}
    if example.name == "2p2d-prefix-layer.yaml":
        assert config.router.prefill_policy == config.router.decode_policy == "prefix_affinity"
        assert (config.kv.streaming, config.prefill.count, config.decode.count) == ("layer", 2, 2)
    if example.name == "ray-multinode.yaml":
        assert config.mode == "ray" and config.ray.placement == "spread"


def test_worker_threads_split_cpus_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    config = DeploymentConfig.from_dict({"prefill": {"threads": 3}})
    assert worker_threads(config, "prefill") == 3 and worker_threads(config, "decode") >= 1
    monkeypatch.setattr("pdserve.cluster.local._cpu_count", lambda: 8)
    config = DeploymentConfig.from_dict({"prefill": {"count": 2}, "decode": {"count": 1}, "colocated": {"count": 1}})
    # each phase splits the CPUs among its own workers: prefill 8 / 2, decode + colocated 8 / 2
    assert [worker_threads(config, role) for role in ("prefill", "decode", "colocated")] == [4, 4, 4]
    one_pair = DeploymentConfig.from_dict({"prefill": {"count": 1}, "decode": {"count": 1}})
    assert worker_threads(one_pair, "prefill") == worker_threads(one_pair, "decode") == 8


def test_local_launcher_writes_each_process_document_to_its_log_dir(tmp_path: Path) -> None:
    """The local launcher's own settings: log_dir holds each process's document (what it was given),
    and startup_timeout_s bounds the start (a worker that cannot start in time fails the launch)."""
    config = DeploymentConfig.from_dict(
        {"startup_timeout_s": 0.5, "decode": {"max_num_seqs": 3}, "observability": {"log_dir": str(tmp_path / "logs")}}
    )
    with pytest.raises(ClusterStartError):
        LocalCluster(config)
    document = json.loads((tmp_path / "logs" / "decode-0.config.json").read_text())
    assert document["max_num_seqs"] == 3 and (tmp_path / "logs" / "prefill-0.config.json").is_file()


def test_router_document_becomes_router_config() -> None:
    config = DeploymentConfig.from_dict({"router": {"http_port": 0, "max_attempts": 2}, "model": {"name": "m"}})
    router = config_from_args(
        router_parse(
            [],
            document=local_router_document(
                config,
                [
                    WorkerProcess("prefill", "prefill-0", "127.0.0.1:1", 0),
                    WorkerProcess("decode", "decode-0", "127.0.0.1:2", 0),
                ],
            ),
        )
    )
    assert (router.http_port, router.max_attempts, router.model_name) == (0, 2, "m")


def test_configuration_doc_lists_every_setting_as_the_code_defines_it() -> None:
    """docs/configuration.md's settings table is the one the code generates (regenerate it with
    `python -m pdserve.cluster.deploy_config` when a setting changes)."""
    from pdserve.cluster.deploy_config import REFERENCE_BEGIN, REFERENCE_END, field_names, reference_markdown

    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    start, end = doc.index(REFERENCE_BEGIN), doc.index(REFERENCE_END) + len(REFERENCE_END)
    assert doc[start:end] == reference_markdown()
    assert all(f"| `{name}` |" in doc for name in field_names())
