"""Structured logs: one JSON object per line, carrying the request id of the request being served.

Nothing here ever sees a token: the access log records method, route, status, sizes and
the token's *name*. As a second line of defence, :class:`JsonFormatter` blanks anything
that looks like an ``Authorization`` value in a message.
"""

from __future__ import annotations

import json
import logging
import re
import traceback
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

__all__ = ["JsonFormatter", "logging_config", "request_id_var"]

#: The id of the request the current task serves (None outside requests).
request_id_var: ContextVar[str | None] = ContextVar("weightsync_request_id", default=None)

_BEARER_RE = re.compile(r"(?i)(bearer\s+)[^\s\"',;]+")
_STD_ATTRS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "color_message"}
# One encoder for every line (json.dumps with options builds a new one per call).
_ENCODE = json.JSONEncoder(default=str, ensure_ascii=False).encode


def _scrub(text: str) -> str:
    return _BEARER_RE.sub(r"\1[redacted]", text)


class JsonFormatter(logging.Formatter):
    """``{"ts","level","logger","msg","request_id",…}``; fields passed with ``extra=`` are added."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": _scrub(record.getMessage()),
        }
        rid = getattr(record, "request_id", None) or request_id_var.get()
        if rid:
            doc["request_id"] = rid
        for key, value in vars(record).items():
            if key not in _STD_ATTRS and key not in doc and not key.startswith("_"):
                doc[key] = value
        if record.exc_info:
            doc["exc"] = _scrub("".join(traceback.format_exception(*record.exc_info)).rstrip())
        return _ENCODE(doc)


def logging_config(level: str = "info") -> dict[str, Any]:
    """A ``logging.config.dictConfig`` (and uvicorn ``log_config``) sending JSON lines to stderr."""
    lvl = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": "weightsync.service.logs.JsonFormatter"}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}},
        "root": {"handlers": ["stderr"], "level": "WARNING"},
        "loggers": {
            "weightsync": {"level": lvl, "handlers": ["stderr"], "propagate": False},
            "uvicorn": {"level": lvl, "handlers": ["stderr"], "propagate": False},
            "uvicorn.error": {"level": lvl, "handlers": ["stderr"], "propagate": False},
            # The service writes its own access log (weightsync.access) with the request id.
            "uvicorn.access": {"level": "WARNING", "handlers": ["stderr"], "propagate": False},
        },
    }
