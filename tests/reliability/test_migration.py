"""Live KV migration between decode workers (Router.Migrate), with real processes on loopback and a
tiny random Llama: a request moved mid-stream gives exactly the tokens (and text) of an undisturbed
run, the target computes no prompt token for it, a dead target falls back to failover, a draining
worker hands its requests over, and `pdserve migrate` drives it from the command line. The
migration, failover and draining tests run with both router -> decode transports (a Generate call
per request, and --decode-mux's GenerateMux stream).

Decode workers sleep before each step (PDSERVE_INJECT_STEP_DELAY_MS) so that a tiny model's stream is
still running when the test acts on it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from injection import injected

from pdserve.cluster.launch import LaunchOptions, local_deployment
from pdserve.cluster.local import LocalCluster
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_loader import load_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.tokenization import encode_text
from pdserve.transport import open_channel
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

from e2e_helpers import generate, wait_idle, worker_info

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PROMPT = "Tell me a story about the old mill by the river, the market and the winter " * 3
MAX_TOKENS = 60
SEEDED = dict(temperature=0.9, top_p=0.95, seed=1234)
#: Seeded sampling with every penalty and min-p: the target rebuilds their state from the tokens.
PENALIZED = dict(SEEDED, repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2, min_p=0.05)


_EXPECTED: dict[tuple[object, ...], list[int]] = {}


def _expected(model_dir: Path, max_tokens: int, **params: object) -> list[int]:
    """The engine's output for PROMPT in this process; computed once per module for the same arguments
    (seven cases compare with the same greedy run)."""
    key = (str(model_dir), max_tokens, tuple(sorted(params.items())))
    if key not in _EXPECTED:
        _EXPECTED[key] = _compute_expected(model_dir, max_tokens, **params)
    return list(_EXPECTED[key])


def _compute_expected(model_dir: Path, max_tokens: int, **params: object) -> list[int]:
    loaded = load_model(model_dir)
    engine = LLMEngine(loaded, EngineConfig(num_blocks=256))
    ids = encode_text(loaded.tokenizer, PROMPT)
    out = engine.generate([ids], SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params))[0]  # type: ignore[arg-type]
    engine.pool.assert_all_free()
    return out


#: router -> decode worker transports: a Generate call per request, or router --decode-mux's one
#: GenerateMux stream per decode worker (the same migration, failover and draining must hold)
TRANSPORTS = pytest.mark.parametrize("router_args", [(), ("--decode-mux",)], ids=["generate", "mux"])


def _cluster(model_dir: Path, delay_ms: int = 60, router_args: tuple[str, ...] = ()) -> LocalCluster:
    with injected(step_delay_ms=delay_ms):  # the workers read it at start (LocalCluster starts them)
        return LocalCluster(
            local_deployment(model=str(model_dir), prefill=1, decode=2, threads_per_worker=1),
            LaunchOptions(decode_args=("--kv-timeout-s", "20"), router_args=router_args),
        )


class SharedClusters:
    """One started cluster per router transport, started on first use. `get` lends it to a test that
    kills no worker (each such test ends with every worker idle and reads worker counters as
    differences, so none depends on what ran before it); `take` hands it over for good to a test that
    kills a worker in it (the next `get` or `take` of that transport starts a new one)."""

    def __init__(self, model_dir: Path) -> None:
        self._model_dir = model_dir
        self._started: dict[tuple[str, ...], LocalCluster] = {}

    def get(self, router_args: tuple[str, ...]) -> LocalCluster:
        if router_args not in self._started:
            self._started[router_args] = _cluster(self._model_dir, router_args=router_args)
        return self._started[router_args]

    def take(self, router_args: tuple[str, ...]) -> LocalCluster:
        return self._started.pop(router_args, None) or _cluster(self._model_dir, router_args=router_args)

    def stop(self) -> None:
        for cluster in self._started.values():
            cluster.stop()


@pytest.fixture(scope="module")
def shared_cluster(tiny_llama_dir: Path) -> Iterator[SharedClusters]:
    """The clusters (`_cluster`'s defaults, one per router transport) of this module's tests: lent to
    the tests that kill no worker, then taken by the target-killed tests, which kill one. (The draining
    tests, with a longer step delay, start their own.)"""
    clusters = SharedClusters(tiny_llama_dir)
    yield clusters
    clusters.stop()


def assert_muxed(cluster: LocalCluster, router_args: tuple[str, ...]) -> None:
    """With --decode-mux the decode workers served the requests on GenerateMux, never Generate."""
    logs = "".join((cluster.log_dir / f"{w.worker_id}.log").read_text() for w in _decoders(cluster))
    if router_args:
        assert "GenerateMux start" in logs and "Generate start" not in logs
    else:
        assert "GenerateMux start" not in logs


class Stream:
    """One Generate stream read in a thread; `wait_tokens` blocks until it delivered n tokens."""

    def __init__(self, address: str, request_id: str, max_tokens: int, **params: object) -> None:
        stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(address))
        request = router_pb2.GenerateRequest(
            request_id=request_id,
            prompt=PROMPT,
            params=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
        )
        self.responses: list[router_pb2.GenerateResponse] = []
        self.error: grpc.RpcError | None = None
        self._changed = threading.Condition()
        self._call = stub.Generate(request, timeout=300)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for response in self._call:
                with self._changed:
                    self.responses.append(response)
                    self._changed.notify_all()
        except grpc.RpcError as exc:
            self.error = exc
        with self._changed:
            self._changed.notify_all()

    @property
    def token_ids(self) -> list[int]:
        return [t for r in self.responses for t in r.token_ids]

    @property
    def text(self) -> str:
        return "".join(r.text for r in self.responses)

    def wait_tokens(self, n: int, timeout: float = 60) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: len(self.token_ids) >= n or not self._thread.is_alive(), timeout)
        assert len(self.token_ids) >= n, f"stream ended early: {self.error}"
        assert len(self.token_ids) < MAX_TOKENS, "stream finished before the test could act mid-stream"

    def result(self, timeout: float = 120) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive() and self.error is None, self.error
        assert self.responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert not any(r.HasField("migration") for r in self.responses)  # markers never reach the client


def _decoders(cluster: LocalCluster) -> list:  # noqa: ANN401
    return [w for w in cluster.workers if w.role == "decode"]


def _source_and_target(cluster: LocalCluster) -> tuple:  # noqa: ANN401
    a, b = _decoders(cluster)
    return (a, b) if worker_info(a.address, "decode").running_requests else (b, a)


def _migrate(address: str, request_id: str, to: str = "") -> router_pb2.MigrateResponse:
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(address))
    return stub.Migrate(router_pb2.MigrateRequest(request_id=request_id, to_worker_id=to), timeout=60)


def _exited(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _live(cluster: LocalCluster, dead: frozenset[int] = frozenset()) -> list[tuple[str, str]]:
    return [(w.role, w.address) for w in cluster.workers if w.pid not in dead]


@pytest.mark.parametrize(
    ("params", "router_args"),
    [({}, ()), (PENALIZED, ()), ({}, ("--decode-mux",))],
    ids=["greedy", "seeded-penalized", "greedy-mux"],
)
def test_migration_mid_stream_gives_identical_tokens_and_target_computes_no_prompt(
    tiny_llama_dir: Path, shared_cluster: SharedClusters, params: dict, router_args: tuple[str, ...]
) -> None:
    expected = _expected(tiny_llama_dir, MAX_TOKENS, **params)
    cluster = shared_cluster.get(router_args)
    request_id = f"move-me-{len(params)}-{len(router_args)}"  # one per case: the cluster is shared
    undisturbed = generate(cluster.router_address, PROMPT, MAX_TOKENS, ignore_eos=True, **params)
    assert undisturbed.token_ids == expected
    stream = Stream(cluster.router_address, request_id, MAX_TOKENS, **params)
    stream.wait_tokens(10)
    source, target = _source_and_target(cluster)
    before, before_source = worker_info(target.address, "decode"), worker_info(source.address, "decode")
    done = _migrate(cluster.router_address, request_id, to=target.worker_id)
    stream.result()
    assert stream.token_ids == expected
    assert stream.text == undisturbed.text  # detokenizer state moved too: no lost or repeated text
    assert (done.from_address, done.to_address) == (source.address, target.address)
    prompt_len = stream.responses[-1].usage.prompt_tokens
    assert prompt_len + 10 - 1 <= done.num_tokens < prompt_len + MAX_TOKENS and done.kv_bytes > 0
    after_target, after_source = worker_info(target.address, "decode"), worker_info(source.address, "decode")
    assert after_target.requests_migrated_in == before.requests_migrated_in + 1
    assert after_target.prefill_tokens_computed == before.prefill_tokens_computed == 0  # no prompt computed
    assert after_source.requests_migrated_out == before_source.requests_migrated_out + 1
    assert stream.responses[-1].usage.completion_tokens == MAX_TOKENS
    wait_idle(_live(cluster))
    assert_muxed(cluster, router_args)


def test_migrate_cli_and_errors(tiny_llama_dir: Path, shared_cluster: SharedClusters) -> None:
    expected = _expected(tiny_llama_dir, MAX_TOKENS)
    cluster = shared_cluster.get(())
    with pytest.raises(grpc.RpcError) as err:
        _migrate(cluster.router_address, "nobody")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    decode_stub = worker_pb2_grpc.DecodeWorkerStub(open_channel(_decoders(cluster)[0].address))
    with pytest.raises(grpc.RpcError) as err:  # K/V goes only to registered decode workers
        decode_stub.MigrateOut(
            worker_pb2.MigrateOutRequest(
                request_id="x", target_request_id="y", kv_target_address="127.0.0.1:9", num_tokens=1
            ),
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    stream = Stream(cluster.router_address, "cli-move", MAX_TOKENS)
    stream.wait_tokens(8)
    source, target = _source_and_target(cluster)
    migrated_in = worker_info(target.address, "decode").requests_migrated_in
    with pytest.raises(grpc.RpcError) as err:  # a worker that is not a decode worker is no target
        _migrate(
            cluster.router_address,
            "cli-move",
            to=cluster.workers[0].address if cluster.workers[0].role == "prefill" else "prefill-0",
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO)])}
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cluster.cli", "migrate", "--url", cluster.router_address, "cli-move"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    assert f"from {source.address} to {target.address}" in out.stdout
    stream.result()
    assert stream.token_ids == expected
    assert worker_info(target.address, "decode").requests_migrated_in == migrated_in + 1
    wait_idle(_live(cluster))


@TRANSPORTS
def test_target_killed_mid_migration_falls_back_to_failover(
    tiny_llama_dir: Path, shared_cluster: SharedClusters, router_args: tuple[str, ...]
) -> None:
    expected = _expected(tiny_llama_dir, MAX_TOKENS)
    with shared_cluster.take(router_args) as cluster:  # idle, possibly after other tests: counters as differences
        stream = Stream(cluster.router_address, "doomed-target", MAX_TOKENS)
        stream.wait_tokens(8)
        source, target = _source_and_target(cluster)
        migrated_out = worker_info(source.address, "decode").requests_migrated_out
        os.kill(target.pid, signal.SIGSTOP)  # still looks healthy to the router for a moment
        try:
            with ThreadPoolExecutor(1) as bg:
                pending = bg.submit(_migrate, cluster.router_address, "doomed-target", target.worker_id)
                time.sleep(1.0)  # the source suspended, the router called the frozen target
                os.kill(target.pid, signal.SIGKILL)
                with pytest.raises(grpc.RpcError) as err:
                    pending.result(timeout=60)
        finally:
            os.kill(target.pid, signal.SIGKILL)
        assert err.value.code() == grpc.StatusCode.ABORTED and "failover" in err.value.details()
        stream.result()
        assert stream.token_ids == expected  # re-prefilled on the healthy worker, identical tokens
        assert worker_info(source.address, "decode").requests_migrated_out == migrated_out
        wait_idle(_live(cluster, frozenset({target.pid})))  # the suspended blocks were freed
        assert_muxed(cluster, router_args)


@TRANSPORTS
def test_draining_decode_worker_migrates_its_running_requests(
    tiny_llama_dir: Path, router_args: tuple[str, ...]
) -> None:
    expected = _expected(tiny_llama_dir, MAX_TOKENS)
    with _cluster(tiny_llama_dir, delay_ms=100, router_args=router_args) as cluster:
        stream = Stream(cluster.router_address, "drained", MAX_TOKENS)
        stream.wait_tokens(5)
        source, target = _source_and_target(cluster)
        started = time.monotonic()
        os.kill(source.pid, signal.SIGTERM)  # drain: it hands the request over instead of finishing it
        stream.result()
        assert stream.token_ids == expected
        assert worker_info(target.address, "decode").requests_migrated_in == 1
        deadline = started + 30
        while not _exited(source.pid):  # idle once the request left: it exits long before its grace
            assert time.monotonic() < deadline
            time.sleep(0.1)
        wait_idle(_live(cluster, frozenset({source.pid})))
        assert_muxed(cluster, router_args)
