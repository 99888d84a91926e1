"""The names and default limits several pdserve processes and packages must agree on, in one place.

Before this module a launcher that could not import the module owning a name (because that module
pulls torch or numpy) kept a copy of it with a comment naming the original; copies drift. Everything
here is a plain literal, so the router, the launchers and the config schema import it without
loading torch, and the packages that own the behaviour (`router.policies`, `engine.sim_runner`,
`telemetry.logs`, `kv_transfer.ray_backend`) import their names from here too.

Request-size and call limits live beside this module in `pdserve.limits`; the default model's name
in `pdserve.model_cache`.

Hand-written (not generated); imports nothing.
"""

from __future__ import annotations

#: The interface every internal service (workers, the router's /metrics) binds unless told otherwise.
LOOPBACK = "127.0.0.1"
#: Deployment modes of `pdserve serve`: processes on this machine, or Ray actors.
MODES = ("local", "ray")
#: Worker selection policies of the router (`router.policies`).
POLICY_NAMES = ("round_robin", "least_loaded", "prefix_affinity", "kv_aware", "kv_oracle")
#: The policies that hash prompts with the served model's tokenizer (the router then needs --tokenizer).
KV_POLICIES = ("kv_aware", "kv_oracle")
#: What runs a worker's forward pass: the model, or the simulated engine (`engine.sim_runner`).
ENGINES = ("model", "sim")
#: Log line formats (`telemetry.logs`) and levels of every process.
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: KV transfer backends a decode worker can name, "auto" choosing per prefill worker.
KV_BACKENDS = ("auto", "grpc", "shm", "ray")
#: Whether the K/V of a prompt leaves once the prompt is done, or layer by layer during the pass.
KV_STREAMING = ("request", "layer")
#: Checksums of the shm backend ("": off).
KV_CHECKSUMS = ("", "xxh3", "crc32")
#: Ray placement strategies of `pdserve serve --ray`.
PLACEMENTS = ("auto", "pack", "spread", "strict_spread")
#: Ray namespace of every named pdserve actor (the controller, the workers the "ray" KV backend calls).
RAY_NAMESPACE = "pdserve"

#: Default deadline of one request end to end (s): the client's, the router's stream cap, the HTTP
#: API's, and a decode worker's per-request deadline.
REQUEST_TIMEOUT_S = 600.0

#: A metrics port meaning "any free port": the process binds port 0 and announces the port it got in
#: its ready line (the local launcher asks for this, so that no other process can take a port picked
#: for a worker while that worker loads its model).
METRICS_ANY_PORT = -1
