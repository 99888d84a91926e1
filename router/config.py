"""RouterConfig: everything the router process needs, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.limits import RECEIVE_LIMIT_BYTES
from pdserve.router.policies import COLOCATED, DECODE, POLICY_NAMES, PREFILL
from pdserve.router.worker_pool import WorkerEndpoint
from pdserve.settings import ObservabilitySection, RouterSection
from pdserve.transport import is_loopback

MAX_RECEIVE_MESSAGE_BYTES = RECEIVE_LIMIT_BYTES  # requests above pdserve.limits.MAX_REQUEST_BYTES get 400


@dataclass(frozen=True)
class RouterConfig:
    """Addresses of the workers, selection policies, deadlines and server sizing. The settings a
    deployment configures default to their `pdserve.settings` field; `port` is 0 (a free one), the
    library's choice for tests and embedding.

    Decode workers need at least one prefill worker; colocated workers prefill themselves. A router
    with no workers at all is allowed (it validates requests and answers UNAVAILABLE).
    """

    host: str = RouterSection.host
    port: int = 0
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    colocated: tuple[str, ...] = ()
    prefill_policy: str = RouterSection.prefill_policy
    decode_policy: str = RouterSection.decode_policy
    max_stream_timeout_s: float = RouterSection.max_stream_timeout_s
    info_timeout_s: float = 2.0
    poll_interval_s: float = 0.5
    # requests at workers at once (more wait in the admission queue); waiting for a decode slot (one more is
    # refused: 429); (decode, prefill) pairs a request is tried on
    max_concurrent_streams: int = RouterSection.max_concurrent_streams
    max_queued_requests: int = RouterSection.max_queued_requests
    max_attempts: int = RouterSection.max_attempts
    # on stop: open requests get this long to finish before they fail UNAVAILABLE (RouterServer.drain)
    drain_timeout_s: float = RouterSection.drain_timeout_s
    auth_token: str | None = None  # when set, Router calls need "authorization: Bearer <token>"
    # several tokens, as (token, tenant) pairs (--auth-tokens-file): each tenant's requests get their own
    # prefix-cache namespace (the tenant is folded into their cache_salt); not combined with auth_token
    auth_tokens: tuple[tuple[str, str], ...] = ()
    tls_cert_file: str | None = None  # PEM certificate chain: serve the public port over TLS
    tls_key_file: str | None = None
    http_port: int | None = RouterSection.http_port  # OpenAI HTTP API on host:http_port (0 picks one; None: off)
    metrics_port: int = 0  # Prometheus /metrics on metrics_host:metrics_port (0: off; -1: any free port)
    metrics_host: str = ObservabilitySection.metrics_host  # beyond loopback only with auth_token (scrapes need it)
    model_name: str = "default"  # the model id the HTTP API serves
    decode_mux: bool = RouterSection.decode_mux  # one GenerateMux call per decode worker, not a call per request
    # when no worker of a stage is healthy but some are still registered (their launcher restarts them:
    # Ray actors with max_restarts), requests wait this long for one to serve again instead of failing
    # (0: fail at once, as for workers nobody restarts)
    worker_restart_wait_s: float = 0.0
    # KV-aware routing (policies kv_aware / kv_oracle): the tokenizer (model folder) the router hashes
    # prompts with; kv_aware's decode weights; conditional disaggregation's threshold (a request with
    # fewer uncached tokens on its decode worker is prefilled there; 0: always disaggregate)
    tokenizer: str = ""
    kv_request_tokens: float = RouterSection.kv_aware_request_tokens
    kv_kv_tokens: float = RouterSection.kv_aware_kv_tokens
    conditional_disagg_tokens: int = RouterSection.conditional_disagg_tokens
    # SLO admission: refuse (RESOURCE_EXHAUSTED, Retry-After) a request whose predicted TTFT exceeds
    # this (seconds; 0: off); GenerateRequest.best_effort requests are admitted anyway
    slo_ttft_s: float = RouterSection.slo_ttft_s
    # open gRPC calls on the public port: per client host, and of all clients (one more: RESOURCE_EXHAUSTED)
    grpc_calls_per_peer: int = RouterSection.grpc_calls_per_peer
    grpc_calls_total: int = RouterSection.grpc_calls_total
    # public gRPC connections: closed after this long without a call; told to go away after this age (0: never)
    grpc_connection_idle_s: float = RouterSection.grpc_connection_idle_s
    grpc_connection_age_s: float = RouterSection.grpc_connection_age_s

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("prefill_policy", "decode_policy"):
            if getattr(self, name) not in POLICY_NAMES:
                raise ValueError(f"{name} must be one of {', '.join(POLICY_NAMES)}, got {getattr(self, name)!r}")
        if self.decode and not self.prefill:
            raise ValueError("decode workers need at least one prefill worker (or use colocated workers)")
        for name in ("max_stream_timeout_s", "info_timeout_s", "poll_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("http_port", "metrics_port"):
            value = getattr(self, name)
            lowest = -1 if name == "metrics_port" else 0  # -1: any free port (constants.METRICS_ANY_PORT)
            if value is not None and not lowest <= value <= 65535:
                raise ValueError(f"{name} must be in [{lowest}, 65535], got {value}")
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("auth_token must not be empty")
        if self.auth_token and self.auth_tokens:
            raise ValueError("auth_token and auth_tokens exclude each other: give each client a tenant token")
        if any(not token or not tenant for token, tenant in self.auth_tokens):
            raise ValueError("auth_tokens: every token and tenant must be non-empty")
        if not is_loopback(self.metrics_host) and not self.auth_token:
            raise ValueError(
                f"refusing to serve /metrics on {self.metrics_host}, beyond loopback, without an "
                "auth token (--auth-token-file or PDSERVE_AUTH_TOKEN)"
            )
        if self.worker_restart_wait_s < 0:
            raise ValueError(f"worker_restart_wait_s must be >= 0, got {self.worker_restart_wait_s}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        for name in ("grpc_calls_per_peer", "grpc_calls_total"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.grpc_connection_idle_s > 0 or self.grpc_connection_age_s < 0:
            raise ValueError(
                "grpc_connection_idle_s must be > 0 and grpc_connection_age_s >= 0, got "
                f"{self.grpc_connection_idle_s} and {self.grpc_connection_age_s}"
            )
        if self.max_concurrent_streams < 1:
            raise ValueError(f"max_concurrent_streams must be >= 1, got {self.max_concurrent_streams}")
        for name in ("kv_request_tokens", "kv_kv_tokens", "conditional_disagg_tokens", "slo_ttft_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        self.endpoints()  # validates addresses and uniqueness

    @property
    def api_tokens(self) -> dict[str, str | None] | None:
        """The public API's tokens with their tenants (None for the single token); None when open."""
        if self.auth_tokens:
            return dict(self.auth_tokens)
        return {self.auth_token: None} if self.auth_token else None

    def endpoints(self) -> list[WorkerEndpoint]:
        """Every configured worker, prefill first, then decode, then colocated."""
        endpoints = [WorkerEndpoint(a, PREFILL) for a in self.prefill]
        endpoints += [WorkerEndpoint(a, DECODE) for a in self.decode]
        endpoints += [WorkerEndpoint(a, COLOCATED) for a in self.colocated]
        addresses = [e.address for e in endpoints]
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"worker addresses must be unique, got {addresses}")
        return endpoints
