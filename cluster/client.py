"""PdserveClient: a small gRPC client of the router, used by the `pdserve` CLI and by tests.

Invariants: a ``generate`` stream that is abandoned (closed early or garbage collected) cancels its
call, which aborts the request on the workers; every call has a deadline.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType

import grpc

from pdserve.constants import REQUEST_TIMEOUT_S
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_TIMEOUT_S = REQUEST_TIMEOUT_S
FINISH_REASONS = {
    common_pb2.FINISH_REASON_UNSPECIFIED: "",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_STOP_STRING: "stop_string",
    common_pb2.FINISH_REASON_CANCELLED: "cancelled",
    common_pb2.FINISH_REASON_ERROR: "error",
}
ROLE_NAMES = {
    common_pb2.WORKER_ROLE_UNSPECIFIED: "unknown",
    common_pb2.WORKER_ROLE_PREFILL: "prefill",
    common_pb2.WORKER_ROLE_DECODE: "decode",
    common_pb2.WORKER_ROLE_COLOCATED: "colocated",
}
TIMING_FIELDS = ("tokenize_s", "queue_s", "prefill_s", "kv_transfer_s", "ttft_s", "decode_s", "detokenize_s", "e2e_s")


@dataclass(frozen=True)
class GenerationResult:
    """A whole generation, assembled from its stream."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # lower-case name: stop, length, stop_string, cancelled, error ("" if none)
    error: str
    usage: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def to_json_dict(self) -> dict[str, object]:
        """The `pdserve generate --json` object."""
        return {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            "timings": self.timings,
        }


def sampling_params(
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
) -> common_pb2.SamplingParams:
    """SamplingParams with only the given optional fields set (absent means server default)."""
    params = common_pb2.SamplingParams(
        top_k=top_k, stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos
    )
    if max_tokens is not None:
        params.max_tokens = max_tokens
    if temperature is not None:
        params.temperature = temperature
    if top_p is not None:
        params.top_p = top_p
    if seed is not None:
        params.seed = seed
    return params


def build_request(
    prompt: str | None = None,
    messages: Sequence[tuple[str, str]] | None = None,
    token_ids: Sequence[int] | None = None,
    params: common_pb2.SamplingParams | None = None,
    request_id: str = "",
) -> router_pb2.GenerateRequest:
    """A GenerateRequest from exactly one of prompt, messages ((role, content) pairs) or token_ids."""
    if sum(x is not None for x in (prompt, messages, token_ids)) != 1:
        raise ValueError("give exactly one of prompt, messages, token_ids")
    request = router_pb2.GenerateRequest(request_id=request_id)
    if prompt is not None:
        request.prompt = prompt
    elif messages is not None:
        turns = [common_pb2.ChatMessage(role=role, content=content) for role, content in messages]
        request.messages.CopyFrom(common_pb2.ChatMessages(messages=turns))
    else:
        request.token_ids.CopyFrom(common_pb2.TokenIds(ids=list(token_ids or ())))
    if params is not None:
        request.params.CopyFrom(params)
    return request


def collect(responses: Iterable[router_pb2.GenerateResponse]) -> GenerationResult:
    """Concatenate a stream into a GenerationResult (usage and timings from the last message)."""
    text: list[str] = []
    token_ids: list[int] = []
    last = router_pb2.GenerateResponse()
    for response in responses:
        text.append(response.text)
        token_ids.extend(response.token_ids)
        last = response
    usage = {
        "prompt_tokens": last.usage.prompt_tokens,
        "completion_tokens": last.usage.completion_tokens,
        "cached_tokens": last.usage.cached_tokens,
    }
    timings = {name: getattr(last.timings, name) for name in TIMING_FIELDS}
    return GenerationResult(
        last.request_id, "".join(text), token_ids, FINISH_REASONS[last.finish_reason], last.error, usage, timings
    )


class PdserveClient:
    """Client of one router. Thread-safe (one channel); close() or use as a context manager."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        token: str | None = None,
        tls_ca_file: str | None = None,
    ) -> None:
        """`token`: bearer token for a router started with an auth token; `tls_ca_file`: PEM of the CA
        (or self-signed certificate) to trust when the router serves TLS."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.address = address
        self.timeout_s = timeout_s
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        if tls_ca_file:
            with open(tls_ca_file, "rb") as f:
                self._channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(f.read()))
        else:
            self._channel = grpc.insecure_channel(address)
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    def generate(self, request: router_pb2.GenerateRequest) -> Iterator[router_pb2.GenerateResponse]:
        """Stream the responses of one request; raises grpc.RpcError on failure."""
        call = self._stub.Generate(request, timeout=self.timeout_s, metadata=self._metadata)
        try:
            yield from call
        finally:
            call.cancel()

    def complete(self, request: router_pb2.GenerateRequest) -> GenerationResult:
        """Run one request to the end and return the assembled result."""
        return collect(self.generate(request))

    def status(self) -> router_pb2.StatusResponse:
        """The router's GetStatus snapshot."""
        return self._stub.GetStatus(
            router_pb2.StatusRequest(), timeout=min(self.timeout_s, 10.0), metadata=self._metadata
        )

    def migrate(self, request_id: str, to_worker_id: str = "") -> router_pb2.MigrateResponse:
        """Move a running request to another decode worker (Router.Migrate)."""
        return self._stub.Migrate(
            router_pb2.MigrateRequest(request_id=request_id, to_worker_id=to_worker_id),
            timeout=self.timeout_s,
            metadata=self._metadata,
        )

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> PdserveClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def status_rows(status: router_pb2.StatusResponse) -> list[dict[str, object]]:
    """One plain dict per worker (the `pdserve status` table and its --json form)."""
    return [
        {
            "role": ROLE_NAMES.get(w.role, "unknown"),
            "worker_id": w.worker_id,
            "address": w.address,
            "pid": w.pid,
            "queue": w.queue_depth,
            "kv_used": w.kv_blocks_used,
            "kv_total": w.kv_blocks_total,
            "running": w.running_requests,
            "healthy": w.healthy,
            "node_id": w.node_id,
            "host": w.host,
            "kernels": w.kernels,
        }
        for w in status.workers
    ]


def placement_warnings(rows: list[dict[str, object]], cluster_nodes: int = 0) -> list[str]:
    """One line per pool whose workers (two or more) all run on one node of a multi-node cluster:
    losing that node loses the pool. `cluster_nodes`: the cluster's live nodes when known (0: judge
    by the nodes the workers run on)."""
    nodes = {str(r["node_id"]) for r in rows if r["node_id"]}
    if max(cluster_nodes, len(nodes)) < 2:
        return []
    warnings = []
    for role in dict.fromkeys(str(r["role"]) for r in rows):
        pool = [r for r in rows if r["role"] == role]
        where = {str(r["node_id"]) for r in pool}
        if len(pool) >= 2 and len(where) == 1 and "" not in where:
            warnings.append(
                f"all {len(pool)} {role} workers run on node {where.pop()[:12]}: losing that node "
                f"loses the {role} pool (serve with --placement spread)"
            )
    return warnings
