"""The P/D protocol without gRPC: a real prefill worker (its `KvHandoff` connector) and real decode
workers (their `KvIntake`) in one process, on a tiny random-weight Llama. Only the network is fake:
the prefill call is a direct `PrefillWorker.submit`, the migration call a direct
`MigrationSource.migrate_out`, and K/V travel through `KvTransferServicer.deliver` (the receiver's
own registry and checks) instead of a PushKv stream. Every test ends with every KV block of every
worker back in its pool and no intake left registered."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from pdserve.decode_worker.kv_intake import IntakeSettings, KvIntake, PeerCallFailed
from pdserve.decode_worker.migration_source import MigrationSource
from pdserve.decode_worker.outcomes import NotFound, NotPermitted, WrongState
from pdserve.decode_worker.request_stream import RequestStream
from pdserve.decode_worker.worker import DecodeWorker, Suspended
from pdserve.engine.config import EngineConfig
from pdserve.engine.model_loader import LoadedModel, load_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.failures import MIGRATION_SOURCE, PREFILL, Failure, WorkerUnavailable
from pdserve.kv_transfer import KvSender, KvSpec, KvTransferError, KvTransferServicer, get_backend, register_backend
from pdserve.prefill_worker.job import PrefillJob
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.v1 import worker_pb2
from pdserve.v1.kv_pb2 import KvAck
from pdserve.worker.runtime import sampling_params_from_pb

PROMPT = list(range(10, 60))  # 50 tokens: four blocks of 16
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)  # greedy
WAIT_S = 30.0  # how long a test waits for a worker to settle before it fails


class LoopbackNetwork:
    """The K/V link, in memory: a send delivers into the receiver registered under its target
    address. `gate` holds every send (a transfer in flight) until it is set."""

    def __init__(self) -> None:
        self.receivers: dict[str, KvTransferServicer] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.in_flight = threading.Event()  # a send started

    def sender(self, target: str) -> KvSender:
        return _LoopbackSender(self, target)


class _LoopbackSender(KvSender):
    def __init__(self, network: LoopbackNetwork, target: str) -> None:
        self.network, self.target = network, target

    def send(self, spec: KvSpec, kv: torch.Tensor, first_token_id: int, timeout_s: float) -> KvAck:
        self.network.in_flight.set()
        if not self.network.gate.wait(timeout_s):
            raise KvTransferError(f"send of {spec.request_id!r} timed out")
        self.network.receivers[self.target].deliver(spec, kv.clone(), first_token_id)  # refusal: KvTransferError
        return KvAck(request_id=spec.request_id, ok=True, bytes_received=spec.nbytes)


class InProcessPrefill:
    """`PrefillPeers` without a network: the call is the prefill worker's own `submit`."""

    def __init__(self, workers: dict[str, PrefillWorker]) -> None:
        self.workers = workers

    async def segment_prefix(self, address: str, timeout_s: float) -> str:
        return ""

    async def prefill(
        self, address: str, request: worker_pb2.PrefillRequest, timeout_s: float
    ) -> worker_pb2.PrefillResponse:
        job = PrefillJob(
            request_id=request.request_id,
            prompt_ids=list(request.prompt_token_ids),
            params=sampling_params_from_pb(request.params),
            kv_target=request.kv_target_address,
            kv_backend=request.kv_backend,
            output_index=request.output_index,
            kv_block_offset=request.kv_block_offset,
            kv_checksum=request.kv_checksum,
        )
        future = self.workers[address].submit(job)
        try:  # cancelling this coroutine cancels the job, as a cancelled Prefill call does
            result = await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except asyncio.TimeoutError:
            raise PeerCallFailed(WorkerUnavailable, "DEADLINE_EXCEEDED", "Deadline Exceeded") from None
        except KvTransferError as exc:
            raise PeerCallFailed(WorkerUnavailable, "UNAVAILABLE", f"KV transfer failed: {exc}") from exc
        return worker_pb2.PrefillResponse(
            request_id=job.request_id,
            first_token_id=result.first_token_id,
            kv_bytes=result.kv_bytes,
            cached_tokens=result.cached_tokens,
        )


class InProcessSources:
    """`MigrationSources` without a network: the call is the source's own `MigrationSource.migrate_out`."""

    def __init__(self, sources: dict[str, MigrationSource]) -> None:
        self.sources = sources

    async def migrate_out(
        self, address: str, request: worker_pb2.MigrateOutRequest, timeout_s: float
    ) -> worker_pb2.MigrateOutResponse:
        try:
            return await asyncio.wait_for(self.sources[address].migrate_out(request), timeout_s)
        except Failure as exc:
            raise PeerCallFailed(type(exc), exc.code.name, str(exc)) from exc
        except (NotFound, NotPermitted, WrongState) as exc:  # statuses of their own (NOT_FOUND, ...)
            raise PeerCallFailed(WorkerUnavailable, type(exc).__name__, str(exc)) from exc


@pytest.fixture(scope="module")
def tiny_llama(tiny_llama_dir) -> LoadedModel:  # noqa: ANN001
    return load_model(tiny_llama_dir)


@pytest.fixture
def network() -> Iterator[LoopbackNetwork]:
    """The in-memory link stands in for the "grpc" backend (the backend the decode side names) for
    the test's duration; the real one is registered again afterwards."""
    network = LoopbackNetwork()
    real = get_backend("grpc").sender_factory
    register_backend("grpc", network.sender)
    yield network
    network.gate.set()  # no send stays held past the test
    register_backend("grpc", real)


@dataclasses.dataclass
class Decode:
    worker: DecodeWorker
    receiver: KvTransferServicer
    intake: KvIntake
    migration: MigrationSource
    worker_id: str


class Cluster:
    """Prefill and decode workers of one test, wired through the fake network; `stop` checks that
    each of them is empty (no block held, no intake registered) before stopping it."""

    def __init__(self, loaded: LoadedModel, network: LoopbackNetwork) -> None:
        self.loaded, self.network = loaded, network
        self.prefill: dict[str, PrefillWorker] = {}
        self.decode: dict[str, Decode] = {}
        self.sources: dict[str, MigrationSource] = {}

    def add_prefill(self, name: str, loaded: LoadedModel | None = None, **config: object) -> PrefillWorker:
        worker = PrefillWorker(
            loaded or self.loaded,
            EngineConfig(num_blocks=64, **config),  # type: ignore[arg-type]
            transfer_timeout_s=WAIT_S,
        )
        self.prefill[name] = worker
        return worker

    def add_decode(self, name: str, kv_timeout_s: float = WAIT_S, step_delay_s: float = 0.0) -> Decode:
        worker = DecodeWorker(self.loaded, EngineConfig(num_blocks=64), step_delay_s=step_delay_s)
        receiver = KvTransferServicer()
        self.network.receivers[name] = receiver
        settings = IntakeSettings(name, f"{name}.test:1", kv_target=name, kv_backend="grpc", kv_timeout_s=kv_timeout_s)
        intake = KvIntake(worker, receiver, settings, InProcessPrefill(self.prefill), InProcessSources(self.sources))
        self.sources[name] = MigrationSource(worker, name, kv_timeout_s)
        self.decode[name] = Decode(worker, receiver, intake, self.sources[name], name)
        return self.decode[name]

    def assert_empty(self) -> None:
        """Every block of every worker back in its pool (transfers end on their own threads: wait)."""
        give_up = time.monotonic() + WAIT_S
        while time.monotonic() < give_up:
            for p in self.prefill.values():
                p.loop.call(lambda: None).result(timeout=WAIT_S)
            for d in self.decode.values():
                d.worker.run_on_loop(lambda: None).result(timeout=WAIT_S)
            if self._empty():
                break
            time.sleep(0.01)
        used = {n: p.pool.num_used for n, p in self.prefill.items()}
        used |= {n: d.worker.engine.pool.num_used for n, d in self.decode.items()}
        assert not any(used.values()), f"blocks still held: {used}"
        assert all(p.idle() for p in self.prefill.values())
        assert all(d.worker.idle() and d.receiver.num_pending() == 0 for d in self.decode.values())

    def _empty(self) -> bool:
        return all(p.idle() for p in self.prefill.values()) and all(
            d.worker.idle() and d.worker.engine.pool.num_used == 0 for d in self.decode.values()
        )

    def stop(self) -> None:
        for p in self.prefill.values():
            p.stop()
        for d in self.decode.values():
            d.receiver.close()
            d.worker.stop()


@pytest.fixture
def cluster(tiny_llama: LoadedModel, network: LoopbackNetwork) -> Iterator[Cluster]:
    cluster = Cluster(tiny_llama, network)
    yield cluster
    network.gate.set()
    cluster.stop()


def _deadline() -> float:
    return time.perf_counter() + WAIT_S


async def _until(condition: Callable[[], bool]) -> None:
    give_up = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < give_up, "condition not reached"
        await asyncio.sleep(0.01)


async def _outputs(stream: RequestStream, until: Callable[[list[int]], bool] = lambda _ids: False) -> list[int]:
    """Token ids from the stream until the request finishes, is suspended, or `until(ids)` holds."""
    ids: list[int] = []
    while True:
        item = await stream.next()
        if isinstance(item, Suspended):
            return ids
        if item.token_id >= 0:
            ids.append(item.token_id)
        if item.finish_reason is not None or until(ids):
            return ids


async def _colocated(d: Decode, request_id: str) -> list[int]:
    """What one worker generates for PROMPT by itself: the reference."""
    with RequestStream(d.worker, d.worker_id, request_id, _deadline()) as stream:
        d.worker.add_local(request_id, PROMPT, PARAMS, []).result(timeout=WAIT_S)
        return await _outputs(stream)


async def _remote(d: Decode, request_id: str, prefill: str = "p0") -> tuple[list[int], worker_pb2.PrefillResponse]:
    with RequestStream(d.worker, d.worker_id, request_id, _deadline()) as stream:
        outcome = await d.intake.remote_prefill(request_id, prefill, PROMPT, [], PARAMS, _deadline())
        return await _outputs(stream), outcome.response


def test_full_handoff_commits_the_blocks_and_decode_continues(cluster: Cluster) -> None:
    prefill = cluster.add_prefill("p0")
    d = cluster.add_decode("d0")
    expected = asyncio.run(_colocated(cluster.add_decode("ref"), "ref"))
    computed_before = d.worker.engine.runner.num_prefill_tokens

    ids, response = asyncio.run(_remote(d, "r1"))

    assert ids == expected and len(ids) == PARAMS.max_tokens  # the same tokens as one worker alone
    assert response.first_token_id == ids[0]  # sampled on the prefill side
    assert d.worker.engine.runner.num_prefill_tokens == computed_before  # no prompt token computed on decode
    spec = prefill.spec_for(PrefillJob("r1", PROMPT, PARAMS, "d0"))
    assert response.kv_bytes == spec.nbytes == d.worker.kv_bytes_received == prefill.kv_bytes_sent
    cluster.assert_empty()


def test_a_deadline_expiry_frees_the_reserved_blocks(cluster: Cluster, network: LoopbackNetwork) -> None:
    """The K/V never arrive (the link holds them): the intake's own deadline fails the hand-off
    as the prefill side's, the decode side's reservation is freed, and the prefill side frees its
    blocks once its send is refused."""
    cluster.add_prefill("p0")
    d = cluster.add_decode("d0", kv_timeout_s=1.0)
    network.gate.clear()
    reserved: list[int] = []

    async def scenario() -> None:
        with RequestStream(d.worker, d.worker_id, "r1", _deadline()):
            task = asyncio.ensure_future(d.intake.remote_prefill("r1", "p0", PROMPT, [], PARAMS, _deadline()))
            await _until(lambda: d.receiver.num_pending() > 0 or task.done())
            reserved.append(d.worker.engine.pool.num_used)
            with pytest.raises(WorkerUnavailable) as failure:
                await task
            assert failure.value.side == PREFILL and "deadline" in str(failure.value).lower(), failure.value

    asyncio.run(scenario())
    assert reserved == [4]  # the blocks were held while it waited
    network.gate.set()  # the held send goes on, and is refused: its intake is gone
    cluster.assert_empty()
    assert cluster.prefill["p0"].kv_bytes_sent == 0


@pytest.mark.parametrize("mismatch", ["fingerprint", "dtype", "layout"])
def test_mismatched_kv_is_refused_and_frees_the_blocks(
    cluster: Cluster, tiny_llama: LoadedModel, tiny_llama_dir, mismatch: str
) -> None:  # noqa: ANN001
    """A prefill worker of another model, dtype or block size: its K/V are refused before a byte is
    written, and the request fails as the prefill side's."""
    if mismatch == "fingerprint":
        cluster.add_prefill("p0", dataclasses.replace(tiny_llama, fingerprint="another-model"))
    elif mismatch == "dtype":
        cluster.add_prefill("p0", load_model(tiny_llama_dir, dtype=torch.bfloat16))
    else:
        cluster.add_prefill("p0", block_size=8)
    d = cluster.add_decode("d0")
    with pytest.raises(WorkerUnavailable) as failure:
        asyncio.run(_remote(d, "r1"))
    assert failure.value.side == PREFILL and "does not match" in str(failure.value), failure.value
    assert d.worker.kv_bytes_received == 0
    cluster.assert_empty()


def test_migrate_in_resumes_where_the_source_stopped(cluster: Cluster) -> None:
    """A request decoding on d1 is suspended and moved to d2, which takes its K/V (every token but
    the last) and decodes on: the whole output is what one worker alone generates."""
    expected = asyncio.run(_colocated(cluster.add_decode("ref"), "ref"))
    d1, d2 = cluster.add_decode("d1", step_delay_s=0.02), cluster.add_decode("d2")
    d1.migration.set_targets(frozenset({"d2"}))

    async def scenario() -> tuple[list[int], list[int]]:
        with RequestStream(d1.worker, "d1", "src", _deadline()) as source:
            d1.worker.add_local("src", PROMPT, PARAMS, []).result(timeout=WAIT_S)
            head = await _outputs(source, until=lambda ids: len(ids) >= 3)
            await d1.migration.suspend("src")
            head += await _outputs(source)  # what it sampled before the suspension took hold
            with RequestStream(d2.worker, "d2", "dst", _deadline()) as target:
                marker = await d2.intake.migrate_in("dst", "d1", "src", PROMPT, head, PARAMS, _deadline())
                assert marker.resumed and marker.num_tokens == len(PROMPT) + len(head) - 1
                return head, await _outputs(target)

    head, tail = asyncio.run(scenario())
    assert 3 <= len(head) < PARAMS.max_tokens
    assert head + tail == expected
    assert d1.worker.requests_migrated_out == 1 and d2.worker.requests_migrated_in == 1
    cluster.assert_empty()


def test_a_failed_migration_is_the_sources_failure_and_frees_the_blocks(cluster: Cluster) -> None:
    """The source holds no such request: the target fails the request over (MIGRATION_SOURCE)."""
    cluster.add_decode("d1")
    d2 = cluster.add_decode("d2")
    cluster.sources["d1"].set_targets(frozenset({"d2"}))

    async def scenario() -> None:
        with RequestStream(d2.worker, "d2", "dst", _deadline()):
            await d2.intake.migrate_in("dst", "d1", "nowhere", PROMPT, [5, 6], PARAMS, _deadline())

    with pytest.raises(WorkerUnavailable) as failure:
        asyncio.run(scenario())
    assert failure.value.side == MIGRATION_SOURCE and "not suspended" in str(failure.value), failure.value
    cluster.assert_empty()


def test_a_cancel_mid_transfer_frees_both_sides(cluster: Cluster, network: LoopbackNetwork) -> None:
    """The client leaves while the K/V are on the wire: the decode side cancels its intake and the
    call, the prefill side's send is then refused, and every block on both sides is freed."""
    cluster.add_prefill("p0")
    d = cluster.add_decode("d0")
    network.gate.clear()

    async def scenario() -> None:
        with RequestStream(d.worker, d.worker_id, "r1", _deadline()):
            task = asyncio.ensure_future(d.intake.remote_prefill("r1", "p0", PROMPT, [], PARAMS, _deadline()))
            await _until(network.in_flight.is_set)
            assert d.receiver.num_pending() == 1 and not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert d.receiver.num_pending() == 0  # the intake was cancelled with the call

    asyncio.run(scenario())
    network.gate.set()
    cluster.assert_empty()
    assert cluster.prefill["p0"].kv_bytes_sent == 0 and d.worker.kv_bytes_received == 0
