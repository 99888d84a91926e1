"""pdserve's router: the client-facing gRPC front end.

Role: validate each GenerateRequest, pick one prefill and one decode worker by policy, call
DecodeWorker.Generate on the chosen decode worker and relay its stream to the client.

Invariants:
- Imports only grpc, grpc health/reflection, the generated ``pdserve.v1`` stubs, ``telemetry``
  (logging, tracing, Prometheus) and aiohttp (``router.http_api``, the OpenAI-compatible HTTP API) - never
  ``engine``, and torch or transformers only when a KV-aware policy loads the model's tokenizer
  (transformers then loads torch); ``tests/test_import_rules.py`` checks this.
- Never carries KV bytes: KV goes from the prefill worker straight to the decode worker. Tokenizes only
  for the KV-aware policies (`kv_index.py`: the prompt's block keys), with the model's tokenizer.
- Every internal call has a deadline.
"""
