"""pdserve: disaggregated prefill/decode LLM serving.

This folder is the root of the ``pdserve`` package and holds the runtime code every process shares:
transport (channels, tokens), serving (gRPC server set-up, call limits), limits, timeouts, devices,
process_config, extras, failures (the typed errors), tokenization, prefix_hashing and model_cache.
None of them imports a subpackage other than the wire contract.

The subpackages live in the repository's top-level folders (the design card's layout: engine/,
router/, prefill_worker/, ...); each is here as a committed relative symlink (``pdserve/engine ->
../engine``), and the generated wire contract ``pdserve.v1`` as ``pdserve/v1 ->
../proto/pdserve/v1``. So ``pdserve.engine.block_pool`` is a file path every tool follows: Python
with the repository root on ``sys.path``, an editable install (a plain path entry), mypy, ruff and
an editor's go-to-definition; a wheel build copies the folders in. README "Development" says why.
"""
