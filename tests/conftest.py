"""Shared fixtures: the real default model, tiny random-weight Llama/Qwen2 models, engines."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch

from pdserve.cluster.launch import local_deployment
from pdserve.cluster.local import LocalCluster
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_loader import LoadedModel, load_model
from pdserve.router.config import RouterConfig
from pdserve.router.server import RouterServer, serve
from pdserve.v1 import router_pb2_grpc

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from pdserve.engine.model_fetch import fetch_default_model

    return fetch_default_model()


@pytest.fixture(scope="session")
def default_tokenizer(default_model_dir: Path):  # noqa: ANN201 - a transformers tokenizer
    """The default model's tokenizer alone (what `default_model.tokenizer` is: load_model reads it with
    AutoTokenizer), for tests of tokenization that need no weights."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def default_model(default_model_dir: Path) -> LoadedModel:
    torch.manual_seed(0)
    return load_model(default_model_dir)


def _save_tiny(family: str, out: Path, tokenizer_dir: Path) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = config_cls(vocab_size=len(tokenizer), eos_token_id=2, bos_token_id=1, **TINY)
    torch.manual_seed(1234)
    model_cls(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> Path:
    return _save_tiny(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"), default_model_dir)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return _save_tiny("llama", tmp_path_factory.mktemp("tiny-llama"), default_model_dir)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> LoadedModel:
    return load_model(tiny_model_dir)


@pytest.fixture(scope="session")
def default_1p1d(default_model_dir: Path) -> Iterator[LocalCluster]:
    """One 1P1D LocalCluster of the default model (one thread per worker: `local_deployment(model=None,
    prefill=1, decode=1, threads_per_worker=1)`), started once for the modules that only send it requests
    (tests/e2e/test_disaggregated.py, tests/e2e/test_kv_faults.py, tests/capacity/test_capacity_bench_real.py):
    it saves two starts of the same three processes (the default model's load in two workers each). A test
    that uses it must not kill, drain or reconfigure its processes, and leaves it idle (every block free:
    `wait_idle`); one that needs other flags or kills a worker starts its own cluster."""
    with LocalCluster(local_deployment(model=None, prefill=1, decode=1, threads_per_worker=1)) as cluster:
        yield cluster


#: Folders (under tests/) whose tests start worker processes, a router process or Ray: all `slow`.
SLOW_FOLDERS = frozenset({"e2e", "reliability", "ecosystem", "ray"})
#: Folders whose tests start a Ray cluster: `ray` (and `slow`).
RAY_FOLDERS = frozenset({"ray"})
#: Modules elsewhere whose tests start worker processes (LocalCluster of sim-engine or real workers).
#: (Single slow tests elsewhere carry their own @pytest.mark.slow, e.g. tests/test_gpu_check.py's dry run.)
SLOW_MODULES = frozenset({"capacity/test_sim_cluster.py", "capacity/test_capacity_bench_real.py"})
#: Fixtures that load the real default model (135M parameters) into the test process, or start workers.
SLOW_FIXTURES = frozenset({"default_model", "default_1p1d"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark tests `slow` (and `ray`) by where they live and what they use, so that `-m "not slow"`
    (`./run test-fast`) is the fast lane; a marker set in the module itself is kept."""
    root = Path(__file__).resolve().parent
    for item in items:
        try:
            relative = item.path.resolve().relative_to(root)
        except ValueError:  # a test outside tests/ (a path given on the command line)
            continue
        folder = relative.parts[0] if len(relative.parts) > 1 else ""
        slow = (
            folder in SLOW_FOLDERS
            or relative.as_posix() in SLOW_MODULES
            or not SLOW_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))
        )
        if folder in RAY_FOLDERS:
            item.add_marker(pytest.mark.ray)
        if slow:
            item.add_marker(pytest.mark.slow)


EngineFactory = Callable[..., LLMEngine]


@pytest.fixture
def make_engine() -> Iterator[EngineFactory]:
    """Build engines; after the test every one of them must be idle with every block free."""
    engines: list[LLMEngine] = []

    def factory(loaded: LoadedModel, **overrides: object) -> LLMEngine:
        engine = LLMEngine(loaded, EngineConfig(**{"num_blocks": 512, **overrides}))  # type: ignore[arg-type]
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        assert not engine.has_work and not engine.sequences, "engine still holds requests"
        engine.pool.assert_all_free()


@pytest.fixture
def start_router() -> Iterator[Callable[[RouterConfig], tuple[RouterServer, router_pb2_grpc.RouterStub]]]:
    """Start a real router (serve()) from a RouterConfig (port 0); returns (server, stub)."""
    started: list[tuple[RouterServer, grpc.Channel]] = []

    def start(config: RouterConfig) -> tuple[RouterServer, router_pb2_grpc.RouterStub]:
        server, port = serve(config)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        started.append((server, channel))
        return server, router_pb2_grpc.RouterStub(channel)

    yield start
    for server, channel in started:
        channel.close()
        server.stop(grace=None)
