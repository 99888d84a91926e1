"""The process plumbing every worker role shares (``runtime``): its gRPC server, the KV events and
info services, signals, draining and the command line common to prefill, decode and elastic workers.
It sits above the engine and below the role packages, so the engine imports neither grpc nor the
wire stubs."""
