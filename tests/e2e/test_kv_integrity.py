"""KV integrity between real worker processes: a control frame naming another worker's shared-memory
segment is refused and the request falls back to another prefill worker; `--kv-checksum` works end to
end. The forger is a test double in this process, standing for a compromised or impersonating peer."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from security_helpers import register_kv_targets

from pdserve.cluster.local import child_env
from pdserve.cluster.processes import ManagedProcess, stop_all
from pdserve.engine.kv_cache import segment_prefix
from pdserve.engine.model_loader import load_model
from pdserve.kv_transfer import KvSpec
from pdserve.kv_transfer.base import dtype_name
from pdserve.kv_transfer.shm_backend import header_for
from pdserve.transport import open_channel
from pdserve.v1 import common_pb2, kv_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.v1.kv_pb2 import KvFrame

from e2e_helpers import wait_idle, worker_info

pytestmark = pytest.mark.slow


def _start(role: str, model: Path, log_dir: Path, *extra: str) -> ManagedProcess:
    argv = [
        sys.executable,
        "-m",
        f"{role}_worker",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--threads",
        "1",
        "--model",
        str(model),
        "--kv-cache-mb",
        "8",
        *extra,
    ]
    return ManagedProcess(f"{role}{len(extra)}", argv, log_dir / f"{role}-{len(extra)}.log", env=child_env())


@pytest.fixture(scope="module")
def workers(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """One real prefill worker and two real decode workers (shm backend; one with --kv-checksum)."""
    logs = tmp_path_factory.mktemp("kv-integrity-logs")
    procs = [
        _start("prefill", tiny_llama_dir, logs),
        _start("decode", tiny_llama_dir, logs, "--kv-backend", "shm"),
        _start("decode", tiny_llama_dir, logs, "--kv-backend", "shm", "--kv-checksum"),
    ]  # xxh3
    try:
        p, d, dc = (str(proc.wait_ready(120)["address"]) for proc in procs)
        register_kv_targets(p, [d, dc])  # no router in these tests: register the decode workers as it would
        yield {"prefill": p, "decode": d, "decode_checksum": dc}
    finally:
        stop_all(procs, 10)


class ForgingPrefill(worker_pb2_grpc.PrefillWorkerServicer):
    """A prefill worker that answers Prefill with a control frame naming `victim`'s KV cache segment
    (another worker's whole cache) instead of its own."""

    def __init__(self, loaded, victim_address: str) -> None:  # noqa: ANN001
        self.loaded, self.calls, self.acks, self.errors = loaded, 0, [], []
        info = worker_info(victim_address, "prefill")
        names = [n for n in os.listdir("/dev/shm") if n.startswith(info.kv_segment_prefix) and "cache-" in n]
        assert len(names) == 1, names
        self.victim_segment, self.victim_blocks = names[0], info.kv_blocks_total

    def GetInfo(self, request, context):  # noqa: ANN001, ANN201, N802
        return common_pb2.WorkerInfo(
            worker_id="forger",
            role=common_pb2.WORKER_ROLE_PREFILL,
            healthy=True,
            pid=os.getpid(),
            kv_blocks_total=64,
            kv_segment_prefix=segment_prefix(),
        )

    def Prefill(self, request, context):  # noqa: ANN001, ANN201, N802
        self.calls += 1
        shape = self.loaded.kv_shape(16)
        n = -(-len(request.prompt_token_ids) // 16) - request.kv_block_offset
        spec = KvSpec(
            request.request_id,
            self.loaded.fingerprint,
            dtype_name(shape.dtype),
            (shape.num_layers, 2, n, 16, shape.num_kv_heads, shape.head_dim),
            16,
            len(request.prompt_token_ids),
            request.kv_block_offset,
        )
        header = header_for(spec, 7, self.victim_segment, list(range(n)), self.victim_blocks)
        try:
            ack = kv_pb2_grpc.KvTransferStub(open_channel(request.kv_target_address)).PushKv(
                iter([KvFrame(header=header)]), timeout=30
            )
        except grpc.RpcError as exc:  # kept for the test's message
            self.errors.append(f"PushKv: {exc.code().name}: {exc.details()}")
            raise
        self.acks.append(ack)
        context.abort(grpc.StatusCode.UNAVAILABLE, f"KV refused: {ack.error}")


@pytest.fixture
def forger(workers: dict[str, str], tiny_llama_dir: Path) -> Iterator[tuple[ForgingPrefill, str]]:
    servicer = ForgingPrefill(load_model(tiny_llama_dir), workers["prefill"])
    server = grpc.server(futures.ThreadPoolExecutor(4))
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    yield servicer, address
    server.stop(0)


PROMPT = list(range(5, 60))  # 55 tokens: 4 blocks


def _generate_via(decode: str, prefill: str, request_id: str) -> list[int]:
    stub = worker_pb2_grpc.DecodeWorkerStub(open_channel(decode))
    responses = stub.Generate(
        worker_pb2.DecodeRequest(
            request_id=request_id,
            token_ids=common_pb2.TokenIds(ids=PROMPT),
            prefill_address=prefill,
            params=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True),
        ),
        timeout=60,
    )
    return [t for r in responses for t in r.token_ids]


def test_a_frame_naming_another_workers_segment_is_refused(workers: dict[str, str], forger) -> None:  # noqa: ANN001
    servicer, forger_address = forger
    with pytest.raises(grpc.RpcError) as err:
        _generate_via(workers["decode"], forger_address, "forged-segment")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert err.value.details().startswith("prefill failed on")  # the router retries on another prefill worker
    # the decode worker fails the request as soon as it refuses the frame, which can be before the
    # forger's PushKv call returns its ack: wait for that call to end
    deadline = time.monotonic() + 30
    while not (servicer.acks or servicer.errors) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert servicer.acks and not servicer.acks[0].ok, (servicer.calls, servicer.errors, err.value.details())
    assert "does not belong to the prefill worker called" in servicer.acks[0].error
    wait_idle([("decode", workers["decode"]), ("prefill", workers["prefill"])])


def test_through_the_router_the_request_falls_back_to_an_honest_prefill_worker(workers: dict[str, str], forger) -> None:  # noqa: ANN001
    from pdserve.router.config import RouterConfig
    from pdserve.router.server import serve

    servicer, forger_address = forger
    expected = _generate_via(workers["decode"], workers["prefill"], "reference")
    router, _ = serve(RouterConfig(prefill=(forger_address, workers["prefill"]), decode=(workers["decode"],)))
    try:
        stub = router_pb2_grpc.RouterStub(open_channel(router.address))
        request = router_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=PROMPT), params=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True)
        )
        results = [[t for r in stub.Generate(request, timeout=60) for t in r.token_ids] for _ in range(2)]
    finally:
        router.stop(0)
    assert servicer.calls >= 1 and all(not ack.ok for ack in servicer.acks)  # the forger was tried, and refused
    assert results == [expected, expected]  # and the honest prefill worker served every request
    wait_idle([("decode", workers["decode"]), ("prefill", workers["prefill"])])


def test_kv_checksum_end_to_end(workers: dict[str, str]) -> None:
    # a router started by an earlier test replaced the prefill worker's targets with its own decode set
    register_kv_targets(workers["prefill"], [workers["decode"], workers["decode_checksum"]])
    plain = _generate_via(workers["decode"], workers["prefill"], "no-checksum")
    checked = _generate_via(workers["decode_checksum"], workers["prefill"], "with-checksum")
    assert checked == plain and len(checked) == 4
    info = worker_info(workers["decode_checksum"], "decode")
    assert info.kv_bytes_received > 0 and info.prefill_tokens_computed == 0  # it came through shm, not recompute
    wait_idle([("decode", workers["decode_checksum"]), ("prefill", workers["prefill"])])
