"""Process logging: ``configure_logging(process, level, fmt)`` with ``fmt`` "text" or "json".

Text lines: ``<time> <LEVEL> [<process> <pid>] <logger>: <message>``. JSON lines: one object per line
with ``ts``, ``level``, ``process``, ``pid``, ``logger``, ``message`` and every extra field a call passes
(``log.info("...", extra={"request_id": rid})`` adds ``"request_id"``); an exception adds ``exc_info``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import datetime, timezone

from pdserve.constants import LOG_FORMATS

_STANDARD_ATTRS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record; non-JSON extra values are written as their ``str``."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self._process = process

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, tz=timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "process": self._process,
            "pid": record.process,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                doc[key] = value
        if record.exc_info:
            doc["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def make_formatter(process: str, fmt: str) -> logging.Formatter:
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    if fmt == "json":
        return JsonFormatter(process)
    return logging.Formatter(f"%(asctime)s %(levelname)s [{process} {os.getpid()}] %(name)s: %(message)s")


def configure_logging(process: str, level: str = "INFO", fmt: str = "text") -> None:
    """Send this process's logs to stderr in ``fmt``; replaces any handler already on the root logger."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(make_formatter(process, fmt))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
