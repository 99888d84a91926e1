"""pdserve: disaggregated prefill/decode LLM serving.

Subpackages: ``pdserve.engine``, ``pdserve.router``, ``pdserve.prefill_worker``, ``pdserve.decode_worker``,
``pdserve.kv_transfer``, ``pdserve.cluster``, ``pdserve.capacity``, ``pdserve.telemetry``, the shared
helpers here (``pdserve.devices``, ``pdserve.transport``, ...) and the generated wire contract
``pdserve.v1``. An installed wheel maps the folders with setuptools' package-dir. In a source checkout
(``proto/`` on sys.path) they stay top-level folders of the repository: this package's ``__path__``
then also covers the repository root, so the same ``pdserve.*`` imports work without installing.
"""

import os as _os

_ROOT = _os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
if (_os.path.isfile(_os.path.join(_ROOT, "pyproject.toml"))
        and _os.path.isfile(_os.path.join(_ROOT, "engine", "__init__.py"))
        and _ROOT not in __path__):
    __path__.append(_ROOT)
