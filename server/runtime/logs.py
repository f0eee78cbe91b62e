"""Structured logs: the checkpoint id (and trace id) on every line, never the token.

The id travels in a context variable, set by the sidecar for the duration of each control
RPC (and by the control plane around its own background duties, such as a lease expiry).
Tasks started inside an RPC (a commit's export and write, a restore's install) inherit it,
so their lines carry the id of the checkpoint they work for.

`ContextFilter` copies it onto every record that passes a handler: add it to a handler (as
`configure_logging` does), not to a logger, so records propagated from child loggers get it
too. `JsonFormatter` writes one JSON object per line. Secrets given to the filter are
replaced in every message, as a last line of defence: nothing in this project logs the
token, and a test checks it.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any

CHECKPOINT_ID: contextvars.ContextVar[str] = contextvars.ContextVar(
    "rollout_checkpoint_checkpoint_id", default=""
)
REDACTED = "[REDACTED]"


def current_checkpoint_id() -> str:
    return CHECKPOINT_ID.get()


@contextlib.contextmanager
def checkpoint_context(checkpoint_id: str) -> Iterator[None]:
    """Log lines inside this block (and tasks started in it) carry `checkpoint_id`."""
    token = CHECKPOINT_ID.set(checkpoint_id)
    try:
        yield
    finally:
        reset_quietly(CHECKPOINT_ID, token)


def reset_quietly(var: contextvars.ContextVar[Any], token: contextvars.Token[Any]) -> None:
    """Reset a context variable; a generator finalized in another context cannot, and
    then the value simply dies with that context."""
    with contextlib.suppress(ValueError, RuntimeError):
        var.reset(token)


class ContextFilter(logging.Filter):
    """Adds `checkpoint_id`, `trace_id` and `span_id` to each record; redacts secrets."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets = tuple(s for s in secrets if s)

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "checkpoint_id", ""):
            record.checkpoint_id = CHECKPOINT_ID.get()
        if not hasattr(record, "trace_id"):
            record.trace_id, record.span_id = _trace_ids()
        if self.secrets:
            self._redact(record)
        return True

    def _redact(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        redacted = message
        for secret in self.secrets:
            redacted = redacted.replace(secret, REDACTED)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            for secret in self.secrets:
                record.exc_text = record.exc_text.replace(secret, REDACTED)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, checkpoint_id, trace ids."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": _iso(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "checkpoint_id": getattr(record, "checkpoint_id", "") or CHECKPOINT_ID.get(),
        }
        trace_id = getattr(record, "trace_id", "")
        if trace_id:
            line["trace_id"] = trace_id
            line["span_id"] = getattr(record, "span_id", "")
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line["exception"] = record.exc_text
        return json.dumps(line, ensure_ascii=False, default=str)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [checkpoint_id=%(checkpoint_id)s]: %(message)s"


def configure_logging(
    level: str | int = "WARNING",
    *,
    json_lines: bool = False,
    secrets: Iterable[str] = (),
    stream: IO[str] | None = None,
) -> logging.Handler:
    """Log to `stream` (stderr) through the context filter, as JSON lines or as text.

    Replaces the root logger's handlers, so every logger that propagates (uvicorn's too when
    it is run with `log_config=None`) writes through it."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(ContextFilter(secrets))
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    return handler


def _iso(created: float) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
    return f"{seconds}.{int(created % 1 * 1000):03d}Z"


def _trace_ids() -> tuple[str, str]:
    from rollout_checkpoint.server.runtime.tracing import current_trace_ids

    return current_trace_ids()
