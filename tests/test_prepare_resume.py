"""Prepare streams and Resume, through the real RPCs of a running participant."""

from __future__ import annotations

import asyncio
import contextlib

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.v1 import participant_service_pb2 as pb
from rollout_checkpoint.v1 import types_pb2

from .conftest import Harness, drain, refused, start_harness, stop_harness

PREPARING = types_pb2.PARTICIPANT_STATE_PREPARING
PREPARED = types_pb2.PARTICIPANT_STATE_PREPARED
IDLE = types_pb2.PARTICIPANT_STATE_IDLE
COMMITTED = types_pb2.PARTICIPANT_STATE_COMMITTED


async def hold_request(h: Harness, key: str) -> asyncio.Task[object]:
    """Start an HTTP request that stays in flight until /test/release; wait until it is."""
    await h.http.post(f"/ng-rollout/{key}/seed", json={"state": {"n": 0}})
    task = asyncio.ensure_future(
        h.http.post(f"/ng-rollout/{key}/update", json={"state": {"n": 1}, "hold": True})
    )
    await h.until(lambda: key in h.participant.inflight)
    return task


async def next_message(stream: object) -> pb.PrepareResponse:
    return await asyncio.wait_for(stream.__anext__(), 10)  # type: ignore[attr-defined]


async def test_prepare_waits_for_readiness_and_streams_progress(harness: Harness) -> None:
    h = harness
    held = await hold_request(h, "r1")
    stream = h.client.prepare("c1", h.deadline())
    first = await next_message(stream)
    assert first.update_kind == pb.PREPARE_UPDATE_KIND_INITIAL
    assert first.sequence == 1
    assert first.state == PREPARING and not first.final
    assert not first.admission_open
    assert not first.readiness.ready
    assert [(b.capture_key, b.reason) for b in first.readiness.blockers] == [
        ("r1", types_pb2.BLOCKER_REASON_REQUEST_IN_FLIGHT)
    ]
    assert first.readiness.counts["inflight"] == 1
    # Admission is closed: new data-plane work is refused while the checkpoint waits.
    refused_seed = await h.http.post("/ng-rollout/r2/seed", json={"state": {}})
    assert refused_seed.status_code == 409
    assert refused_seed.json()["error"]["code"] == "admission_closed"

    h.clock.advance(1.0)  # a heartbeat's worth of time
    beat = await next_message(stream)
    assert beat.update_kind == pb.PREPARE_UPDATE_KIND_HEARTBEAT
    assert beat.state == PREPARING and beat.readiness.blocker_count == 1
    assert beat.sequence == 2

    await h.http.post("/test/release")
    assert (await held).status_code == 200
    rest = await drain(stream)
    final = rest[-1]
    assert final.final and final.update_kind == pb.PREPARE_UPDATE_KIND_FINAL
    assert final.state == PREPARED and final.readiness.ready
    assert [m.sequence for m in rest] == list(range(3, 3 + len(rest)))
    assert sum(m.final for m in rest) == 1
    status = await h.client.get_status()
    assert status.state == PREPARED and status.checkpoint_id == "c1"
    assert not status.admission_open


async def test_repeated_prepare_replays_also_after_commit(
    harness: Harness, checkpoint_dir: str
) -> None:
    h = harness
    first = await drain(h.client.prepare("c1", h.deadline()))
    assert first[-1].state == PREPARED and not first[-1].replayed
    again = await drain(h.client.prepare("c1", h.deadline()))
    assert len(again) == 1 and again[0].final and again[0].replayed
    assert again[0].state == PREPARED
    await h.client.commit("c1", h.deadline(), checkpoint_dir)
    after_commit = await drain(h.client.prepare("c1", h.deadline()))
    assert len(after_commit) == 1 and after_commit[0].replayed
    assert after_commit[0].state == COMMITTED


async def test_missed_deadline_keeps_admission_closed_and_retry_waits_again(
    harness: Harness,
) -> None:
    h = harness
    held = await hold_request(h, "r1")
    deadline = h.deadline(5)
    stream = h.client.prepare("c1", deadline)
    await next_message(stream)
    h.clock.set(deadline)
    messages = await drain(stream)
    final = messages[-1]
    assert final.final and final.state == PREPARING
    assert not final.readiness.ready and final.readiness.blocker_count == 1
    assert final.readiness.blockers[0].capture_key == "r1"
    status = await h.client.get_status()
    assert status.state == PREPARING and not status.admission_open

    # A retry with a later deadline waits again instead of conflicting.
    retry = h.client.prepare("c1", h.deadline(60))
    assert (await next_message(retry)).state == PREPARING
    await h.http.post("/test/release")
    await held
    assert (await drain(retry))[-1].state == PREPARED


async def test_cancelled_stream_does_not_abort(harness: Harness) -> None:
    h = harness
    held = await hold_request(h, "r1")
    stream = h.client.prepare("c1", h.deadline())
    await next_message(stream)
    await stream.aclose()  # the controller goes away
    status = await h.client.get_status()
    assert status.state == PREPARING and not status.admission_open
    await h.http.post("/test/release")
    await held
    # Re-attach: the same id answers with the participant's state, PREPARED once ready.
    final = (await drain(h.client.prepare("c1", h.deadline())))[-1]
    assert final.state == PREPARED


async def test_resume_during_prepare_ends_it_and_fences_the_id(harness: Harness) -> None:
    h = harness
    held = await hold_request(h, "r1")
    stream = h.client.prepare("c1", h.deadline())
    await next_message(stream)
    reply = await h.client.resume("c1", h.deadline())
    assert reply.state == IDLE and not reply.idempotent
    final = (await drain(stream))[-1]
    assert final.final and final.state == IDLE and final.admission_open
    await refused(drain(h.client.prepare("c1", h.deadline())), "STALE_CHECKPOINT", "ABORTED")
    again = await h.client.resume("c1", h.deadline())
    assert again.idempotent
    # Admission is open again: new work runs.
    assert (await h.http.post("/ng-rollout/r2/seed", json={"state": {}})).status_code == 200
    await h.http.post("/test/release")
    await held


async def test_resume_of_an_unseen_id_fences_a_late_prepare(harness: Harness) -> None:
    h = harness
    reply = await h.client.resume("never-prepared", h.deadline())
    assert reply.idempotent
    await refused(drain(h.client.prepare("never-prepared", h.deadline())), "STALE_CHECKPOINT")
    assert (await h.client.get_status()).state == IDLE


async def test_the_resume_that_opens_a_start_closed_process_is_not_idempotent() -> None:
    # It changed something (admission opened, readiness rose): a controller reading
    # `idempotent` must not conclude the process was open already. Later Resumes change
    # nothing and say so.
    h = await start_harness(start_closed=True)
    try:
        assert not (await h.client.get_status()).admission_open
        opening = await h.client.resume("boot-1", h.deadline())
        assert opening.state == IDLE and not opening.idempotent
        assert (await h.client.get_status()).admission_open
        assert (await h.client.resume("boot-1", h.deadline())).idempotent
        assert (await h.client.resume("boot-2", h.deadline())).idempotent  # only fenced
        await refused(drain(h.client.prepare("boot-1", h.deadline())), "STALE_CHECKPOINT")
    finally:
        await stop_harness(h)


async def test_resume_with_a_past_deadline_still_reopens(harness: Harness) -> None:
    h = harness
    await drain(h.client.prepare("c1", h.deadline()))
    h.clock.advance(120)
    reply = await h.client.resume("c1", h.clock.now() - 1)
    assert not reply.idempotent
    assert (await h.client.get_status()).admission_open


async def test_conflict_and_phase_fencing(harness: Harness, checkpoint_dir: str) -> None:
    h = harness
    await drain(h.client.prepare("c1", h.deadline()))
    error = await refused(
        drain(h.client.prepare("c2", h.deadline())), "CHECKPOINT_CONFLICT", "ABORTED"
    )
    assert error.metadata["activeCheckpointId"] == "c1"
    await refused(h.client.resume("c2", h.deadline()), "CHECKPOINT_CONFLICT")
    await refused(h.client.renew("c2", h.deadline()), "CHECKPOINT_CONFLICT")
    await h.client.resume("c1", h.deadline())
    await refused(h.client.commit("c1", h.deadline(), checkpoint_dir), "STALE_CHECKPOINT")
    await refused(h.client.renew("c3", h.deadline()), "INVALID_PHASE", "FAILED_PRECONDITION")


async def test_prepare_close_failure_reopens(harness: Harness) -> None:
    h = harness
    h.participant.fail["close_admission"] = RuntimeError("broken gate")
    error = await refused(drain(h.client.prepare("c1", h.deadline())), "HOOK_FAILED", "INTERNAL")
    assert "broken gate" not in error.message
    status = await h.client.get_status()
    assert status.state == IDLE and status.admission_open and status.checkpoint_id == ""
    del h.participant.fail["close_admission"]
    assert (await drain(h.client.prepare("c1", h.deadline())))[-1].state == PREPARED


async def test_readiness_changes_are_streamed(harness: Harness) -> None:
    h = harness
    first, second = EpisodeId("r1"), EpisodeId("r2")
    h.participant.seed(first, {})
    h.participant.seed(second, {})
    async with contextlib.AsyncExitStack() as in_flight:
        await in_flight.enter_async_context(h.participant.request(first))
        release_second = contextlib.AsyncExitStack()
        await release_second.enter_async_context(h.participant.request(second))
        stream = h.client.prepare("c1", h.deadline())
        initial = await next_message(stream)
        assert [b.capture_key for b in initial.readiness.blockers] == ["r1", "r2"]
        await release_second.aclose()
        change = await next_message(stream)
        assert change.update_kind == pb.PREPARE_UPDATE_KIND_CHANGE
        assert [b.capture_key for b in change.readiness.blockers] == ["r1"]
        assert change.readiness.counts["inflight"] == 1
    final = (await drain(stream))[-1]
    assert final.state == PREPARED and final.readiness.blocker_count == 0


async def test_a_prepare_fenced_to_another_boot_id_changes_nothing(harness: Harness) -> None:
    """`expected_boot_id` naming another process: refused before anything changes (the
    caller means a process this one replaced); the right boot id prepares as usual."""
    h = harness
    await h.http.post("/ng-rollout/r1/seed", json={"state": {"n": 0}})
    boot_id = (await h.client.get_status()).boot_id
    error = await refused(
        drain(h.client.prepare("c1", h.deadline(), expected_boot_id="f" * 32)),
        "BOOT_ID_MISMATCH",
        "FAILED_PRECONDITION",
    )
    assert error.metadata == {"bootId": boot_id, "expectedBootId": "f" * 32}
    status = await h.client.get_status()
    assert status.state == IDLE and status.admission_open and status.checkpoint_id == ""
    assert (await h.http.post("/ng-rollout/r2/seed", json={"state": {}})).status_code == 200
    messages = await drain(h.client.prepare("c1", h.deadline(), expected_boot_id=boot_id))
    assert messages[-1].final and messages[-1].state == PREPARED
