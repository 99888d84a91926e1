"""The process plumbing every worker role shares (``runtime``): its gRPC server, the KV events and
info services, signals and draining; and the typed config part common to prefill, decode and
elastic workers with the flags generated from it (``config``, torch-free).
It sits above the engine and below the role packages, so the engine imports neither grpc nor the
wire stubs."""
