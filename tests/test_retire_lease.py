"""Retire, Forget and the lease, through the real RPCs."""

from __future__ import annotations

import asyncio
import time

import pytest

from rollout_checkpoint.server.core.clock import ManualClock
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.runtime.control_plane import ControlPlane
from rollout_checkpoint.server.runtime.waiting import cancel_and_wait
from rollout_checkpoint.v1 import types_pb2

from .conftest import Harness, drain, refused
from .double import DoubleParticipant


async def seed(h: Harness, key: str) -> int:
    return (await h.http.post(f"/ng-rollout/{key}/seed", json={"state": {"k": key}})).status_code


async def test_retire_is_refused_while_a_checkpoint_is_open(harness: Harness, tmp_path) -> None:  # type: ignore[no-untyped-def]
    h = harness
    await seed(h, "r1")
    await drain(h.client.prepare("c1", h.deadline()))
    error = await refused(
        h.client.retire("c1", h.deadline(), [EpisodeId("r1")]),
        "INVALID_PHASE",
        "FAILED_PRECONDITION",
    )
    assert "resume first" in error.message
    await refused(h.client.forget("c1", h.deadline(), ["r1"]), "INVALID_PHASE")
    await h.client.commit("c1", h.deadline(), str(tmp_path / "ckpt"))
    await refused(h.client.retire("c1", h.deadline(), [EpisodeId("r1")]), "INVALID_PHASE")
    await h.client.resume("c1", h.deadline())
    reply = await h.client.retire("any-id", h.deadline(), [EpisodeId("r1")])
    assert list(reply.retired) == ["r1"]


async def test_retire_marks_refuse_late_requests_and_only_rise(harness: Harness) -> None:
    h = harness
    assert await seed(h, "r1-a2") == 200
    reply = await h.client.retire("x", h.deadline(), [EpisodeId("r1", 2)])
    assert list(reply.retired) == ["r1-a2"]
    assert EpisodeId("r1", 2) not in h.participant.states
    for key in ("r1", "r1-a1", "r1-a2"):
        late = await h.http.post(f"/ng-rollout/{key}/seed", json={"state": {}})
        assert late.status_code == 409 and late.json()["error"]["code"] == "stale_attempt", key
    # Retiring an earlier attempt never lowers the mark.
    await h.client.retire("x", h.deadline(), [EpisodeId("r1", 0)])
    assert (await h.http.post("/ng-rollout/r1-a2/seed", json={"state": {}})).status_code == 409
    assert await seed(h, "r1-a3") == 200
    assert (await h.client.get_status()).retired_rollouts == 1
    # Retiring again (or something unknown) is harmless.
    await h.client.retire("x", h.deadline(), [EpisodeId("r1", 2), EpisodeId("unknown")])
    forgotten = await h.client.forget("x", h.deadline(), ["r1", "unknown", "r1"])
    assert list(forgotten.forgotten) == ["r1", "unknown"]
    assert await seed(h, "r1-a1") == 200
    assert (await h.client.get_status()).retired_rollouts == 0


async def test_a_cut_short_retire_keeps_refusing_and_a_retry_finishes(harness: Harness) -> None:
    h = harness
    assert await seed(h, "r1") == 200
    release = h.participant.gate("retire")
    deadline = h.deadline(5)
    call = asyncio.ensure_future(h.client.retire("x", deadline, [EpisodeId("r1")]))
    await asyncio.wait_for(h.participant.entered["retire"].wait(), 30)
    h.clock.set(deadline + 1)
    await refused(call, "CHECKPOINT_DEADLINE_EXCEEDED")
    assert EpisodeId("r1") in h.participant.states  # still held, still tracked
    assert (await h.http.post("/ng-rollout/r1/seed", json={"state": {}})).status_code == 409
    await refused(
        h.client.forget("x", h.deadline(), ["r1"]), "RETIRE_INCOMPLETE", "FAILED_PRECONDITION"
    )
    release.set()
    await h.client.retire("x", h.deadline(), [EpisodeId("r1")])
    assert EpisodeId("r1") not in h.participant.states
    assert list((await h.client.forget("x", h.deadline(), ["r1"])).forgotten) == ["r1"]


async def test_retire_in_restored_needs_the_restore_id(harness: Harness, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from .test_restore import STATES, make_checkpoint

    ckpt = str(tmp_path / "ckpt")
    await make_checkpoint(ckpt, STATES)
    h = harness
    await h.client.restore("restore-1", h.deadline(), ckpt, list(STATES))
    lease_before = (await h.client.get_status()).lease_expires_at.ToSeconds()
    await refused(
        h.client.retire("other", h.deadline(), [EpisodeId("r3", 1)]), "CHECKPOINT_CONFLICT"
    )
    h.clock.advance(100)
    await h.client.retire("restore-1", h.deadline(), [EpisodeId("r3", 1)])
    status = await h.client.get_status()
    assert status.lease_expires_at.ToSeconds() > lease_before  # renewed
    assert status.state == types_pb2.PARTICIPANT_STATE_RESTORED
    assert EpisodeId("r3", 1) not in h.participant.states


async def test_lease_expiry_resumes_on_its_own_and_fences_the_id(
    harness: Harness, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    h = harness
    await drain(h.client.prepare("c1", h.deadline(10)))
    status = await h.client.get_status()
    expires = status.lease_expires_at.ToSeconds()
    assert expires == int(h.clock.now() + 10 + 600) == h.control.lease_expires_at
    h.clock.set(expires - 1)
    # The lease watcher is (still) asleep until the lease, and nothing the move woke is left
    # to run: the participant cannot have resumed on its own.
    await h.clock.sleeping_until(expires)
    assert (await h.client.get_status()).state == types_pb2.PARTICIPANT_STATE_PREPARED
    h.clock.set(expires + 1)
    await h.until(lambda: h.control.state == "IDLE")
    status = await h.client.get_status()
    assert status.state == types_pb2.PARTICIPANT_STATE_IDLE and status.admission_open
    assert not status.HasField("lease_expires_at")
    await refused(h.client.commit("c1", h.deadline(), str(tmp_path / "x")), "STALE_CHECKPOINT")
    assert await seed(h, "r1") == 200


async def test_renew_keeps_the_lease(harness: Harness) -> None:
    h = harness
    await drain(h.client.prepare("c1", h.deadline(10)))
    first = (await h.client.get_status()).lease_expires_at.ToSeconds()
    h.clock.set(first - 5)
    renewed = await h.client.renew("c1", h.deadline(60))
    assert renewed.lease_expires_at.ToSeconds() == int(h.clock.now() + 60 + 600)
    # A renewal with an earlier deadline never shrinks the lease.
    again = await h.client.renew("c1", h.deadline(1))
    assert again.lease_expires_at == renewed.lease_expires_at
    lease = renewed.lease_expires_at.ToSeconds()
    assert lease == h.control.lease_expires_at
    h.clock.set(first + 10)
    # Past the first lease, the watcher woke and went back to sleep until the renewed one
    # (it would have ended, resuming, had the first lease still held).
    await h.clock.sleeping_until(lease)
    assert (await h.client.get_status()).state == types_pb2.PARTICIPANT_STATE_PREPARED


async def test_a_dead_lease_watcher_turns_liveness_off(harness: Harness) -> None:
    from grpc_health.v1 import health_pb2

    h = harness
    await drain(h.client.prepare("c1", h.deadline(10)))

    async def broken(*args: object) -> bool:
        raise RuntimeError("the watcher cannot resume")

    h.control.resume_on_expiry = broken  # type: ignore[method-assign]
    h.clock.advance(10 + 600 + 1)
    await h.wait_health("participant-liveness", health_pb2.HealthCheckResponse.NOT_SERVING)
    # Control RPCs still answer: only the kubelet's restart can help now.
    assert (await h.client.get_status()).state == types_pb2.PARTICIPANT_STATE_PREPARED


async def test_closing_the_control_plane_does_not_swallow_its_own_cancellation() -> None:
    """`close()` waits for its duties to end; a shutdown that cancels `close()` meanwhile
    must stop there (it used to be swallowed with the duties' own cancellations)."""
    control = ControlPlane(DoubleParticipant(), clock=ManualClock())
    cancelled, release = asyncio.Event(), asyncio.Event()

    async def slow_to_end() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            await release.wait()  # a duty that takes its time to end once cancelled
            raise

    control._duties.spawn(slow_to_end())
    await asyncio.sleep(0)
    closing = asyncio.create_task(control.close())
    await asyncio.wait_for(cancelled.wait(), 10)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(closing, 10)
    release.set()
    await asyncio.wait_for(control.close(), 10)


async def test_cancel_and_wait_swallows_only_the_cancellation_it_asked_for() -> None:
    first_cancellation = asyncio.Event()

    async def worker() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            first_cancellation.set()
            await asyncio.Event().wait()  # ends at the next cancellation

    task = asyncio.create_task(worker())
    await asyncio.sleep(0)
    waiting = asyncio.create_task(cancel_and_wait(task))
    await asyncio.wait_for(first_cancellation.wait(), 10)
    waiting.cancel()  # the caller's own cancellation propagates (and reaches the worker)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiting, 10)
    assert task.cancelled()
    await asyncio.wait_for(cancel_and_wait(task), 10)  # the worker's cancellation is swallowed


def test_a_manual_clock_starts_at_the_real_time() -> None:
    """Code under test also reads the wall clock (storage calls bounded by `time.time()`): a
    deadline taken from a test's manual clock must mean the same moment to it on whatever
    day the suite runs, not only before a fixed date the clock used to start at."""
    assert abs(ManualClock().now() - time.time()) < 60
    assert ManualClock(5.0).now() == 5.0
