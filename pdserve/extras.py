"""Optional dependencies, installed with pdserve's extras.

- ``pdserve[ray]``: ``ray[default]`` - the Ray deployment (``pdserve serve --ray``, ``scale``,
  ``status --address``) and the ``ray`` KV backend.
- ``pdserve[capacity]``: ``matplotlib`` (``pdserve sweep``'s plots) and ``rich`` (``pdserve bench`` and
  ``sweep``'s progress bar and result table).

Modules that need one import it through :func:`require`, or raise :func:`missing_extra` when the import
fails, so that a missing extra is one clear
error naming the extra, not a bare ``ModuleNotFoundError``. Nothing else imports these packages at
module level.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# module -> (extra, distribution to name in the message)
EXTRAS = {
    "ray": ("ray", "ray[default]"),
    "matplotlib": ("capacity", "matplotlib"),
    "rich": ("capacity", "rich"),
}


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message says which extra provides it."""


def missing_extra(module: str, feature: str) -> MissingExtra:
    """The error for `feature` (words for the message) when `module` (a key of EXTRAS) is not installed."""
    extra, distribution = EXTRAS[module]
    return MissingExtra(
        f"{feature} needs {distribution}, which is not installed: install pdserve's '{extra}' "
        f"extra (pip install 'pdserve[{extra}]')"
    )


def require(module: str, feature: str) -> ModuleType:
    """Import `module` (a key of EXTRAS) for `feature` (words for the error message), or raise MissingExtra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise missing_extra(module, feature) from exc
