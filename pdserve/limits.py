"""The request limits every pdserve process agrees on: the request size, and the bounds of the
sampling fields the router and the engine both check (`logit_bias`).

The router refuses a request whose serialized `GenerateRequest` is larger than `MAX_REQUEST_BYTES`
with INVALID_ARGUMENT (HTTP 400) naming the limit. Every gRPC server and channel on the request path
accepts messages of `RECEIVE_LIMIT_BYTES` (twice the limit), so a request the router accepted is
never refused further on for its size (a `DecodeRequest` or `PrefillRequest` adds a few fields and,
after a failover, the tokens already delivered), and a request up to twice the limit reaches the
router's own check (with its clear message) instead of gRPC's RESOURCE_EXHAUSTED.

Hand-written (not generated); imports only the standard library.
"""

from __future__ import annotations

import resource

#: Largest serialized GenerateRequest the router accepts (8 MiB).
MAX_REQUEST_BYTES = 8 * 1024 * 1024
#: grpc.max_receive_message_length of every server and channel on the request path (16 MiB).
RECEIVE_LIMIT_BYTES = 2 * MAX_REQUEST_BYTES
#: Most `logit_bias` entries of one request, and the largest bias magnitude (OpenAI's range).
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0
#: Most `allowed_token_ids` and `bad_words` of one request, and the longest bad word (characters).
MAX_ALLOWED_TOKEN_IDS = 4096
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256
#: Longest structured-output spec (grammar, regex, JSON schema, choice list as JSON) of one request, in
#: characters: the router refuses a longer one, the engine checks again before compiling it.
MAX_STRUCTURED_CHARS = 64 * 1024
#: Most choices of one request (SamplingParams.n; OpenAI's bound).
MAX_N = 128
#: Concurrent gRPC calls one peer host may hold open on one server (router or worker), and all peers
#: together; a call beyond either is refused with RESOURCE_EXHAUSTED (`pdserve.serving.PeerCallLimiter`).
#: Above the 1,000 streams one client opens in the tests and the router's 256 requests at workers.
GRPC_CALLS_PER_PEER = 2048
GRPC_CALLS_TOTAL = 8192
#: HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS of every server (`grpc.max_concurrent_streams`): streams one
#: connection may open at once; a client over it waits for a slot (HTTP/2), it is not refused.
GRPC_STREAMS_PER_CONNECTION = 2048
#: A gRPC connection with no open call for this long gets a GOAWAY and is closed
#: (`grpc.max_connection_idle_ms`); one that has not finished its handshake (TLS, the HTTP/2 preface and
#: SETTINGS) within the shorter of this and GRPC_HANDSHAKE_S is closed too. So a client that sends
#: nothing, half a preface, or keeps an unused channel holds no socket for longer (gRPC's own default is
#: for ever, and 120 s for the handshake). A pdserve channel reconnects on its next call by itself.
GRPC_CONNECTION_IDLE_S = 60.0
GRPC_HANDSHAKE_S = 10.0
#: Server keepalive: ping a connection that has open calls after this many quiet seconds, and drop it
#: when the ping is not answered within GRPC_KEEPALIVE_TIMEOUT_S (a peer that vanished without closing
#: its socket no longer holds its calls and their KV blocks until their deadline).
GRPC_KEEPALIVE_S = 60.0
GRPC_KEEPALIVE_TIMEOUT_S = 20.0
#: Ping abuse, as gRPC's server defaults (stated so a change of them cannot go unnoticed): a client's ping
#: sooner than this after the last data (or any ping while it has no call) is a strike, and the
#: GRPC_PING_STRIKES + 1st strike closes the connection (GOAWAY "too_many_pings").
GRPC_MIN_PING_INTERVAL_S = 300.0
GRPC_PING_STRIKES = 2
#: Fraction of the process's file-descriptor limit one gRPC server may hold as connections
#: (`grpc.max_allowed_incoming_connections`: one over it is closed at once). The router's HTTP API takes
#: half (`router.http_api.default_max_connections`); the rest stays for worker channels and files.
GRPC_CONNECTIONS_SHARE = 0.25


def fd_share(share: float, at_least: int = 64) -> int:
    """`share` of the soft file-descriptor limit (at least `at_least`; 32,768 when unlimited)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(at_least, int(soft * share)) if soft != resource.RLIM_INFINITY else 32768


def receive_options(at_least: int = 0) -> list[tuple[str, int]]:
    """gRPC options accepting request-path messages (and ``at_least`` bytes, e.g. a KV frame)."""
    size = max(RECEIVE_LIMIT_BYTES, at_least)
    return [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size)]
