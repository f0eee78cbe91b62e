"""W3C trace context over gRPC metadata: OpenTelemetry optional, imported lazily.

Controllers send the active span's context as `traceparent` (and `tracestate`) metadata on
every participant call (`context_metadata`); servers parent each RPC's SERVER span to the
caller's (`extract_parent`, `server_span`), so one checkpoint across the fleet is one trace.
Without the `opentelemetry-api` package, or with no span active, nothing is added or recorded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

_api_module: Any = None
_api_missing = False
_PROPAGATED = frozenset({"traceparent", "tracestate"})


def otel() -> Any:
    """The `opentelemetry` package (trace and propagate loaded), or None without it."""
    global _api_module, _api_missing
    if _api_module is None and not _api_missing:
        try:
            import opentelemetry.propagate
            import opentelemetry.trace
        except ImportError:
            _api_missing = True
        else:
            _api_module = opentelemetry
    return _api_module


def context_metadata() -> tuple[tuple[str, str], ...]:
    """`traceparent`/`tracestate` of the active span, as gRPC metadata (empty without one)."""
    api = otel()
    if api is None:
        return ()
    carrier: dict[str, str] = {}
    api.propagate.inject(carrier)
    return tuple((key, value) for key, value in carrier.items() if key in _PROPAGATED)


def extract_parent(metadata: Iterable[tuple[str, Any]] | None) -> Any:
    """The caller's trace context from its gRPC metadata (OpenTelemetry must be present)."""
    carrier = {k: v for k, v in metadata or () if isinstance(v, str)}
    return otel().propagate.extract(carrier)


@contextlib.contextmanager
def server_span(
    tracer_name: str,
    name: str,
    metadata: Iterable[tuple[str, Any]] | None,
    *,
    tracer_provider: Any = None,
    **attributes: str,
) -> Iterator[Any]:
    """A SERVER span parented to the caller's `traceparent`, current for the block (None
    without OpenTelemetry). `tracer_provider` None means OpenTelemetry's global one."""
    api = otel()
    if api is None:
        yield None
        return
    tracer = api.trace.get_tracer(tracer_name, tracer_provider=tracer_provider)
    with tracer.start_as_current_span(
        name,
        context=extract_parent(metadata),
        kind=api.trace.SpanKind.SERVER,
        attributes=attributes,
    ) as span:
        yield span
