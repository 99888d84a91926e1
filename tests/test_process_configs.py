"""The typed per-process configs (`PrefillWorkerConfig`, `DecodeWorkerConfig`, `ElasticWorkerConfig`,
the router's `RouterProcess`): their defaults are the settings' defaults, the command line
round-trips through them, the Ray launcher builds them from a document plus extra flags, and a
config built in code (no argv) starts real workers that serve a request on loopback."""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.cluster.deploy_config import DeploymentConfig, router_document, worker_document
from pdserve.cluster.ray_actors import router_process, worker_config
from pdserve.decode_worker.config import DecodeWorkerConfig
from pdserve.decode_worker.config import parse_args as decode_parse
from pdserve.elastic_worker.config import ElasticWorkerConfig
from pdserve.elastic_worker.config import parse_args as elastic_parse
from pdserve.prefill_worker.config import PrefillWorkerConfig
from pdserve.prefill_worker.config import parse_args as prefill_parse
from pdserve.settings import DecodePool, ModelSection, PrefillPool, field_type, section_default, section_field
from pdserve.worker.config import WorkerConfig

CONFIGS: dict[str, tuple[type[WorkerConfig], Any]] = {
    "prefill": (PrefillWorkerConfig, prefill_parse),
    "decode": (DecodeWorkerConfig, decode_parse),
}


@pytest.mark.parametrize("role", sorted(CONFIGS))
def test_a_command_line_without_flags_gives_the_default_config(role: str) -> None:
    cls, parse = CONFIGS[role]
    assert cls.from_args(parse([])) == cls()


@pytest.mark.parametrize("role", sorted(CONFIGS))
def test_every_section_of_a_config_defaults_to_its_settings(role: str) -> None:
    cls, _ = CONFIGS[role]
    config = cls()
    for attr, flags in cls.SECTION_FLAGS.items():
        section = getattr(config, attr)
        assert type(section) is flags.section, f"{role}.{attr} is a {type(section).__name__}"
        for f in dataclasses.fields(flags.section):
            assert getattr(section, f.name) == section_default(flags.section, f.name), f"{role}.{attr}.{f.name}"
    assert config.pool.kv_cache_mb == section_default(PrefillPool if role == "prefill" else DecodePool, "kv_cache_mb")


def _other_value(section: type, name: str) -> Any:  # noqa: ANN401
    """A value of setting `name` that is not its default (and that its flag accepts)."""
    default, choices = section_default(section, name), section_field(section, name).metadata["choices"]
    base, _ = field_type(section, name)
    if choices:
        return next(c for c in choices if c not in (default, ""))
    if name == "device":
        return "cpu"
    if base is bool:
        return not default
    if base in (int, float):
        return base((default or 0) + 3)
    return f"value-of-{name}"


def _flag_argv(flag: str, value: Any) -> list[str]:  # noqa: ANN401
    if isinstance(value, bool):
        return [flag] if value else [f"--no-{flag[2:]}"]
    return [flag, str(value)]


def _every_flag_changed(cls: type[WorkerConfig]) -> tuple[list[str], dict[tuple[str, str], Any]]:
    """(argv that sets every flag of `cls` off its default, {(section attribute or "", name): value})."""
    from pdserve.settings import process_flag

    argv: list[str] = []
    expected: dict[tuple[str, str], Any] = {}
    for name in cls.OWN_FLAGS:
        value = _other_value(cls, name)
        argv += _flag_argv(process_flag(cls, name), value)
        expected["", name] = value
    for attr, flags in cls.SECTION_FLAGS.items():
        for name in flags.names:
            value = _other_value(flags.section, name)
            argv += _flag_argv(process_flag(flags.section, name, flags.flags), value)
            expected[attr, name] = value
    return argv, expected


@pytest.mark.parametrize("role", sorted(CONFIGS))
def test_every_flag_reaches_its_field_of_the_config(role: str) -> None:
    cls, parse = CONFIGS[role]
    argv, expected = _every_flag_changed(cls)
    config = cls.from_args(parse(argv))
    got = {(attr, name): getattr(getattr(config, attr) if attr else config, name) for attr, name in expected}
    assert got == expected
    assert len(expected) >= 20, "the flag list lost track of the config"
    assert config.pool.count is None  # a pool setting without a flag keeps its default


def test_the_elastic_command_line_gives_both_roles_their_flags() -> None:
    config = ElasticWorkerConfig.from_args(
        *elastic_parse(
            [
                "--role",
                "colocated",
                "--model",
                "/m",
                "--max-num-seqs",
                "3",
                "--prefill-chunk-tokens",
                "64",
                "--kv-streaming",
                "layer",
                "--kv-cache-mb",
                "32",
            ]
        )
    )
    assert config.role == "colocated"
    assert config.decode.pool.max_num_seqs == 3 and config.decode.pool.kv_cache_mb == 32
    assert config.prefill.kv.streaming == "layer" and config.prefill.pool.kv_cache_mb == 32
    assert config.prefill.pool.chunk_tokens == config.decode.pool.chunk_tokens == 64
    assert config.prefill.model.path == config.decode.model.path == "/m"
    with pytest.raises(ValueError, match="role must be one of"):
        ElasticWorkerConfig("sideways", config.prefill, config.decode)


def test_the_ray_launcher_builds_each_actors_config_from_its_document_and_extra_flags() -> None:
    deployment = DeploymentConfig(mode="ray")
    decode = worker_config(
        "decode", worker_document(deployment, "decode", "decode-3", "127.0.0.1"), ("--max-num-seqs", "5")
    )
    assert isinstance(decode, DecodeWorkerConfig)
    assert (decode.worker_id, decode.pool.max_num_seqs, decode.kv.backend) == ("decode-3", 5, "grpc")
    assert decode.pool.kv_cache_mb == deployment.decode.kv_cache_mb
    prefill = worker_config("prefill", worker_document(deployment, "prefill", "prefill-1", "127.0.0.1"))
    assert isinstance(prefill, PrefillWorkerConfig) and prefill.worker_id == "prefill-1"
    elastic_document = {kind: worker_document(deployment, kind, "decode-0", "127.0.0.1") for kind in CONFIGS}
    elastic = worker_config("decode", elastic_document, ("--kv-timeout-s", "9"))
    assert isinstance(elastic, ElasticWorkerConfig) and elastic.role == "decode"
    assert elastic.decode.pool.kv_timeout_s == elastic.prefill.pool.kv_timeout_s == 9.0
    for config in (decode, prefill, elastic):  # Ray pickles the object into the actor
        assert pickle.loads(pickle.dumps(config)) == config
    with pytest.raises(ValueError, match="refused"):
        worker_config("decode", worker_document(deployment, "decode", "decode-0"), ("--no-such-flag",))
    with pytest.raises(ValueError, match="role must be one of"):
        worker_config("router", worker_document(deployment, "decode", "decode-0"))


def test_the_ray_launcher_builds_the_routers_config() -> None:
    deployment = DeploymentConfig(mode="ray")
    process = router_process(
        router_document(deployment, {"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:2"]}),
        auth_token="launcher-token",
    )
    assert (process.router.prefill, process.router.decode) == (("127.0.0.1:1",), ("127.0.0.1:2",))
    assert process.router.auth_token == "launcher-token"
    assert process.observability.log_level == deployment.observability.log_level
    assert pickle.loads(pickle.dumps(process)) == process


# ----- behaviour: configs built in code start real workers ----------------------------------------


@pytest.fixture
def disaggregated(tiny_llama_dir: Path) -> Iterator[tuple[Any, Any, DecodeWorkerConfig]]:
    """A prefill and a decode worker started from configs built in code (no command line)."""
    from pdserve.decode_worker.process import start_worker as start_decode
    from pdserve.prefill_worker.process import start_worker as start_prefill

    model = ModelSection(path=str(tiny_llama_dir), device="cpu", dtype="float32", block_size=8)
    prefill = start_prefill(
        PrefillWorkerConfig(
            worker_id="typed-prefill", model=model, pool=PrefillPool(kv_cache_mb=4, drain_timeout_s=1.0)
        )
    )
    try:
        decode_config = DecodeWorkerConfig(
            worker_id="typed-decode", model=model, pool=DecodePool(kv_cache_mb=4, max_num_seqs=5, drain_timeout_s=1.0)
        )
        decode = start_decode(decode_config)
        try:
            yield prefill, decode, decode_config
        finally:
            decode.stop()
    finally:
        prefill.stop()


def test_workers_started_from_typed_configs_serve_a_disaggregated_request(disaggregated, start_router) -> None:  # noqa: ANN001
    from pdserve.router.config import RouterConfig
    from pdserve.transport import open_channel
    from pdserve.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

    prefill, decode, decode_config = disaggregated
    _server, stub = start_router(RouterConfig(prefill=(prefill.address,), decode=(decode.address,)))
    responses = list(
        stub.Generate(
            router_pb2.GenerateRequest(
                prompt="The river runs", params=common_pb2.SamplingParams(max_tokens=6, ignore_eos=True)
            ),
            timeout=120,
        )
    )
    assert sum(len(r.token_ids) for r in responses) == 6
    with open_channel(decode.address) as channel:
        decode_info = worker_pb2_grpc.DecodeWorkerStub(channel).GetInfo(worker_pb2.InfoRequest(), timeout=10)
    with open_channel(prefill.address) as channel:
        prefill_info = worker_pb2_grpc.PrefillWorkerStub(channel).GetInfo(worker_pb2.InfoRequest(), timeout=10)
    assert (decode_info.worker_id, prefill_info.worker_id) == ("typed-decode", "typed-prefill")
    assert decode_info.max_running_requests == decode_config.pool.max_num_seqs == 5
    assert decode_info.kv_bytes_received > 0  # the prompt's KV came from the prefill worker
    assert prefill_info.prefill_tokens_computed > 0 and decode_info.prefill_tokens_computed == 0
