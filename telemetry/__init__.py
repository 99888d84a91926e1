"""pdserve's observability plumbing shared by the router and both worker roles.

Role: process logging (text or JSON lines, with the request id as a field), a gRPC server interceptor
that logs the start and finish of every request-carrying call with ``request_id=...``, and the
Prometheus ``/metrics`` endpoint.

Invariants: imports only the standard library, grpc and prometheus_client (never torch, transformers,
``engine`` or ``router``), so the router may use it; metric definitions live with their process
(``router.prom_metrics``, ``engine.metrics``), each in its own registry.
"""
