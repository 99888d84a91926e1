"""Decode worker: takes prompts' KV from prefill workers into its paged pool and runs the
continuous-batching decode loop, streaming tokens back to the router.

Invariants: one loop thread owns the engine (every engine call is a closure run there); blocks
for a remote prefill are reserved before the KV transfer starts and are freed on finish, cancel,
transfer failure or deadline (`abort`); the worker never runs a forward pass over a prompt unless
it is colocated, the prompt is below the local-prefill threshold, or a preempted sequence is
recomputed. Nothing here imports `prefill_worker` or `router`.
"""
