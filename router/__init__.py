"""pdserve's router: the client-facing gRPC front end.

Role: validate each GenerateRequest, pick one prefill and one decode worker by policy, call
DecodeWorker.Generate on the chosen decode worker and relay its stream to the client.

Invariants:
- Imports only grpc, grpc health/reflection, the generated ``pdserve.v1`` stubs, ``telemetry``
  (logging, tracing, Prometheus) and aiohttp (``router.http_api``, the OpenAI-compatible HTTP API) - never
  torch, transformers or ``engine``; ``tests/router/test_router_relay.py`` checks this.
- Never tokenizes and never carries KV bytes: KV goes from the prefill worker straight to the decode worker.
- Every internal call has a deadline.
"""
