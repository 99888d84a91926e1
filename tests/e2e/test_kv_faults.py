"""A faulty prefill peer (a test double in this process) against a real decode worker process:
corrupted or mismatched KV fails only its own request, and every block comes back."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import torch

from pdserve.cluster.local import LocalCluster
from pdserve.kv_transfer import KvSpec
from pdserve.kv_transfer.base import dtype_name
from pdserve.kv_transfer.framing import encode_frames
from pdserve.transport import open_channel
from pdserve.v1 import common_pb2, kv_pb2_grpc, worker_pb2, worker_pb2_grpc

from e2e_helpers import generate, wait_idle


class RoguePrefill(worker_pb2_grpc.PrefillWorkerServicer):
    """Answers Prefill by pushing KV that is wrong in one way (`mode`)."""

    def __init__(self, loaded, mode: str) -> None:  # noqa: ANN001
        self.loaded = loaded
        self.mode = mode

    def _frames(self, request: worker_pb2.PrefillRequest) -> Iterator:
        shape = self.loaded.kv_shape(16)
        n = -(-len(request.prompt_token_ids) // 16)
        spec = KvSpec(
            request_id=request.request_id,
            model_fingerprint=self.loaded.fingerprint,
            dtype=dtype_name(shape.dtype),
            shape=(shape.num_layers, 2, n, 16, shape.num_kv_heads, shape.head_dim),
            block_size=16,
            num_tokens=len(request.prompt_token_ids),
        )
        if self.mode == "fingerprint":
            spec = KvSpec(**{**spec.__dict__, "model_fingerprint": "another-model"})
        for i, frame in enumerate(encode_frames(spec, torch.randn(spec.shape), 7, max_frame_bytes=1 << 20)):
            if self.mode == "checksum" and i == 1:
                frame.data = bytes([frame.data[0] ^ 0xFF]) + frame.data[1:]
            yield frame

    def Prefill(self, request, context):  # noqa: ANN001, ANN201, N802
        if self.mode == "internal":  # what a prefill worker answers when its step broke on this request
            context.abort(grpc.StatusCode.INTERNAL, "prefill failed: poisoned prompt")
        stub = kv_pb2_grpc.KvTransferStub(open_channel(request.kv_target_address))  # with the internal token
        ack = stub.PushKv(self._frames(request), timeout=30)
        if not ack.ok:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"KV refused: {ack.error}")
        return worker_pb2.PrefillResponse(request_id=request.request_id, first_token_id=7)


@pytest.fixture(scope="module")
def cluster(default_1p1d: LocalCluster) -> LocalCluster:
    """The session's default-model 1P1D cluster (tests/conftest.py): what this module started before."""
    return default_1p1d


@pytest.mark.parametrize("mode", ["checksum", "fingerprint"])
def test_bad_kv_fails_only_its_request(mode: str, cluster, default_model) -> None:  # noqa: ANN001
    server = grpc.server(futures.ThreadPoolExecutor(4))
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(RoguePrefill(default_model, mode), server)
    rogue = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        decode = [w[2] for w in cluster.workers if w[0] == "decode"][0]
        stub = worker_pb2_grpc.DecodeWorkerStub(open_channel(decode))
        bad = stub.Generate(
            worker_pb2.DecodeRequest(
                request_id=f"bad-{mode}",
                prompt="The river ran past the old mill " * 5,
                prefill_address=rogue,
                params=common_pb2.SamplingParams(max_tokens=5),
            ),
            timeout=60,
        )
        good = generate(cluster.router_address, "The capital of France is", 6)
        with pytest.raises(grpc.RpcError) as err:
            list(bad)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert ("checksum" if mode == "checksum" else "fingerprint") in err.value.details()
        assert len(good.token_ids) == 6
        wait_idle([(w[0], w[2]) for w in cluster.workers])
    finally:
        server.stop(0)


def test_a_prefill_step_fault_is_passed_on_as_the_requests_not_the_workers(cluster, default_model) -> None:  # noqa: ANN001
    """Issue 29 row 1: INTERNAL from the prefill worker (its step broke on this request) reaches the
    router as INTERNAL, a request fault it retries once without suspecting the worker, not as
    UNAVAILABLE, which marks the prefill worker unhealthy for everyone."""
    server = grpc.server(futures.ThreadPoolExecutor(4))
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(RoguePrefill(default_model, "internal"), server)
    rogue = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        decode = [w[2] for w in cluster.workers if w[0] == "decode"][0]
        stub = worker_pb2_grpc.DecodeWorkerStub(open_channel(decode))
        with pytest.raises(grpc.RpcError) as err:
            list(
                stub.Generate(
                    worker_pb2.DecodeRequest(
                        request_id="bad-internal",
                        prompt="The river ran past the old mill",
                        prefill_address=rogue,
                        params=common_pb2.SamplingParams(max_tokens=5),
                    ),
                    timeout=60,
                )
            )
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert err.value.details().startswith(f"prefill failed on {rogue}") and "poisoned" in err.value.details()
        wait_idle([(w[0], w[2]) for w in cluster.workers])
    finally:
        server.stop(0)
