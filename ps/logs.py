"""Logging of the daemons and tools: readable text lines, or one JSON object per line for log pipelines.

``setup_logging(level, "json")`` writes every record as ``{"time", "level", "logger", "message", ...}`` plus the
fields the call passed with ``extra=`` (``slots``, ``epoch``, ``server``, ``table``, ...), so replication,
failover and slot-move events can be filtered by slot, epoch or server without parsing the text. ``event``
builds those fields the same way everywhere (slots as ranges, ``"0-511,1024"``; several servers comma-joined).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterable
from typing import IO, Any

from tigana.ps.routing import format_slots

__all__ = ["FORMATS", "JsonFormatter", "TEXT_FORMAT", "event", "setup_logging", "slots_text"]

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Attributes every LogRecord has: whatever else a record carries came from ``extra=``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


def _plain(value: Any) -> Any:
    """A JSON-ready form of an ``extra=`` value (numpy scalars and arrays, sets; anything else as text)."""
    if hasattr(value, "tolist"):  # numpy scalar or array
        return value.tolist()
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601 with milliseconds), level, logger, message, the
    record's ``extra=`` fields, and ``exception`` with the traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        seconds = int(record.created)
        millis = int((record.created - seconds) * 1000)
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z",
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_") and key not in out:
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=_plain)


def setup_logging(level: str = "INFO", fmt: str = "text", stream: IO[str] | None = None) -> logging.Handler:
    """Send every log record at ``level`` or above to ``stream`` (default stderr) as text lines or, with
    ``fmt="json"``, one JSON object per line. Replaces the handler an earlier call installed; returns the new one.
    ``ValueError`` names a level or format it does not know."""
    name = str(level).upper()
    numeric = logging.getLevelName(name)
    if not isinstance(numeric, int):
        raise ValueError(f"log level: {level!r} is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
    if fmt not in FORMATS:
        raise ValueError(f"log format: {fmt!r} is not one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler._tigana = True  # type: ignore[attr-defined]  # so a later call replaces it
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_tigana", False)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(numeric)
    return handler


def event(name: str, *, slots: Iterable[int] | None = None, epoch: int | None = None,
          server: str | Iterable[str] | None = None, **more: Any) -> dict[str, Any]:
    """The ``extra=`` fields of a cluster event: ``event`` (its kind), ``slots`` (ranges) and ``slot_count``,
    ``epoch``, ``server`` (ids, comma-joined when several) and any other field given."""
    out: dict[str, Any] = {"event": name}
    if slots is not None:
        listed = [int(s) for s in slots]
        out["slots"], out["slot_count"] = format_slots(listed), len(set(listed))
    if epoch is not None:
        out["epoch"] = int(epoch)
    if server is not None:
        out["server"] = server if isinstance(server, str) else ",".join(sorted({str(s) for s in server}))
    out.update(more)
    return out


def slots_text(slots: Iterable[int], limit: int = 8) -> str:
    """Slots as ranges for a log line, ``"0-511,1024"``; past ``limit`` ranges the rest is counted, so a line
    stays short (the JSON ``slots`` field of ``event`` lists them all)."""
    ranges = format_slots(slots).split(",")
    if ranges == [""]:
        return "none"
    if len(ranges) <= limit:
        return ",".join(ranges)
    return ",".join(ranges[:limit]) + f",... ({len(ranges) - limit} more range(s))"
