"""A worker process that can change role (prefill, decode, colocated) at runtime; see `elastic_worker.worker`."""
