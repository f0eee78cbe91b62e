"""Metrics, traces and structured logs of a participant runtime, through real RPCs and HTTP.

* Prometheus: scrape `/metrics` (the app's path, and a port of its own) after a checkpoint,
  refusals of both planes, a prepare that reached its deadline, and a lease expiry (all on
  the injected clock), and after a restore; labels never carry checkpoint ids; every
  runtime has its own registry.
* OpenTelemetry: an in-memory exporter sees one trace for a controller's
  fanout.prepare + commit over two participants, the participants' operation spans
  parented under the controller's span (W3C traceparent in gRPC metadata) and the phases
  (wait_ready, export, write; read, install for a restore) under those; through the
  CoordinatorService the chain is caller -> coordinator -> participant.
* Logs: every line of an operation carries its checkpoint id (the lease expiry's too, in a
  background task); JSON lines parse; the token never appears, and is redacted if logged.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
from collections.abc import Iterator

import httpx
import prometheus_client
import pytest
from google.protobuf import timestamp_pb2
from grpc import aio
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.coordinator import calls
from rollout_checkpoint.client.coordinator.service import Coordinator
from rollout_checkpoint.client.fleet import Fleet, FleetSpec, MemberSpec
from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.rpc.tracing import context_metadata
from rollout_checkpoint.server.runtime.control_plane import State
from rollout_checkpoint.server.runtime.logs import ContextFilter, JsonFormatter
from rollout_checkpoint.server.runtime.participant import Kind
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb
from rollout_checkpoint.v1 import coordinator_service_pb2_grpc as cpb_grpc
from rollout_checkpoint.v1 import types_pb2

from .clocks import ObservedClock
from .conftest import TOKEN, Harness, refused, start_harness, stop_harness
from .double import DoubleParticipant

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    """Every sample of an exposition: (name, sorted labels) -> value."""
    found: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def value(found: Samples, name: str, **labels: str) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


async def scrape(h: Harness) -> Samples:
    response = await h.http.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return samples(response.text)


async def test_metrics_after_a_checkpoint_refusals_a_deadline_and_a_lease_expiry(
    checkpoint_dir: str,
) -> None:
    h = await start_harness(metrics_path="/metrics")
    try:
        assert h.runtime.metrics.registry is not prometheus_client.REGISTRY
        assert (await h.http.post("/ng-rollout/r1/seed", json={"state": {"n": 1}})).is_success

        # A checkpoint: prepare, commit, resume.
        final = await h.client.prepare_until_final("ckpt-m1", h.deadline())
        assert final.state == types_pb2.PARTICIPANT_STATE_PREPARED
        committed = await h.client.commit("ckpt-m1", h.deadline(), checkpoint_dir)
        # Refused on the data plane while closed, and the scrape still passes (a GET).
        closed = await h.http.post("/ng-rollout/r2/seed", json={"state": {}})
        assert closed.status_code == 409 and closed.json()["error"]["code"] == "admission_closed"
        during = await scrape(h)
        assert value(during, "rollout_checkpoint_admission_open") == 0
        assert value(during, "rollout_checkpoint_state", state="COMMITTED") == 1
        await h.client.resume("ckpt-m1", h.deadline())
        # Refused on the control plane: the id is stale now.
        await refused(h.client.commit("ckpt-m1", h.deadline(), checkpoint_dir), "STALE_CHECKPOINT")
        # Refused on the data plane: a retired attempt.
        await h.client.retire("retire-1", h.deadline(), [EpisodeId("r1", 1)])
        stale = await h.http.post("/ng-rollout/r1-a1/update", json={"state": {}})
        assert stale.status_code == 409 and stale.json()["error"]["code"] == "stale_attempt"

        # A prepare that reaches its deadline: a request held in flight.
        held = asyncio.ensure_future(
            h.http.post("/ng-rollout/r3/update", json={"state": {}, "hold": True})
        )
        await h.until(lambda: h.participant.inflight)
        stream = h.client.prepare_until_final("ckpt-m2", h.deadline(5))
        waiting = asyncio.ensure_future(stream)
        await h.until(lambda: h.control.state is State.PREPARING)
        h.clock.advance(6)
        assert (await waiting).state == types_pb2.PARTICIPANT_STATE_PREPARING
        await h.http.post("/test/release")
        assert (await held).is_success
        # Nobody resumes ckpt-m2: its lease expires and the participant reopens by itself,
        # on time although ckpt-m1's (resumed) lease would have ended later.
        h.clock.advance(h.runtime.settings.lease_grace_seconds + 1)
        await h.until(lambda: h.control.state is State.IDLE and h.control.admission_open)

        found = await scrape(h)
    finally:
        await stop_harness(h)

    duration = "rollout_checkpoint_operation_duration_seconds_count"
    assert value(found, duration, operation="prepare", outcome="ok") == 2
    assert value(found, duration, operation="commit", outcome="ok") == 1
    assert value(found, duration, operation="resume", outcome="ok") == 1
    assert value(found, duration, operation="retire", outcome="ok") == 1
    assert value(found, duration, operation="commit", outcome="STALE_CHECKPOINT") == 1
    refusals = "rollout_checkpoint_refusals_total"
    assert value(found, refusals, plane="control", reason="STALE_CHECKPOINT") == 1
    assert value(found, refusals, plane="data", reason="admission_closed") == 1
    assert value(found, refusals, plane="data", reason="stale_attempt") == 1
    assert value(found, "rollout_checkpoint_records_count", operation="commit") == 1
    assert value(found, "rollout_checkpoint_records_sum", operation="commit") == 1
    manifest_bytes = committed.manifest.bytes
    assert value(found, "rollout_checkpoint_bytes_sum", operation="commit") == manifest_bytes > 0
    assert value(found, "rollout_checkpoint_lease_expiries_total") == 1
    assert value(found, "rollout_checkpoint_prepare_not_ready_total") == 1
    assert value(found, "rollout_checkpoint_prepare_drain_seconds_count") == 1
    for phase in ("wait_ready", "export", "write"):
        assert value(found, "rollout_checkpoint_phase_duration_seconds_count", phase=phase) >= 1
    assert value(found, "rollout_checkpoint_readiness_count", count="inflight") == 0
    assert value(found, "rollout_checkpoint_readiness_count", count="sessions") == 1  # r3
    assert value(found, "rollout_checkpoint_state", state="IDLE") == 1
    assert value(found, "rollout_checkpoint_admission_open") == 1
    # Ids are unbounded: they are never label values.
    labels = {v for _, pairs in found for _, v in pairs}
    assert not labels & {"ckpt-m1", "ckpt-m2", "retire-1", "r1", "r1-a1"}


async def test_a_metrics_port_of_its_own_and_token_refusals(checkpoint_dir: str) -> None:
    h = await start_harness(metrics_address="127.0.0.1:0")
    try:
        assert h.runtime.metrics_address is not None
        assert (await h.http.get("/metrics")).status_code == 404  # not on the app
        async with ParticipantClient(h.grpc_address, "not-the-token") as wrong:
            await refused(wrong.get_status(), "TOKEN_INVALID")
        async with httpx.AsyncClient(base_url=f"http://{h.runtime.metrics_address}") as http:
            response = await http.get("/metrics")
            assert (await http.get("/other")).status_code == 404
        assert response.status_code == 200
        found = samples(response.text)
        refusals = "rollout_checkpoint_refusals_total"
        assert value(found, refusals, plane="control", reason="TOKEN_INVALID") == 1
        assert value(found, "rollout_checkpoint_state", state="IDLE") == 1
    finally:
        await stop_harness(h)
    assert h.runtime.metrics_server is not None and h.runtime.metrics_server._server is None


# -- traces ---------------------------------------------------------------------------------


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


async def test_one_checkpoint_is_one_trace_across_the_fleet(
    spans: tuple[TracerProvider, InMemorySpanExporter], checkpoint_dir: str
) -> None:
    provider, exporter = spans
    members = {
        name: await start_harness(
            participant=DoubleParticipant(name, kind), tracer_provider=provider
        )
        for name, kind in (("env-1", Kind.ENVIRONMENT), ("res-1", Kind.RESOURCES))
    }
    fleet = await Fleet.discover(
        FleetSpec(
            members=tuple(MemberSpec(n, h.grpc_address) for n, h in members.items()),
            token=TOKEN,
        )
    )
    try:
        exporter.clear()  # discovery's GetParticipant calls are no part of the checkpoint
        deadline = members["env-1"].deadline()
        with provider.get_tracer("controller").start_as_current_span("checkpoint") as root:
            progress = await fanout.prepare_until_done(fleet, "ckpt-t1", deadline)
            assert progress.prepared
            await fanout.commit(fleet, "ckpt-t1", deadline, checkpoint_dir, None)
        await fanout.resume(fleet, "ckpt-t1", deadline)  # outside: a trace of its own
    finally:
        await fleet.close()
        for h in members.values():
            await stop_harness(h)

    finished: list[ReadableSpan] = list(exporter.get_finished_spans())
    trace_id = root.get_span_context().trace_id
    in_trace = [s for s in finished if s.context is not None and s.context.trace_id == trace_id]
    by_id = {s.context.span_id: s for s in in_trace if s.context is not None}
    operations = [s for s in in_trace if s.name.startswith("rollout_checkpoint.v1.")]
    assert sorted(s.name.rsplit("/", 1)[1] for s in operations) == [
        "Commit",
        "Commit",
        "Prepare",
        "Prepare",
    ]
    root_id = root.get_span_context().span_id
    for span in operations:
        assert span.parent is not None and span.parent.span_id == root_id, span.name
        assert span.attributes is not None
        assert span.attributes["rollout_checkpoint.checkpoint_id"] == "ckpt-t1"
        assert span.attributes["rollout_checkpoint.outcome"] == "ok"
    instances = {
        span.attributes["rollout_checkpoint.instance"] for span in operations if span.attributes
    }
    assert instances == {"env-1", "res-1"}
    phases: dict[str, list[str]] = {}
    for span in in_trace:
        if span.name in ("wait_ready", "export", "write"):
            assert span.parent is not None
            parent = by_id[span.parent.span_id]
            phases.setdefault(span.name, []).append(parent.name.rsplit("/", 1)[1])
    assert phases == {
        "wait_ready": ["Prepare", "Prepare"],
        "export": ["Commit", "Commit"],
        "write": ["Commit", "Commit"],
    }
    # The resume ran outside the controller's span: its spans are a separate trace.
    resumes = [s for s in finished if s.name.endswith("/Resume")]
    assert len(resumes) == 2 and all(s.context and s.context.trace_id != trace_id for s in resumes)


async def test_a_restore_has_records_bytes_and_read_install_phases(
    spans: tuple[TracerProvider, InMemorySpanExporter], checkpoint_dir: str
) -> None:
    provider, exporter = spans
    source = await start_harness()
    try:
        source.participant.seed(EpisodeId("r1"), {"n": 1})
        source.participant.seed(EpisodeId("r2"), {"n": 2})
        await source.client.prepare_until_final("ckpt-r", source.deadline())
        committed = await source.client.commit("ckpt-r", source.deadline(), checkpoint_dir)
    finally:
        await stop_harness(source)
    fresh = await start_harness(tracer_provider=provider)
    try:
        scope = [EpisodeId("r1"), EpisodeId("r2")]
        await fresh.client.restore("restore-r", fresh.deadline(), checkpoint_dir, scope)
        found = samples(fresh.runtime.metrics.exposition().decode())
    finally:
        await stop_harness(fresh)
    assert value(found, "rollout_checkpoint_records_sum", operation="restore") == 2
    restored_bytes = value(found, "rollout_checkpoint_bytes_sum", operation="restore")
    assert restored_bytes == committed.manifest.bytes
    duration = "rollout_checkpoint_operation_duration_seconds_count"
    assert value(found, duration, operation="restore", outcome="ok") == 1
    (restore,) = [s for s in exporter.get_finished_spans() if s.name.endswith("/Restore")]
    assert restore.context is not None and restore.parent is None  # no caller's trace
    children = {
        s.name
        for s in exporter.get_finished_spans()
        if s.parent is not None and s.parent.span_id == restore.context.span_id
    }
    assert children == {"read", "install"}


async def test_the_coordinator_carries_the_callers_trace_to_the_participants(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    clock = ObservedClock(time.time())  # the coordinator checks deadlines on the real clock
    h = await start_harness(clock=clock, tracer_provider=provider)
    spec = FleetSpec(members=(MemberSpec("double", h.grpc_address),), token=TOKEN)
    server = Coordinator(spec, "127.0.0.1:0")
    await server.start()
    calls.set_tracer_provider(provider)
    try:
        async with aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = cpb_grpc.CoordinatorServiceStub(channel)
            deadline = timestamp_pb2.Timestamp(seconds=int(time.time()) + 60)
            with provider.get_tracer("controller").start_as_current_span("caller") as root:
                metadata = (("authorization", f"Bearer {TOKEN}"), *context_metadata())
                request = cpb.CoordinatorServicePrepareRequest(
                    checkpoint_id="ckpt-c1", deadline=deadline
                )
                replies = [r async for r in stub.Prepare(request, metadata=metadata)]
                assert replies[-1].final
                await stub.Resume(
                    cpb.CoordinatorServiceResumeRequest(checkpoint_id="ckpt-c1", deadline=deadline),
                    metadata=metadata,
                )
    finally:
        calls.set_tracer_provider(None)
        await server.stop()
        await stop_harness(h)
    finished = {s.name: s for s in exporter.get_finished_spans()}
    coordinator = finished["rollout_checkpoint.v1.CoordinatorService/Prepare"]
    participant = finished["rollout_checkpoint.v1.ParticipantService/Prepare"]
    root_context = root.get_span_context()
    assert coordinator.parent is not None and coordinator.parent.span_id == root_context.span_id
    assert coordinator.context is not None and participant.parent is not None
    assert participant.parent.span_id == coordinator.context.span_id
    assert participant.context is not None
    assert participant.context.trace_id == root_context.trace_id
    assert finished["rollout_checkpoint.v1.ParticipantService/Resume"].context is not None


# -- logs -----------------------------------------------------------------------------------


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.addFilter(ContextFilter([TOKEN]))
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.lines.append(self.format(record))


@pytest.fixture
def captured() -> Iterator[Capture]:
    handler = Capture()
    logger = logging.getLogger("rollout_checkpoint")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


async def test_log_lines_carry_the_checkpoint_id_and_never_the_token(
    captured: Capture, checkpoint_dir: str
) -> None:
    h = await start_harness()
    try:
        await h.http.post("/ng-rollout/r1/seed", json={"state": {"n": 1}})
        await h.client.prepare_until_final("ckpt-l1", h.deadline())
        h.participant.fail["export"] = RuntimeError("boom")  # a hook failure logs an error
        await refused(h.client.commit("ckpt-l1", h.deadline(), checkpoint_dir), "HOOK_FAILED")
        await h.client.resume("ckpt-l1", h.deadline())
        await h.client.prepare_until_final("ckpt-l2", h.deadline(10))
        h.clock.advance(h.runtime.settings.lease_grace_seconds + 20)
        await h.until(lambda: h.control.state is State.IDLE)
        await h.client.get_status()
        # Something that did log the token would be redacted.
        logging.getLogger("rollout_checkpoint.test").warning("leaked %s", TOKEN)
    finally:
        await stop_harness(h)

    by_message = [(r.getMessage(), getattr(r, "checkpoint_id", None)) for r in captured.records]
    operations = [(m, c) for m, c in by_message if m.split(" ")[0] in ("prepare", "commit")]
    assert any(m.startswith("commit HOOK_FAILED") and c == "ckpt-l1" for m, c in operations)
    assert {c for _, c in operations} == {"ckpt-l1", "ckpt-l2"}, operations
    hook = [c for m, c in by_message if m.startswith("participant hook export failed")]
    assert hook == ["ckpt-l1"]  # logged inside the commit's export task
    lease = [c for m, c in by_message if m.startswith("lease of checkpoint ckpt-l2 expired")]
    assert lease == ["ckpt-l2"]  # logged by the lease watcher, a background task
    status = [c for m, c in by_message if m.startswith("get_status ok")]
    assert status == [""]  # a read names no checkpoint
    for line in captured.lines:
        parsed = json.loads(line)
        assert {"time", "level", "logger", "message", "checkpoint_id"} <= set(parsed)
        assert TOKEN not in line
    assert json.loads(captured.lines[-1])["message"] == "leaked [REDACTED]"
    text = io.StringIO()
    for record in captured.records:
        text.write(record.getMessage())
    assert TOKEN not in text.getvalue()
