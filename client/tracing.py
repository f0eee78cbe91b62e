"""Trace context for controllers: W3C `traceparent` into every participant call's metadata.

When a span is active in the caller (a controller's own span, or the coordinator's span of
the RPC it serves), `ParticipantClient` sends its context as `traceparent` (and
`tracestate`) gRPC metadata; participants parent their operation spans to it, so one
checkpoint across the whole fleet is one trace. OpenTelemetry is optional: without it, or
with no span active, nothing is added.

The coordinator's RPC handlers open a SERVER span (parented to its own caller's
`traceparent`, if any) with `server_span`; the participant calls they make inherit it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

TRACER_NAME = "rollout_checkpoint.client"
_api_module: Any = None
_api_missing = False
_tracer_provider: Any = None


def _api() -> Any:
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


def set_tracer_provider(provider: Any) -> None:
    """Use `provider` for the coordinator's spans (default: OpenTelemetry's global one)."""
    global _tracer_provider
    _tracer_provider = provider


def context_metadata() -> tuple[tuple[str, str], ...]:
    """`traceparent`/`tracestate` of the active span, as gRPC metadata (empty without one)."""
    api = _api()
    if api is None:
        return ()
    carrier: dict[str, str] = {}
    api.propagate.inject(carrier)
    return tuple((key, value) for key, value in carrier.items() if key in _PROPAGATED)


_PROPAGATED = frozenset({"traceparent", "tracestate"})


@contextlib.contextmanager
def server_span(
    name: str, metadata: Iterable[tuple[str, Any]] | None, **attributes: str
) -> Iterator[Any]:
    """A SERVER span for one coordinator RPC, current for the block (None without OTel)."""
    api = _api()
    if api is None:
        yield None
        return
    carrier = {k: v for k, v in metadata or () if isinstance(v, str)}
    parent = api.propagate.extract(carrier)
    tracer = api.trace.get_tracer(TRACER_NAME, tracer_provider=_tracer_provider)
    with tracer.start_as_current_span(
        name, context=parent, kind=api.trace.SpanKind.SERVER, attributes=attributes
    ) as span:
        yield span
