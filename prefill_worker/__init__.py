"""Prefill worker: batches queued prompts, runs one forward pass over each whole prompt, samples
the first token and ships the prompt's KV blocks straight to the decode worker that asked.

Invariants: the engine (model, KV pool) is touched by one loop thread only, except that transfer
threads read the blocks of the requests they ship and return them through `_release`; a
request's blocks are freed exactly once, after the decode side acknowledged the KV or the
transfer failed. Nothing here imports `decode_worker` or `router`.
"""
