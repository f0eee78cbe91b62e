"""OpenTelemetry spans for the control plane: optional, imported lazily, no-op without it.

Each control RPC is one SERVER span whose parent comes from the caller's W3C `traceparent`
gRPC metadata, so a checkpoint driven by one controller (or the coordinator) is one trace
across the fleet. Its phases (wait-ready, export, snapshot, write, discard, read, install)
are child spans.

Without the `opentelemetry-api` package, or without a configured tracer provider (the API's
default is a no-op), nothing is recorded and the cost is a few attribute lookups.

The active operation span is kept in a context variable of our own rather than attached as
OpenTelemetry's current context for the whole RPC: a Prepare stream is an async generator,
and a generator finalized in another context could not detach it. Phases (plain coroutines)
are attached as current, so spans that a server's own hooks create nest under them.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from rollout_checkpoint.server.core.rpc.tracing import extract_parent
from rollout_checkpoint.server.core.rpc.tracing import otel as _api
from rollout_checkpoint.server.runtime.logs import reset_quietly

TRACER_NAME = "rollout_checkpoint.server"
_SPAN: contextvars.ContextVar[Any] = contextvars.ContextVar("rollout_checkpoint_span", default=None)


def current_span() -> Any:
    """The active operation or phase span (ours, else OpenTelemetry's current one)."""
    span = _SPAN.get()
    if span is not None:
        return span
    api = _api()
    return None if api is None else api.trace.get_current_span()


def current_trace_ids() -> tuple[str, str]:
    """(trace id, span id) in hex of the active span; empty strings when there is none."""
    span = current_span()
    if span is None:
        return "", ""
    context = span.get_span_context()
    if not context.is_valid:
        return "", ""
    return format(context.trace_id, "032x"), format(context.span_id, "016x")


class Tracing:
    """Spans of one runtime; `tracer_provider` None means OpenTelemetry's global provider."""

    def __init__(self, tracer_provider: Any = None) -> None:
        self._provider = tracer_provider
        self._tracer: Any = None

    @property
    def tracer(self) -> Any | None:
        api = _api()
        if api is None:
            return None
        if self._tracer is None:
            self._tracer = api.trace.get_tracer(TRACER_NAME, tracer_provider=self._provider)
        return self._tracer

    def start_server_span(
        self,
        name: str,
        metadata: Iterable[tuple[str, Any]] | None,
        attributes: Mapping[str, str] | None = None,
    ) -> Any | None:
        """A SERVER span parented by the caller's `traceparent` (a new trace without one)."""
        tracer = self.tracer
        if tracer is None:
            return None
        api = _api()
        return tracer.start_span(
            name,
            context=extract_parent(metadata),
            kind=api.trace.SpanKind.SERVER,
            attributes=dict(attributes or {}),
        )

    @contextlib.contextmanager
    def activate(self, span: Any) -> Iterator[None]:
        """Make `span` the parent of phases started inside (and of tasks started inside)."""
        token = _SPAN.set(span)
        try:
            yield
        finally:
            reset_quietly(_SPAN, token)

    @contextlib.contextmanager
    def phase(self, name: str, attributes: Mapping[str, str] | None = None) -> Iterator[Any]:
        """A child span of the active span, current for the block (hooks' spans nest in it)."""
        tracer = self.tracer
        parent = _SPAN.get()
        if tracer is None or parent is None:
            yield None
            return
        api = _api()
        context = api.trace.set_span_in_context(parent)
        with tracer.start_as_current_span(
            name, context=context, attributes=dict(attributes or {})
        ) as span:
            token = _SPAN.set(span)
            try:
                yield span
            finally:
                reset_quietly(_SPAN, token)

    def record_phase(self, name: str, started_ns: int, attributes: Mapping[str, Any]) -> None:
        """A child span of the active span that began at `started_ns` and ends now."""
        tracer = self.tracer
        parent = _SPAN.get()
        if tracer is None or parent is None:
            return
        api = _api()
        span = tracer.start_span(
            name,
            context=api.trace.set_span_in_context(parent),
            start_time=started_ns,
            attributes=dict(attributes),
        )
        span.end(end_time=max(started_ns, time.time_ns()))


def end_span(span: Any, outcome: str, checkpoint_id: str) -> None:
    """Finish an operation span with its outcome (`ok` or the ErrorInfo reason)."""
    if span is None:
        return
    api = _api()
    if checkpoint_id:
        span.set_attribute("rollout_checkpoint.checkpoint_id", checkpoint_id)
    span.set_attribute("rollout_checkpoint.outcome", outcome)
    if outcome != "ok" and api is not None:
        span.set_status(api.trace.Status(api.trace.StatusCode.ERROR, outcome))
    span.end()
