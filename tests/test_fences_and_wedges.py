"""Restores that fail leave nothing behind, attempts stay fenced, and storage cannot wedge.

Each test here reproduces a defect found by driving real participants as a hostile operator
or a flaky cluster would (issue 12): a Resume racing a Restore, a deadline passing during the
install, a late request of the crashed attempt, a Commit stopped by a Resume, a failed
commit pinning its arguments, and storage whose writer never returns.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.part_storage import LocalStorage, WriteFence
from rollout_checkpoint.v1 import types_pb2

from .conftest import Harness, prepared, refused, start_harness, stop_harness
from .test_commit import GatedStorage
from .test_restore import STATES, make_checkpoint

PART = ("participants", "resources", "double")


async def in_thread(event: threading.Event) -> None:
    assert await asyncio.to_thread(event.wait, 10)


def spy_on(h: Harness, method: str) -> asyncio.Event:
    """An event set when the control plane's `method` is entered (before its first await)."""
    entered = asyncio.Event()
    original = getattr(h.control, method)

    async def spy(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        return await original(*args, **kwargs)

    setattr(h.control, method, spy)
    return entered


async def restore_held_in_install(
    h: Harness, checkpoint_dir: str
) -> tuple[asyncio.Event, asyncio.Future[Any]]:
    """A Restore of STATES (id r-1) whose install hook is entered and held at its gate."""
    await make_checkpoint(checkpoint_dir, STATES)
    gate = h.participant.gate("install")
    restore = asyncio.ensure_future(
        h.client.restore("r-1", h.deadline(), checkpoint_dir, list(STATES))
    )
    await asyncio.wait_for(h.participant.entered["install"].wait(), 10)
    return gate, restore


# -- a failed restore leaves nothing installed ----------------------------------------------


async def test_an_install_that_outlives_its_deadline_is_undone_and_a_retry_works(
    harness: Harness, checkpoint_dir: str
) -> None:
    await make_checkpoint(checkpoint_dir, STATES)
    h = harness
    gate = h.participant.gate("install")
    deadline = h.deadline(30)
    call = asyncio.ensure_future(h.client.restore("r-1", deadline, checkpoint_dir, list(STATES)))
    await asyncio.wait_for(h.participant.entered["install"].wait(), 10)
    h.clock.set(deadline + 1)
    await refused(call, "CHECKPOINT_DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED")
    gate.set()
    await h.until(lambda: h.control._machine.restore_job is None)
    # Nothing stays installed, the process is still fresh and open, nothing is fenced.
    assert h.participant.states == {} and h.participant.pending == set()
    assert sorted(h.participant.discarded) == sorted(e.next_attempt() for e in STATES)
    assert not h.participant.has_served()
    status = await h.client.get_status()
    assert status.state == types_pb2.PARTICIPANT_STATE_IDLE and status.admission_open
    assert status.retired_rollouts == 0
    # The same restore, retried, works.
    del h.participant.gates["install"]
    reply = await h.client.restore("r-1", h.deadline(), checkpoint_dir, list(STATES))
    assert list(reply.restored) == ["r1-a1", "r2-a2", "r3-a1"]
    assert set(h.participant.states) == {e.next_attempt() for e in STATES}


async def test_a_resume_naming_a_running_restore_waits_for_its_install(
    harness: Harness, checkpoint_dir: str
) -> None:
    h = harness
    gate, restore = await restore_held_in_install(h, checkpoint_dir)
    resume_entered = spy_on(h, "resume")
    resume = asyncio.ensure_future(h.client.resume("r-1", h.deadline()))
    await asyncio.wait_for(resume_entered.wait(), 10)
    assert not h.control.admission_open  # never opened over a half-finished install
    gate.set()
    # The restore completes (it is not turned into STALE_CHECKPOINT with its state left
    # installed), and the resume then ends it like any restore.
    restored = await restore
    assert list(restored.restored) == ["r1-a1", "r2-a2", "r3-a1"]
    assert not (await resume).idempotent
    status = await h.client.get_status()
    assert status.state == types_pb2.PARTICIPANT_STATE_IDLE and status.admission_open
    assert set(h.participant.states) == {e.next_attempt() for e in STATES}


async def test_a_resume_abandons_a_restore_still_reading(checkpoint_dir: str) -> None:
    await make_checkpoint(checkpoint_dir, STATES)
    reading = threading.Event()
    release = threading.Event()

    class SlowRead(LocalStorage):
        def read_part(self, *args: Any, **kwargs: Any) -> Any:
            reading.set()
            release.wait(30)
            return super().read_part(*args, **kwargs)

    h = await start_harness(storage=SlowRead(), start_closed=True)
    try:
        restore = asyncio.ensure_future(
            h.client.restore("r-1", h.deadline(), checkpoint_dir, list(STATES))
        )
        await in_thread(reading)
        # Nothing is installed yet: the resume answers at once and opens the process.
        reply = await h.client.resume("r-1", h.deadline())
        assert not reply.idempotent
        assert (await h.client.get_status()).admission_open
        release.set()
        await refused(restore, "STALE_CHECKPOINT", "ABORTED")
        assert h.participant.states == {}
    finally:
        release.set()
        await stop_harness(h)


async def test_a_resume_of_another_id_during_a_restore_is_a_conflict(
    harness: Harness, checkpoint_dir: str
) -> None:
    h = harness
    gate, restore = await restore_held_in_install(h, checkpoint_dir)
    error = await refused(h.client.resume("other", h.deadline()), "CHECKPOINT_CONFLICT")
    assert error.metadata["activeCheckpointId"] == "r-1"
    gate.set()
    await restore
    assert (await h.client.get_status()).state == types_pb2.PARTICIPANT_STATE_RESTORED


async def test_a_restore_that_never_finishes_reading_ends_at_its_deadline(
    checkpoint_dir: str,
) -> None:
    """A hung read (a FIFO, a frozen filesystem) must cost that restore, not every later
    Restore and Prepare (CHECKPOINT_CONFLICT forever)."""
    await make_checkpoint(checkpoint_dir, STATES)
    release = threading.Event()
    hung = threading.Event()

    class HungOnce(LocalStorage):
        def read_part(self, *args: Any, **kwargs: Any) -> Any:
            if not hung.is_set():
                hung.set()
                release.wait(60)
            return super().read_part(*args, **kwargs)

    h = await start_harness(storage=HungOnce())
    try:
        deadline = h.deadline(30)
        call = asyncio.ensure_future(h.client.restore("r-1", deadline, checkpoint_dir, []))
        await in_thread(hung)
        h.clock.set(deadline + 1)
        await refused(call, "CHECKPOINT_DEADLINE_EXCEEDED")
        await h.until(lambda: h.control._machine.restore_job is None)
        reply = await h.client.restore("r-1", h.deadline(), checkpoint_dir, list(STATES))
        assert list(reply.restored) == ["r1-a1", "r2-a2", "r3-a1"]
    finally:
        release.set()
        await stop_harness(h)


# -- attempts stay fenced ---------------------------------------------------------------------


async def test_a_late_request_of_the_crashed_attempt_cannot_change_the_restored_state(
    harness: Harness, checkpoint_dir: str
) -> None:
    await make_checkpoint(checkpoint_dir, STATES)
    h = harness
    await h.client.restore("r-1", h.deadline(), checkpoint_dir, list(STATES))
    await h.client.resume("r-1", h.deadline())
    late = await h.http.post("/ng-rollout/r2-a1/update", json={"state": {"n": 1007}})
    assert late.status_code == 409 and late.json()["error"]["code"] == "stale_attempt"
    late = await h.http.post("/ng-rollout/r1/update", json={"state": {"n": 1007}})
    assert late.status_code == 409 and late.json()["error"]["code"] == "stale_attempt"
    assert h.participant.states[EpisodeId("r2", 2)] == {"n": 2}
    current = await h.http.post("/ng-rollout/r2-a2/update", json={"state": {"n": 3}})
    assert current.status_code == 200


# -- typed answers when a Resume stops a Commit ----------------------------------------------


async def test_a_commit_whose_write_a_resume_stops_answers_stale_checkpoint(
    checkpoint_dir: str,
) -> None:
    storage = GatedStorage("before_record")
    h = await start_harness(storage=storage)
    try:
        h.participant.seed(EpisodeId("r1"), {"n": 1})
        await prepared(h)
        commit = asyncio.ensure_future(h.client.commit("c1", h.deadline(), checkpoint_dir))
        await in_thread(storage.reached)
        assert not (await h.client.resume("c1", h.deadline())).idempotent
        storage.release.set()
        error = await refused(commit, "STALE_CHECKPOINT", "ABORTED")
        assert error.metadata["checkpointId"] == "c1"
        await in_thread(storage.finished)
        assert not Path(checkpoint_dir, *PART, "manifest.json").exists()
    finally:
        storage.release.set()
        await stop_harness(h)


async def test_a_commit_whose_export_a_resume_cancels_answers_stale_checkpoint(
    harness: Harness, checkpoint_dir: str
) -> None:
    h = harness
    h.participant.seed(EpisodeId("r1"), {"n": 1})
    await prepared(h)
    h.participant.gate("export")
    commit = asyncio.ensure_future(h.client.commit("c1", h.deadline(), checkpoint_dir))
    await asyncio.wait_for(h.participant.entered["export"].wait(), 10)
    assert not (await h.client.resume("c1", h.deadline())).idempotent
    # Before: the CancelledError escaped the handler and grpc.aio sent no status at all.
    await asyncio.wait_for(refused(commit, "STALE_CHECKPOINT", "ABORTED"), 10)
    assert not Path(checkpoint_dir, *PART).exists() or not os.listdir(Path(checkpoint_dir, *PART))


async def test_a_failed_commit_does_not_pin_its_arguments(harness: Harness, tmp_path: Path) -> None:
    h = harness
    h.participant.seed(EpisodeId("r1"), {"n": 1})
    await prepared(h)
    blocked = tmp_path / "no-parent" / "ckpt"  # its parent does not exist: never created
    await refused(h.client.commit("c1", h.deadline(), str(blocked)), "STORAGE_FAILED")
    assert (await h.client.get_status()).state == types_pb2.PARTICIPANT_STATE_PREPARED
    h.participant.states[EpisodeId("r1")] = {"n": 2}  # never stored: export happens once
    good = tmp_path / "good"
    reply = await h.client.commit("c1", h.deadline(), str(good))
    assert list(reply.exported) == ["r1"] and h.participant.export_calls == 1
    records = Path(good, *PART, reply.manifest.records_file).read_text()
    assert '"state":{"n":1}' in records


async def test_a_failed_commit_with_another_scope_exports_anew(
    harness: Harness, tmp_path: Path
) -> None:
    h = harness
    h.participant.seed(EpisodeId("r1"), {"n": 1})
    h.participant.seed(EpisodeId("r2"), {"n": 2})
    await prepared(h)
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the checkpoint directory should be")
    await refused(h.client.commit("c1", h.deadline(), str(blocked), None), "INVALID_REQUEST")
    reply = await h.client.commit("c1", h.deadline(), str(tmp_path / "ok"), [EpisodeId("r2")])
    assert list(reply.exported) == ["r2"]


# -- storage that never returns wedges nothing ----------------------------------------------


class NeverReturns(LocalStorage):
    """A writer stuck for good (a frozen filesystem) until the test ends."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()
        self.finished = threading.Event()
        self.fences: list[WriteFence] = []

    def write_part(self, *args: Any, **kwargs: Any) -> Any:
        self.fences.append(args[5])
        self.entered.set()
        try:
            self.release.wait(120)
            return super().write_part(*args, **kwargs)
        finally:
            self.finished.set()


async def commit_past_its_deadline(h: Harness, storage: NeverReturns, checkpoint_dir: str) -> None:
    """A prepared participant whose commit's write hangs and whose call's deadline passed."""
    h.participant.seed(EpisodeId("r1"), {"n": 1})
    await prepared(h)
    deadline = h.deadline(20)
    commit = asyncio.ensure_future(h.client.commit("c1", deadline, checkpoint_dir))
    await in_thread(storage.entered)
    h.clock.set(deadline + 1)
    await refused(commit, "CHECKPOINT_DEADLINE_EXCEEDED")


async def test_a_writer_that_never_returns_wedges_no_rpc_and_never_publishes(
    checkpoint_dir: str,
) -> None:
    storage = NeverReturns()
    h = await start_harness(storage=storage)
    try:
        await commit_past_its_deadline(h, storage, checkpoint_dir)
        # Every RPC still answers; the resume reopens within its deadline.
        await h.client.renew("c1", h.deadline())
        assert (await h.client.get_status()).state == types_pb2.PARTICIPANT_STATE_PREPARED
        resume = await asyncio.wait_for(h.client.resume("c1", h.deadline(5)), 10)
        assert not resume.idempotent
        assert (await h.client.get_status()).admission_open
        # The abandoned writer, once storage comes back, can never publish.
        assert storage.fences[0].stopped
        storage.release.set()
        await in_thread(storage.finished)
        await prepared(h, "c2")
        other = Path(checkpoint_dir).parent / "c2"
        reply = await h.client.commit("c2", h.deadline(), str(other))
        assert reply.manifest.checkpoint_id == "c2"
        assert not Path(checkpoint_dir, *PART, "manifest.json").exists()
    finally:
        storage.release.set()
        await stop_harness(h)


async def test_lease_expiry_reopens_despite_a_writer_that_never_returns(
    checkpoint_dir: str,
) -> None:
    storage = NeverReturns()
    h = await start_harness(storage=storage)
    try:
        await commit_past_its_deadline(h, storage, checkpoint_dir)
        lease = h.control.lease_expires_at
        assert lease is not None
        h.clock.set(lease + 1)  # the controller died: nobody calls Resume
        await h.until(lambda: h.control.admission_open)
        assert h.control.state.value == "IDLE"
        await refused(h.client.commit("c1", h.deadline(), checkpoint_dir), "STALE_CHECKPOINT")
        storage.release.set()
        assert storage.fences[0].stopped
    finally:
        storage.release.set()
        await stop_harness(h)


async def test_a_publication_under_way_is_waited_for_only_until_the_resume_deadline(
    checkpoint_dir: str,
) -> None:
    storage = GatedStorage("before_manifest_link")
    h = await start_harness(storage=storage)
    try:
        h.participant.seed(EpisodeId("r1"), {"n": 1})
        await prepared(h)
        commit = asyncio.ensure_future(h.client.commit("c1", h.deadline(), checkpoint_dir))
        await in_thread(storage.reached)
        resume_entered = spy_on(h, "resume")
        deadline = h.deadline(5)
        resume = asyncio.ensure_future(h.client.resume("c1", deadline))
        await asyncio.wait_for(resume_entered.wait(), 10)
        assert storage.fence is not None
        assert storage.fence.publishing and storage.fence.stopped
        h.clock.set(deadline + 1)
        assert not (await asyncio.wait_for(resume, 10)).idempotent
        assert (await h.client.get_status()).admission_open
        storage.release.set()
        await in_thread(storage.finished)
        # The link had begun: the part is complete and consistent with the cut.
        assert Path(checkpoint_dir, *PART, "manifest.json").exists()
        await asyncio.gather(commit, return_exceptions=True)
    finally:
        storage.release.set()
        await stop_harness(h)
