"""pdserve: disaggregated prefill/decode LLM serving.

This folder is the root of the ``pdserve`` namespace and holds the runtime code every process
shares: transport (channels, tokens), serving (gRPC server set-up, call limits), limits, timeouts,
devices, process_config, extras, failures (the typed errors), tokenization, prefix_hashing and
model_cache. None of them imports a subpackage other than the wire contract. The subpackages are
top-level folders of the repository, mapped into the namespace by pyproject.toml's ``package-dir``
(the one list of them); the generated wire contract ``pdserve.v1`` lives in ``proto/pdserve/v1``
beside its .proto files.

An install (``./run`` makes an editable one) maps the folders. A bare source checkout with only the
repository root on ``sys.path`` (a device machine, a process started with ``PYTHONPATH``) has no
mapping, so this package's ``__path__`` also covers the repository root and ``proto/pdserve``: the
same ``pdserve.*`` imports then work without installing.
"""

import os as _os

_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_ROOT, "pyproject.toml")) and _os.path.isfile(
        _os.path.join(_ROOT, "engine", "__init__.py")):
    for _extra in (_ROOT, _os.path.join(_ROOT, "proto", "pdserve")):
        if _extra not in __path__:
            __path__.append(_extra)
