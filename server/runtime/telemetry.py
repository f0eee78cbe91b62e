"""`RuntimeObserver`: the runtime's metrics, traces and logs behind the `ControlObserver` hooks.

What `install_checkpointing` gives every runtime: Prometheus metrics in its own registry,
OpenTelemetry spans (when available) and structured log lines. The control plane knows only
`observe.ControlObserver`; this module (and Prometheus with it) is the ASGI install's.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from rollout_checkpoint.server.core.errors import Reason
from rollout_checkpoint.server.core.rpc.handlers import snake_case
from rollout_checkpoint.server.core.rpc.standard_services import RateLimitedLog
from rollout_checkpoint.server.runtime.logs import CHECKPOINT_ID, reset_quietly
from rollout_checkpoint.server.runtime.metrics import Gauges, ParticipantMetrics
from rollout_checkpoint.server.runtime.observe import ControlObserver, Metadata, Operation
from rollout_checkpoint.server.runtime.tracing import Tracing, end_span

log = logging.getLogger(__name__)

SERVICE_NAME = "rollout_checkpoint.v1.ParticipantService"
READ_ONLY = frozenset({"GetParticipant", "GetStatus", "ListEpisodes"})

_OPERATION: contextvars.ContextVar[_RuntimeOperation | None] = contextvars.ContextVar(
    "rollout_checkpoint_operation", default=None
)


class RuntimeObserver(ControlObserver):
    """Metrics (a registry per runtime), spans (optional) and log lines for one runtime."""

    def __init__(
        self, metrics: ParticipantMetrics | None = None, *, tracer_provider: Any = None
    ) -> None:
        self.metrics = metrics or ParticipantMetrics()
        self.tracing = Tracing(tracer_provider)
        self._kind = ""
        self._instance = ""
        # Anyone who reaches the port can send calls without the token, as fast as it likes.
        self._unauthenticated = RateLimitedLog(log)

    def attach(self, control: Any) -> None:
        participant = control.participant
        self._kind = participant.kind.value
        self._instance = participant.instance
        states = tuple(s.value for s in type(control.state))

        def read() -> Gauges:
            report = participant.report()
            return Gauges(
                state=control.state.value,
                states=states,
                admission_open=control.admission_open,
                readiness_serving=control.readiness_serving(),
                blocker_count=report.blocker_count,
                counts=dict(report.counts),
            )

        self.metrics.watch(read)

    def operation(self, method: str, metadata: Metadata = None) -> Operation:
        return _RuntimeOperation(self, method, metadata)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            with self.tracing.phase(name):
                yield
        finally:
            self.metrics.phase_duration.labels(name).observe(time.perf_counter() - started)

    def prepare_ended(self, state: str) -> None:
        operation = _OPERATION.get()
        if operation is not None:
            self.metrics.phase_duration.labels("wait_ready").observe(
                time.perf_counter() - operation.started
            )
            self.tracing.record_phase(
                "wait_ready", operation.started_ns, {"rollout_checkpoint.state": state}
            )
        if state == "PREPARING":
            self.metrics.prepare_not_ready.inc()
            log.warning("prepare reached its deadline not ready; admission stays closed")

    def drained(self, seconds: float) -> None:
        self.metrics.drain.observe(max(0.0, seconds))

    def committed(self, records: int, size: int) -> None:
        self.metrics.records.labels("commit").observe(records)
        self.metrics.bytes.labels("commit").observe(size)

    def restored(self, records: int, size: int) -> None:
        self.metrics.records.labels("restore").observe(records)
        self.metrics.bytes.labels("restore").observe(size)

    def lease_expired(self, checkpoint_id: str) -> None:
        self.metrics.lease_expiries.inc()

    def data_refused(self, code: str) -> None:
        self.metrics.refusals.labels("data", code).inc()

    def unauthenticated(self, method: str) -> None:
        self.metrics.refusals.labels("control", Reason.TOKEN_INVALID.value).inc()
        self._unauthenticated.warning("refused %s: missing or invalid bearer token", method)


class _RuntimeOperation(Operation):
    def __init__(self, observer: RuntimeObserver, method: str, metadata: Metadata) -> None:
        self.observer = observer
        self.method = method
        self.metadata = metadata
        self.name = snake_case(method)
        self.checkpoint_id = ""
        self.outcome: str | None = None
        self.started = 0.0
        self.started_ns = 0
        self._span: Any = None
        self._exits: contextlib.ExitStack | None = None

    def __enter__(self) -> Operation:
        self.started = time.perf_counter()
        self.started_ns = time.time_ns()
        tracing = self.observer.tracing
        self._span = tracing.start_server_span(
            f"{SERVICE_NAME}/{self.method}",
            self.metadata,
            {
                "rpc.system": "grpc",
                "rpc.service": SERVICE_NAME,
                "rpc.method": self.method,
                "rollout_checkpoint.kind": self.observer._kind,
                "rollout_checkpoint.instance": self.observer._instance,
            },
        )
        self._exits = contextlib.ExitStack()
        self._exits.enter_context(tracing.activate(self._span))
        self._exits.enter_context(_set(_OPERATION, self))
        return self

    def checkpoint(self, checkpoint_id: str) -> None:
        if checkpoint_id and self._exits is not None:
            self.checkpoint_id = checkpoint_id
            self._exits.enter_context(_set(CHECKPOINT_ID, checkpoint_id))

    def refused(self, reason: str) -> None:
        self.outcome = reason

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        outcome = self.outcome
        if outcome is None:
            if exc is None or isinstance(exc, GeneratorExit):
                outcome = "ok" if exc is None else "cancelled"
            elif isinstance(exc, asyncio.CancelledError):
                outcome = "cancelled"
            else:
                outcome = Reason.INTERNAL_ERROR.value
        seconds = time.perf_counter() - self.started
        metrics = self.observer.metrics
        metrics.operation_duration.labels(self.name, outcome).observe(seconds)
        if outcome not in ("ok", "cancelled"):
            metrics.refusals.labels("control", outcome).inc()
        level = logging.DEBUG if self.method in READ_ONLY else logging.INFO
        if outcome not in ("ok", "cancelled"):
            level = logging.WARNING if outcome == Reason.INTERNAL_ERROR else logging.INFO
        log.log(level, "%s %s in %.3f s", self.name, outcome, seconds)
        end_span(self._span, outcome, self.checkpoint_id)
        if self._exits is not None:
            self._exits.close()


@contextlib.contextmanager
def _set(var: contextvars.ContextVar[Any], value: Any) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        reset_quietly(var, token)
