"""Controllers against participants they did not write: a scripted member that misbehaves.

Each fleet here is one real participant (the test double, an environment: it prepares first)
and one scripted participant (tests/scripted_participant.py, a resources member: it prepares
last) served by pytest-grpc's synchronous `grpc_server` on a real port. The scripted member
misbehaves on purpose; every test asserts outcomes: the controller's typed error (the
ErrorInfo reason and the member it names), the real member's state, that nothing was
published, and that every member was resumed (the fleet is open again).

pytest-grpc's fixtures are module-scoped: one scripted server serves the whole module, and the
`scripted` fixture resets its script (and releases any call a test left held) around each test.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import code_pb2, status_pb2
from grpc import aio
from grpc_status import rpc_status
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.checkpointing.checkpoint import CheckpointOutcome, checkpoint
from rollout_checkpoint.client.checkpointing.fanout import FleetError, Outcome
from rollout_checkpoint.client.checkpointing.publication import CheckpointRoot
from rollout_checkpoint.client.coordinator.service import Coordinator
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import DiscoveryError, Fleet, FleetSpec, MemberSpec
from rollout_checkpoint.client.fleet.membership import Change, FleetWatch, MemberEvent
from rollout_checkpoint.client.participant import TRANSPORT_SLACK_SECONDS
from rollout_checkpoint.server.core.errors import Reason
from rollout_checkpoint.server.core.layout import LATEST_NAME
from rollout_checkpoint.server.runtime.participant import Kind
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb
from rollout_checkpoint.v1 import coordinator_service_pb2_grpc as cpb_grpc
from rollout_checkpoint.v1 import participant_service_pb2 as pb
from rollout_checkpoint.v1 import types_pb2

from .clocks import ObservedClock
from .conftest import TOKEN, Harness, serve_app, start_harness, stop_harness
from .double import DoubleParticipant
from .scripted_participant import (
    GARBAGE,
    UNKNOWN_BLOCKER_REASON,
    UNKNOWN_KIND,
    UNKNOWN_STATE,
    ScriptedParticipant,
    prepare_update,
    prepared,
    refuse,
    with_unknown_fields,
)

grpc_max_workers = 16
"""Read by pytest-grpc's server fixture; its default (1 thread) would serve one call at a time,
and a held call would starve every other."""

TIMEOUT_BOUND = TRANSPORT_SLACK_SECONDS + 15.0
"""How long past its deadline a call to a silent member may take to fail: the transport's slack
plus room for a loaded machine. Without the bound, "it hung" and "it timed out" look alike."""

UNARY_METHODS = ("GetParticipant", "GetStatus", "ListEpisodes", "Renew", "Resume", "Retire")


# -- pytest-grpc: the scripted member on a real port ------------------------------------------


@pytest.fixture(scope="module")
def grpc_servicer() -> ScriptedParticipant:
    return ScriptedParticipant()


@pytest.fixture(scope="module")
def grpc_add_to_server() -> Callable[[ScriptedParticipant, grpc.Server], None]:
    """Registers the scripted member as a generic handler (the generated
    `add_ParticipantServiceServicer_to_server` would serialize replies itself: no garbage)."""

    def add(servicer: ScriptedParticipant, server: grpc.Server) -> None:
        server.add_generic_rpc_handlers((servicer.generic_handler(),))

    return add


@pytest.fixture
def scripted(grpc_server: grpc.Server, grpc_servicer: ScriptedParticipant) -> Iterator[Any]:
    grpc_servicer.reset()
    try:
        yield grpc_servicer
    finally:
        grpc_servicer.released.set()


# -- the mixed fleet ----------------------------------------------------------------------------


@dataclass
class MixedFleet:
    fleet: Fleet
    real: Harness
    scripted: ScriptedParticipant
    spec: FleetSpec
    root_path: Path

    @property
    def root(self) -> CheckpointRoot:
        return CheckpointRoot(self.root_path)

    async def assert_resumed(self, checkpoint_id: str) -> None:
        """The fleet is open again: the real member IDLE with admission open, and the
        scripted one sent a Resume of this checkpoint."""
        status = await self.real.client.get_status()
        assert status.state == types_pb2.PARTICIPANT_STATE_IDLE, status
        assert status.admission_open and self.real.participant.admission
        resumed = [r.checkpoint_id for r in self.scripted.requests("Resume")]
        assert checkpoint_id in resumed, resumed

    def assert_nothing_published(self) -> None:
        assert not (self.root_path / LATEST_NAME).exists()
        assert self.root.published() == []


def spec_of(real: Harness, scripted_address: str, root: Path) -> FleetSpec:
    return FleetSpec(
        members=(MemberSpec("real", real.grpc_address), MemberSpec("scripted", scripted_address)),
        token=TOKEN,
        checkpoint_root=str(root),
    )


@contextlib.asynccontextmanager
async def real_member() -> AsyncIterator[Harness]:
    # The double's clock starts at the real time (the controller's deadlines are real) and
    # stands still: its lease never runs out during a test.
    harness = await start_harness(
        participant=DoubleParticipant("real", Kind.ENVIRONMENT), clock=ObservedClock(time.time())
    )
    try:
        yield harness
    finally:
        await stop_harness(harness)


@contextlib.asynccontextmanager
async def mixed_fleet(
    scripted: ScriptedParticipant, address: str, tmp_path: Path
) -> AsyncIterator[MixedFleet]:
    async with real_member() as real:
        spec = spec_of(real, address, tmp_path / "root")
        fleet = await Fleet.discover(spec, tries=1)
        assert [m.name for m in fleet.members] == ["real", "scripted"]
        try:
            yield MixedFleet(fleet, real, scripted, spec, tmp_path / "root")
        finally:
            await fleet.close()


@contextlib.asynccontextmanager
async def coordinator_of(spec: FleetSpec) -> AsyncIterator[Any]:
    coordinator = Coordinator(spec, "127.0.0.1:0")
    port = await coordinator.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield cpb_grpc.CoordinatorServiceStub(channel)
    finally:
        await coordinator.stop()


AUTH = (("authorization", f"Bearer {TOKEN}"),)


async def run_checkpoint(f: MixedFleet, checkpoint_id: str, deadline: float) -> CheckpointOutcome:
    outcome: CheckpointOutcome | None = None
    async for event in checkpoint(f.fleet, f.root, deadline, checkpoint_id=checkpoint_id):
        outcome = event.outcome or outcome
    assert outcome is not None
    return outcome


async def coordinator_checkpoint_refusal(
    stub: Any, checkpoint_id: str, deadline: float
) -> tuple[ControlError, list[cpb.CheckpointResponse]]:
    """Run the Checkpoint RPC to its refusal; the refusal decoded as a controller does."""
    request = cpb.CheckpointRequest(checkpoint_id=checkpoint_id, derive_scope=True)
    request.deadline.FromNanoseconds(int(deadline * 1e9))
    call = stub.Checkpoint(request, metadata=AUTH, timeout=60)
    responses: list[cpb.CheckpointResponse] = []

    async def read() -> None:
        async for response in call:
            responses.append(response)

    with pytest.raises(aio.AioRpcError) as caught:
        await read()
    return ControlError.from_rpc_error(caught.value), responses


def silent_after_first_message(scripted: ScriptedParticipant) -> Any:
    def stream(request: pb.PrepareRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        yield prepare_update(request.checkpoint_id, sequence=1, kind=pb.PREPARE_UPDATE_KIND_INITIAL)
        scripted.hold(context, 120)

    return stream


def heartbeats_that_stop(scripted: ScriptedParticipant) -> Any:
    def stream(request: pb.PrepareRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        yield prepare_update(request.checkpoint_id, sequence=1, kind=pb.PREPARE_UPDATE_KIND_INITIAL)
        for sequence in (2, 3):
            if not scripted.hold(context, 0.3):
                return
            yield prepare_update(request.checkpoint_id, sequence=sequence)
        scripted.hold(context, 120)

    return stream


def heartbeats_past_the_deadline(scripted: ScriptedParticipant) -> Any:
    """A participant that keeps saying "still preparing" forever: heartbeats are no reason to
    wait past the deadline."""

    def stream(request: pb.PrepareRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        yield prepare_update(request.checkpoint_id, sequence=1, kind=pb.PREPARE_UPDATE_KIND_INITIAL)
        for sequence in range(2, 1000):
            if not scripted.hold(context, 0.3):
                return
            yield prepare_update(request.checkpoint_id, sequence=sequence)

    return stream


# -- a Prepare stream that never sends its final message --------------------------------------


@pytest.mark.parametrize(
    "stream",
    [silent_after_first_message, heartbeats_that_stop, heartbeats_past_the_deadline],
    ids=["silent", "heartbeats-stop", "heartbeats-forever"],
)
async def test_a_prepare_without_a_final_message_times_out_typed_and_the_fleet_is_resumed(
    scripted: ScriptedParticipant, grpc_addr: str, tmp_path: Path, stream: Any
) -> None:
    scripted.script["Prepare"] = stream(scripted)
    async with mixed_fleet(scripted, grpc_addr, tmp_path) as f:
        deadline = time.time() + 1.0
        with pytest.raises(FleetError) as caught:
            await run_checkpoint(f, "ck-hang", deadline)
        assert time.time() < deadline + TIMEOUT_BOUND
        error = caught.value
        assert error.operation == "prepare"
        assert error.reason == Reason.PARTICIPANT_UNREACHABLE
        assert list(error.failures) == ["scripted"]
        assert error.failures["scripted"].code == grpc.StatusCode.DEADLINE_EXCEEDED
        await f.assert_resumed("ck-hang")
        f.assert_nothing_published()


async def test_the_coordinator_relays_a_prepare_that_never_ends_as_a_typed_member_failure(
    scripted: ScriptedParticipant, grpc_addr: str, tmp_path: Path
) -> None:
    scripted.script["Prepare"] = silent_after_first_message(scripted)
    async with mixed_fleet(scripted, grpc_addr, tmp_path) as f, coordinator_of(f.spec) as stub:
        deadline = time.time() + 1.0
        refusal, responses = await coordinator_checkpoint_refusal(stub, "ck-hang", deadline)
        assert refusal.code == grpc.StatusCode.UNAVAILABLE
        assert refusal.reason == Reason.PARTICIPANT_UNREACHABLE
        assert refusal.metadata["failedMembers"] == "scripted=UNREACHABLE"
        assert refusal.metadata["operation"] == "prepare"
        assert all(r.phase == cpb.CHECKPOINT_PHASE_PREPARE for r in responses)
        await f.assert_resumed("ck-hang")
        f.assert_nothing_published()


async def test_slow_heartbeats_within_the_deadline_are_no_timeout(
    scripted: ScriptedParticipant, grpc_addr: str, tmp_path: Path
) -> None:
    """Heartbeats slower than the default second, the final message well after the client's
    minimum timeout: the deadline alone bounds the wait, so the checkpoint still prepares."""

    def slow(request: pb.PrepareRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        yield prepare_update(request.checkpoint_id, sequence=1, kind=pb.PREPARE_UPDATE_KIND_INITIAL)
        for sequence in (2, 3, 4):
            if not scripted.hold(context, 2.0):
                return
            yield prepare_update(request.checkpoint_id, sequence=sequence)
        yield prepared(request.checkpoint_id, sequence=5)

    scripted.script["Prepare"] = slow
    async with mixed_fleet(scripted, grpc_addr, tmp_path) as f:
        started = time.monotonic()
        progress = await fanout.prepare_until_done(f.fleet, "ck-slow", time.time() + 30)
        assert time.monotonic() - started >= 6.0
        assert progress.outcome == Outcome.PREPARED
        assert {m.name: m.state for m in progress.members} == {
            "real": types_pb2.PARTICIPANT_STATE_PREPARED,
            "scripted": types_pb2.PARTICIPANT_STATE_PREPARED,
        }
        await fanout.resume(f.fleet, "ck-slow", time.time() + 30)
        await f.assert_resumed("ck-slow")


async def test_a_members_final_message_ends_its_prepare_before_its_stream_closes(
    scripted: ScriptedParticipant, grpc_addr: str, tmp_path: Path
) -> None:
    """The final message is the member's outcome; its stream's status follows a network turn
    later and says nothing more. A controller that waited for it paid that turn in every
    stage (here: a status that never comes, so the old wait ran to the deadline)."""

    def final_then_silent(request: pb.PrepareRequest, context: grpc.ServicerContext) -> Any:
        yield prepared(request.checkpoint_id, sequence=1)
        scripted.hold(context, 120)

    scripted.script["Prepare"] = final_then_silent
    async with mixed_fleet(scripted, grpc_addr, tmp_path) as f:
        async with asyncio.timeout(20):
            progress = await fanout.prepare_until_done(f.fleet, "ck-final", time.time() + 60)
        assert progress.outcome == Outcome.PREPARED
        async with asyncio.timeout(20):
            await fanout.resume(f.fleet, "ck-final", time.time() + 60)
        await f.assert_resumed("ck-final")
        # The stream it left open is read to its end, not cancelled: the member ends it.
        scripted.released.set()


# -- a newer participant: unknown enum values and fields --------------------------------------


def speaking_a_newer_schema(scripted: ScriptedParticipant, final_state: int) -> None:
    """Every reply carries fields this schema lacks; Prepare reports an unknown state and an
    unknown blocker reason before its final message (in `final_state`)."""
    for method in UNARY_METHODS:
        default = getattr(scripted, method)
        scripted.script[method] = lambda request, context, default=default: with_unknown_fields(
            default(request, context)
        )
    scripted.script["Commit"] = lambda request, context: with_unknown_fields(
        scripted.write_empty_part(request)
    )

    def stream(request: pb.PrepareRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        blocker = types_pb2.Blocker(
            capture_key="r1:0",
            reason=UNKNOWN_BLOCKER_REASON,  # type: ignore[arg-type]
            detail="a reason from the future",
        )
        yield with_unknown_fields(
            prepare_update(
                request.checkpoint_id,
                sequence=1,
                state=UNKNOWN_STATE,
                kind=9,
                blockers=[blocker],
            )
        )
        # Still blocked for a while: a controller coalesces updates that follow each other
        # closely (the final one would supersede this one before any snapshot showed it).
        scripted.hold(context, 0.5)
        final = prepared(request.checkpoint_id, sequence=2)
        final.state = final_state  # type: ignore[assignment]
        yield with_unknown_fields(final)

    scripted.script["Prepare"] = stream


async def test_unknown_fields_and_enum_values_from_a_newer_participant_do_not_stop_a_checkpoint(
    scripted: ScriptedParticipant, grpc_addr: str, tmp_path: Path
) -> None:
    speaking_a_newer_schema(scripted, types_pb2.PARTICIPANT_STATE_PREPARED)
    async with mixed_fleet(scripted, grpc_addr, tmp_path) as f:
        progress: list[fanout.FleetProgress] = []
        outcome: CheckpointOutcome | None = None
        async for event in checkpoint(f.fleet, f.root, time.time() + 30, checkpoint_id="ck-new"):
            if event.progress is not None:
                progress.append(event.progress)
            outcome = event.outcome or outcome
        assert outcome is not None and outcome.published is not None
        assert outcome.prepare_outcome == Outcome.PREPARED
        assert f.root.latest() == "ck-new"
        seen = {
            (name, blocker.reason) for snapshot in progress for name, blocker in snapshot.blockers()
        }
        assert ("scripted", UNKNOWN_BLOCKER_REASON) in seen
        await f.assert_resumed("ck-new")


async def test_an_unknown_final_state_is_not_prepared_and_the_coordinator_relays_it(
    scripted: ScriptedParticipant, grpc_addr: str, tmp_path: Path
) -> None:
    """A final state this controller does not know is not PREPARED: nothing is committed, the
    fleet is resumed, and the CoordinatorService relays the numbers as they came."""
    speaking_a_newer_schema(scripted, UNKNOWN_STATE)
    async with mixed_fleet(scripted, grpc_addr, tmp_path) as f, coordinator_of(f.spec) as stub:
        request = cpb.CheckpointRequest(checkpoint_id="ck-unknown", derive_scope=True)
        request.deadline.FromNanoseconds(int((time.time() + 30) * 1e9))
        responses = [r async for r in stub.Checkpoint(request, metadata=AUTH, timeout=60)]
        final = responses[-1]
        assert final.final and final.phase == cpb.CHECKPOINT_PHASE_DONE
        assert final.result.prepare_outcome == cpb.FLEET_PREPARE_OUTCOME_NOT_PREPARED
        assert not final.result.published
        relayed = {
            (m.name, m.state)
            for r in responses
            if r.HasField("progress")
            for m in r.progress.members
        }
        assert ("scripted", UNKNOWN_STATE) in relayed
        reasons = {
            b.blocker.reason
            for r in responses
            if r.HasField("progress")
            for b in r.progress.blockers
        }
        assert UNKNOWN_BLOCKER_REASON in reasons
        assert scripted.requests("Commit") == []
        await f.assert_resumed("ck-unknown")
        f.assert_nothing_published()


async def test_an_unknown_kind_fails_discovery_naming_the_member(
    scripted: ScriptedParticipant, grpc_addr: str, tmp_path: Path
) -> None:
    scripted.kind = UNKNOWN_KIND  # type: ignore[assignment]
    async with real_member() as real:
        with pytest.raises(DiscoveryError) as caught:
            await Fleet.discover(spec_of(real, grpc_addr, tmp_path), tries=1)
        assert list(caught.value.failures) == ["scripted"]
        assert f"unknown participant kind {UNKNOWN_KIND}" in caught.value.failures["scripted"]


async def test_an_unknown_refusal_reason_is_relayed_as_the_members_own(
    scripted: ScriptedParticipant, grpc_addr: str, tmp_path: Path
) -> None:
    """A reason a newer participant added: the controller does not know it, but it is the
    member's decision (PARTICIPANT_FAILED, not UNREACHABLE), and it reaches the caller intact."""

    def refusing(request: pb.CommitRequest, context: grpc.ServicerContext) -> Any:
        refuse(context, "FAILED_PRECONDITION", "A_REASON_FROM_THE_FUTURE", "no", {"hint": "x"})

    scripted.script["Commit"] = refusing
    async with mixed_fleet(scripted, grpc_addr, tmp_path) as f, coordinator_of(f.spec) as stub:
        refusal, _ = await coordinator_checkpoint_refusal(stub, "ck-future", time.time() + 30)
        assert refusal.reason == Reason.PARTICIPANT_FAILED
        assert refusal.code == grpc.StatusCode.FAILED_PRECONDITION
        assert refusal.metadata["failedMembers"] == "scripted=A_REASON_FROM_THE_FUTURE"
        assert refusal.metadata["memberHint"] == "x"
        await f.assert_resumed("ck-future")
        f.assert_nothing_published()


# -- a replaced member: the boot id changes between calls -------------------------------------


async def test_a_member_replaced_mid_checkpoint_fails_it_typed_and_is_reported_with_its_new_boot_id(
    scripted: ScriptedParticipant, grpc_addr: str, tmp_path: Path
) -> None:
    """The scripted process is "replaced" after prepare: a new boot id, and the IDLE state a
    fresh process has, so its Commit is refused INVALID_PHASE. The checkpoint fails on that
    member, and ListParticipants reports the new process, not the one discovered before."""

    def replaced_before_commit(request: pb.CommitRequest, context: grpc.ServicerContext) -> Any:
        scripted.boot_id = "boot-2"
        refuse(context, "FAILED_PRECONDITION", "INVALID_PHASE", "idle", {"state": "IDLE"})

    scripted.script["Commit"] = replaced_before_commit
    async with mixed_fleet(scripted, grpc_addr, tmp_path) as f, coordinator_of(f.spec) as stub:
        listed = await stub.ListParticipants(cpb.ListParticipantsRequest(), metadata=AUTH)
        assert {m.name: m.boot_id for m in listed.members}["scripted"] == "boot-1"
        refusal, _ = await coordinator_checkpoint_refusal(stub, "ck-replaced", time.time() + 30)
        assert refusal.reason == Reason.PARTICIPANT_FAILED
        assert refusal.metadata["failedMembers"] == "scripted=INVALID_PHASE"
        assert refusal.metadata["memberState"] == "IDLE"
        listed = await stub.ListParticipants(cpb.ListParticipantsRequest(), metadata=AUTH)
        assert {m.name: m.boot_id for m in listed.members}["scripted"] == "boot-2"
        assert f.fleet.member("scripted").boot_id == "boot-1"  # what the library discovered
        await f.assert_resumed("ck-replaced")
        f.assert_nothing_published()


async def test_a_member_without_the_health_service_is_watched_by_its_boot_id_alone(
    scripted: ScriptedParticipant, grpc_addr: str
) -> None:
    """A participant may serve ParticipantService and nothing else: its health Watch is
    UNIMPLEMENTED. The member watch (what `collect` and the supervisor act on) probes its boot
    id instead of reporting it down and up again every probe, and still sees a replacement."""
    loop = asyncio.get_running_loop()
    probed, changed = asyncio.Event(), asyncio.Event()
    events: list[MemberEvent] = []

    def probe(request: pb.GetParticipantRequest, context: grpc.ServicerContext) -> Any:
        if len(scripted.requests("GetParticipant")) >= 4:  # three probes after the first
            loop.call_soon_threadsafe(probed.set)
        return scripted.GetParticipant(request, context)

    def on_event(event: MemberEvent) -> None:
        events.append(event)
        changed.set()

    scripted.script["GetParticipant"] = probe
    spec = FleetSpec(members=(MemberSpec("scripted", grpc_addr),), token=TOKEN)
    watch = FleetWatch(spec, on_event, known={"scripted": "boot-1"}, probe_seconds=0.05)
    watch.start()
    try:
        async with asyncio.timeout(30):
            await probed.wait()
            assert events == [] and watch.down() == frozenset()
            scripted.boot_id = "boot-2"
            await changed.wait()
    finally:
        await watch.close()
    (replaced,) = events
    assert replaced.change is Change.REPLACED
    assert (replaced.previous_boot_id, replaced.boot_id) == ("boot-1", "boot-2")


# -- a Commit that answers after its deadline --------------------------------------------------


async def test_a_commit_refused_after_its_deadline_fails_typed_and_publishes_nothing(
    scripted: ScriptedParticipant, grpc_addr: str, tmp_path: Path
) -> None:
    def late_refusal(request: pb.CommitRequest, context: grpc.ServicerContext) -> Any:
        scripted.hold(context, request.deadline.ToNanoseconds() / 1e9 - time.time() + 0.5)
        refuse(context, "DEADLINE_EXCEEDED", "CHECKPOINT_DEADLINE_EXCEEDED", "too late")

    scripted.script["Commit"] = late_refusal
    async with mixed_fleet(scripted, grpc_addr, tmp_path) as f:
        with pytest.raises(FleetError) as caught:
            await run_checkpoint(f, "ck-late", time.time() + 2.0)
        error = caught.value
        assert error.operation == "commit"
        assert error.reason == Reason.PARTICIPANT_FAILED
        assert list(error.failures) == ["scripted"]
        assert error.failures["scripted"].reason == Reason.CHECKPOINT_DEADLINE_EXCEEDED
        assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED
        await f.assert_resumed("ck-late")
        f.assert_nothing_published()


async def test_a_commit_answered_after_the_transport_gave_up_fails_typed_and_publishes_nothing(
    scripted: ScriptedParticipant, grpc_addr: str, tmp_path: Path
) -> None:
    """The member's part is written, but its reply comes after the call's timeout: the
    controller cannot know the part's digest, so the checkpoint must not be published."""

    def too_slow(request: pb.CommitRequest, context: grpc.ServicerContext) -> Any:
        late = request.deadline.ToNanoseconds() / 1e9 - time.time() + TRANSPORT_SLACK_SECONDS
        scripted.hold(context, late + 2.0)
        return scripted.write_empty_part(request)

    scripted.script["Commit"] = too_slow
    async with mixed_fleet(scripted, grpc_addr, tmp_path) as f, coordinator_of(f.spec) as stub:
        deadline = time.time() + 2.0
        refusal, responses = await coordinator_checkpoint_refusal(stub, "ck-slow-commit", deadline)
        assert time.time() < deadline + TIMEOUT_BOUND
        assert refusal.reason == Reason.PARTICIPANT_UNREACHABLE
        assert refusal.metadata == {"failedMembers": "scripted=UNREACHABLE", "operation": "commit"}
        assert cpb.CHECKPOINT_PHASE_PUBLISH not in {r.phase for r in responses}
        await f.assert_resumed("ck-slow-commit")
        f.assert_nothing_published()


# -- garbage bytes -------------------------------------------------------------------------------


async def test_garbage_instead_of_a_reply_fails_discovery_naming_the_member(
    scripted: ScriptedParticipant, grpc_addr: str, tmp_path: Path
) -> None:
    scripted.script["GetParticipant"] = lambda request, context: GARBAGE
    async with real_member() as real:
        with pytest.raises(DiscoveryError) as caught:
            await Fleet.discover(spec_of(real, grpc_addr, tmp_path), tries=1)
        assert list(caught.value.failures) == ["scripted"]
        assert not caught.value.refused  # nothing the member decided: its bytes were garbage
        assert caught.value.errors["scripted"].code == grpc.StatusCode.INTERNAL


@pytest.mark.parametrize("method", ["Prepare", "Commit"])
async def test_garbage_during_a_checkpoint_fails_it_typed_and_resumes_the_fleet(
    scripted: ScriptedParticipant, grpc_addr: str, tmp_path: Path, method: str
) -> None:
    if method == "Prepare":
        scripted.script["Prepare"] = lambda request, context: iter([GARBAGE])
    else:
        scripted.script["Commit"] = lambda request, context: GARBAGE
    async with mixed_fleet(scripted, grpc_addr, tmp_path) as f:
        with pytest.raises(FleetError) as caught:
            await run_checkpoint(f, "ck-garbage", time.time() + 30)
        error = caught.value
        assert error.operation == method.lower()
        assert error.reason == Reason.PARTICIPANT_UNREACHABLE
        assert list(error.failures) == ["scripted"]
        assert error.failures["scripted"].code == grpc.StatusCode.INTERNAL
        assert not error.failures["scripted"].decided_by_server
        await f.assert_resumed("ck-garbage")
        f.assert_nothing_published()


async def test_a_refusal_whose_error_details_are_garbage_is_still_a_typed_failure(
    scripted: ScriptedParticipant, grpc_addr: str, tmp_path: Path
) -> None:
    """A status trailer whose ErrorInfo does not parse: the controller cannot read a reason,
    so it reports what it knows (the status code), never a decoding exception."""

    def torn_details(request: pb.CommitRequest, context: grpc.ServicerContext) -> Any:
        detail = any_pb2.Any(
            type_url="type.googleapis.com/google.rpc.ErrorInfo", value=b"\xff\xff\xff"
        )
        status = status_pb2.Status(
            code=code_pb2.FAILED_PRECONDITION, message="torn", details=[detail]
        )
        context.abort_with_status(rpc_status.to_status(status))

    scripted.script["Commit"] = torn_details
    async with mixed_fleet(scripted, grpc_addr, tmp_path) as f:
        with pytest.raises(FleetError) as caught:
            await run_checkpoint(f, "ck-torn", time.time() + 30)
        failure = caught.value.failures["scripted"]
        assert failure.code == grpc.StatusCode.FAILED_PRECONDITION
        assert failure.reason is None
        await f.assert_resumed("ck-torn")
        f.assert_nothing_published()


# -- collect -------------------------------------------------------------------------------------


def entry_app() -> Starlette:
    """An entry point whose every rollout takes a moment and succeeds (collect sends /run)."""

    async def run(request: Request) -> JSONResponse:
        await asyncio.sleep(0.2)
        return JSONResponse({"reward": 1.0, "key": request.path_params["key"]})

    return Starlette(routes=[Route("/ng-rollout/{key}/run", run, methods=["POST"])])


async def run_collect(tmp_path: Path, address: str, *extra: str) -> tuple[int, str]:
    """`rollout-checkpoint collect` as a process over a fleet of the scripted member alone;
    returns its exit code and stderr."""
    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text(
        f'token_env = "SCRIPTED_TOKEN"\n[[participants]]\nname = "scripted"\naddress = "{address}"\n'
    )
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(f'{{"task_id": "t{i}"}}\n' for i in range(4)))
    server, serving, port = await serve_app(entry_app())
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "rollout_checkpoint.client.cli.main",
            "collect",
            "--fleet",
            str(fleet_file),
            "--entry-url",
            f"http://127.0.0.1:{port}",
            "--input",
            str(tasks),
            "--output",
            str(tmp_path / "out.jsonl"),
            "--checkpoint-dir",
            str(tmp_path / "checkpoints"),
            "--num-repeats",
            "2",
            "--concurrency",
            "2",
            "--checkpoint-timeout",
            "30",
            *extra,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env=dict(os.environ, SCRIPTED_TOKEN=TOKEN, GRPC_VERBOSITY="ERROR"),
        )
        try:
            async with asyncio.timeout(120):
                _, stderr = await process.communicate()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        assert process.returncode is not None
        return process.returncode, stderr.decode()
    finally:
        server.should_exit = True
        await serving


async def test_collect_checkpoints_through_a_participant_of_a_newer_schema(
    scripted: ScriptedParticipant, grpc_addr: str, tmp_path: Path
) -> None:
    scripted.kind = types_pb2.PARTICIPANT_KIND_ENVIRONMENT
    speaking_a_newer_schema(scripted, types_pb2.PARTICIPANT_STATE_PREPARED)
    code, stderr = await run_collect(tmp_path, grpc_addr, "--checkpoint-every", "0.3")
    assert code == 0, stderr
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 8
    assert scripted.requests("Commit"), "no checkpoint was taken"
    assert CheckpointRoot(tmp_path / "checkpoints").latest() is not None
    assert "Traceback" not in stderr


async def test_collect_stops_typed_when_a_member_answers_garbage(
    scripted: ScriptedParticipant, grpc_addr: str, tmp_path: Path
) -> None:
    scripted.kind = types_pb2.PARTICIPANT_KIND_ENVIRONMENT
    scripted.script["Resume"] = lambda request, context: GARBAGE
    code, stderr = await run_collect(tmp_path, grpc_addr)
    assert code == 5, stderr  # a participant was unreachable
    assert "scripted" in stderr and "Traceback" not in stderr
