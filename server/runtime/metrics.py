"""Prometheus metrics of one participant runtime, on the HTTP app's path or a port of their own.

Every runtime has its own `CollectorRegistry` (a process may host several in tests, and the
global registry would mix them). Labels are bounded: operation names, outcomes (`ok` or an
ErrorInfo reason), phases, refusal reasons and readiness count names. Checkpoint ids are
unbounded and never a label: they go to traces and logs.

    rollout_checkpoint_operation_duration_seconds{operation,outcome}   histogram, every RPC
    rollout_checkpoint_phase_duration_seconds{phase}                   wait_ready/export/snapshot/write/
                                                                       discard/read/install
    rollout_checkpoint_records{operation}, rollout_checkpoint_bytes{operation}
                                                                       per commit and restore
    rollout_checkpoint_refusals_total{plane,reason}                    control: ErrorInfo reasons;
                                                                       data: admission_closed,
                                                                       awaiting_restore, stale_attempt,
                                                                       episode_mismatch
    rollout_checkpoint_lease_expiries_total
    rollout_checkpoint_prepare_not_ready_total                         prepares that reached their deadline
    rollout_checkpoint_prepare_drain_seconds                           admission closed -> ready
    rollout_checkpoint_readiness_count{count}                          the readiness report's counts
                                                                       (resources: inflight, sessions)
    rollout_checkpoint_blockers, rollout_checkpoint_admission_open,
    rollout_checkpoint_readiness_serving, rollout_checkpoint_state{state}
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollout_checkpoint.server.runtime.participant import AWAITING_RESTORE

log = logging.getLogger(__name__)

DURATION_BUCKETS = (0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
RECORD_BUCKETS = (0, 1, 10, 100, 1_000, 10_000, 100_000, 1_000_000)
BYTE_BUCKETS = (1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10)
DATA_PLANE_REASONS = frozenset(
    {"admission_closed", AWAITING_RESTORE, "stale_attempt", "episode_mismatch"}
)
"""The data plane's refusal codes (HTTP 409 `{"error": {"code": ...}}`)."""


@dataclass(frozen=True, slots=True)
class Gauges:
    """What the gauges read at scrape time (taken on the event loop)."""

    state: str
    states: tuple[str, ...]
    admission_open: bool
    readiness_serving: bool
    blocker_count: int
    counts: Mapping[str, int] = field(default_factory=dict)


class ParticipantMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.operation_duration = Histogram(
            "rollout_checkpoint_operation_duration_seconds",
            "Control RPC duration by operation and outcome (ok or the ErrorInfo reason).",
            ["operation", "outcome"],
            registry=r,
            buckets=DURATION_BUCKETS,
        )
        self.phase_duration = Histogram(
            "rollout_checkpoint_phase_duration_seconds",
            "Duration of checkpoint phases: wait_ready, export, snapshot (an asynchronous "
            "commit), write, discard (a rejoining restore), read, install.",
            ["phase"],
            registry=r,
            buckets=DURATION_BUCKETS,
        )
        self.records = Histogram(
            "rollout_checkpoint_records",
            "Records written per commit or installed per restore.",
            ["operation"],
            registry=r,
            buckets=RECORD_BUCKETS,
        )
        self.bytes = Histogram(
            "rollout_checkpoint_bytes",
            "Bytes of the records file per commit (written) or restore (read and verified).",
            ["operation"],
            registry=r,
            buckets=BYTE_BUCKETS,
        )
        self.refusals = Counter(
            "rollout_checkpoint_refusals",
            "Refusals by plane (control: ErrorInfo reason; data: the HTTP 409 code).",
            ["plane", "reason"],
            registry=r,
        )
        self.lease_expiries = Counter(
            "rollout_checkpoint_lease_expiries",
            "Checkpoints resumed by the participant itself because their lease expired.",
            registry=r,
        )
        self.prepare_not_ready = Counter(
            "rollout_checkpoint_prepare_not_ready",
            "Prepare streams that ended at their deadline still PREPARING (admission stays closed).",
            registry=r,
        )
        self.drain = Histogram(
            "rollout_checkpoint_prepare_drain_seconds",
            "Time from closing admission to ready (PREPARED).",
            registry=r,
            buckets=DURATION_BUCKETS,
        )

    def watch(self, read: Callable[[], Gauges]) -> None:
        """Register the gauges; `read` is called at each scrape, on the event loop."""
        self.registry.register(_GaugeCollector(read))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _GaugeCollector(Collector):
    def __init__(self, read: Callable[[], Gauges]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        try:
            gauges = self._read()
        except Exception:  # a scrape must never take the server down
            log.exception("reading the participant's gauges failed")
            return
        counts = GaugeMetricFamily(
            "rollout_checkpoint_readiness_count",
            "Counts of the participant's readiness report (resources: inflight, sessions).",
            labels=["count"],
        )
        for name, value in sorted(gauges.counts.items()):
            counts.add_metric([name], value)
        yield counts
        yield GaugeMetricFamily(
            "rollout_checkpoint_blockers",
            "Blockers of a safe cut right now.",
            value=gauges.blocker_count,
        )
        yield GaugeMetricFamily(
            "rollout_checkpoint_admission_open",
            "1 while the data plane admits new work.",
            value=int(gauges.admission_open),
        )
        yield GaugeMetricFamily(
            "rollout_checkpoint_readiness_serving",
            "1 while participant-readiness is SERVING.",
            value=int(gauges.readiness_serving),
        )
        state = GaugeMetricFamily(
            "rollout_checkpoint_state", "1 for the control plane's current state.", labels=["state"]
        )
        for name in gauges.states:
            state.add_metric([name], int(name == gauges.state))
        yield state


# -- exposition ---------------------------------------------------------------------------


def metrics_endpoint(metrics: ParticipantMetrics) -> Callable[[Request], Response]:
    """A Starlette endpoint serving `metrics` (mounted at `metrics_path`)."""

    def endpoint(request: Request) -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return endpoint


class MetricsServer:
    """`GET /metrics` on a port of its own, served from the event loop (no thread: the
    gauges read the participant's state, which only the loop may touch)."""

    def __init__(self, metrics: ParticipantMetrics, address: str) -> None:
        self.metrics = metrics
        host, _, port = address.rpartition(":")
        self.host = host.strip("[]")
        self.port = int(port)
        self._server: asyncio.Server | None = None

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("metrics on http://%s/metrics", self.address)
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(10):
                head = await reader.readuntil(b"\r\n\r\n")
            method, _, rest = head.decode("latin-1").partition(" ")
            path = rest.partition(" ")[0].partition("?")[0]
            if method not in ("GET", "HEAD"):
                status, body, kind = "405 Method Not Allowed", b"", "text/plain"
            elif path not in ("/metrics", "/"):
                status, body, kind = "404 Not Found", b"", "text/plain"
            else:
                status, body, kind = "200 OK", self.metrics.exposition(), CONTENT_TYPE_LATEST
            header = (
                f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(header.encode() + (b"" if method == "HEAD" else body))
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


class DataPlaneRefusals:
    """Pure ASGI: counts the data plane's 409 refusals by code, passing every byte through.

    It only peeks at the first body chunk of a 409 JSON response (the refusals are small
    single-chunk bodies written by the admission middleware). `__call__` and its `send` are
    plain functions returning the next awaitable: with nothing to do after a call, they need
    no coroutine of their own, which was most of this layer's cost per request (about
    8,000 instructions before, 5,500 after)."""

    def __init__(self, app: ASGIApp, on_refusal: Callable[[str], None]) -> None:
        self.app = app
        self.on_refusal = on_refusal

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        if scope["type"] != "http":
            return self.app(scope, receive, send)
        watching = False

        def peek(message: Message) -> Awaitable[None]:
            nonlocal watching
            if message["type"] == "http.response.start":
                watching = message["status"] == 409
            elif watching and message["type"] == "http.response.body":
                watching = False
                code = _refusal_code(message.get("body", b""))
                if code is not None:
                    self.on_refusal(code)
            return send(message)

        return self.app(scope, receive, peek)


def _refusal_code(body: bytes) -> str | None:
    if not body.startswith(b"{") or len(body) > 4096:
        return None
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if code in DATA_PLANE_REASONS else None
