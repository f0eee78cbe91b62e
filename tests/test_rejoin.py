"""A rejoining Restore through the real RPCs: a process that has served is restored again.

A survivor of a fleet one of whose members was replaced must be restorable with the rest of
the fleet from the last checkpoint. Without `rejoin` it refuses (FRESH_PROCESS_REQUIRED);
with it, every episode it holds is retired as by Retire (late requests of those attempts get
`stale_attempt`), it forgets having served, and the checkpoint's episodes are installed as
attempt N+1. The data plane is sealed (`awaiting_restore`) from the join until the restore
fails or is resumed, and a failed rejoin leaves the discarded episodes retired and admission
open again.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.runtime.participant import Participant
from rollout_checkpoint.v1 import types_pb2

from .conftest import Harness, refused, start_harness, stop_harness
from .double import DoubleParticipant
from .test_resources import prepared as resources_prepared
from .test_resources import running
from .test_restore import STATES, make_checkpoint, part, tamper_flip_byte

IDLE = types_pb2.PARTICIPANT_STATE_IDLE
RESTORED = types_pb2.PARTICIPANT_STATE_RESTORED
SCOPE = [EpisodeId("r1"), EpisodeId("r2", 1)]
"""The checkpointed episodes the tests continue (r3 is in the checkpoint, not in scope)."""


async def serve_as_a_survivor(h: Harness) -> None:
    """What a survivor did since the checkpoint: continued r1 and r2-a1 (their states moved
    on) and started r7, which no checkpoint holds."""
    for key, state in (("r1", {"moved": 1}), ("r2-a1", {"moved": 2}), ("r7", {"new": 7})):
        reply = await h.http.post(f"/ng-rollout/{key}/seed", json={"state": state})
        assert reply.status_code == 200, reply.text


async def data_plane_code(h: Harness, key: str) -> int | str:
    """The update of `key`: 200, or the 409 refusal's code."""
    reply = await h.http.post(f"/ng-rollout/{key}/update", json={"state": {"late": True}})
    return 200 if reply.status_code == 200 else str(reply.json()["error"]["code"])


async def test_a_survivor_refuses_restore_without_rejoin_and_is_restored_with_it(
    harness: Harness, checkpoint_dir: str
) -> None:
    await make_checkpoint(checkpoint_dir, STATES)
    h = harness
    await serve_as_a_survivor(h)
    await refused(
        h.client.restore("restore-1", h.deadline(), checkpoint_dir, SCOPE),
        "FRESH_PROCESS_REQUIRED",
        "FAILED_PRECONDITION",
    )
    reply = await h.client.restore("restore-1", h.deadline(), checkpoint_dir, SCOPE, rejoin=True)
    assert reply.state == RESTORED and list(reply.restored) == ["r1-a1", "r2-a2"]
    # Every held episode was retired (through the hook), and only the checkpoint's are held.
    assert set(h.participant.retired_log) == {EpisodeId("r1"), EpisodeId("r2", 1), EpisodeId("r7")}
    assert h.participant.states == {
        EpisodeId("r1", 1): STATES[EpisodeId("r1")],
        EpisodeId("r2", 2): {"n": 2},
    }
    episodes = await h.client.all_episodes()
    assert [(e.capture_key, e.restored_pending) for e in episodes] == [
        ("r1-a1", True),
        ("r2-a2", True),
    ]
    # A retry with the same arguments replays; without rejoin it is another restore.
    again = await h.client.restore("restore-1", h.deadline(), checkpoint_dir, SCOPE, rejoin=True)
    assert again == reply
    await refused(
        h.client.restore("restore-1", h.deadline(), checkpoint_dir, SCOPE), "CHECKPOINT_CONFLICT"
    )
    # Sealed until Resume, like a start_closed process.
    assert await data_plane_code(h, "r8") == "awaiting_restore"
    await h.client.resume("restore-1", h.deadline())
    # The discarded attempts are refused; the restored attempt N+1 works on restored state.
    for key in ("r1", "r2-a1", "r7"):
        assert await data_plane_code(h, key) == "stale_attempt", key
    assert (await h.http.get("/ng-rollout/r1-a1/state")).json() == {
        "state": STATES[EpisodeId("r1")]
    }
    assert await data_plane_code(h, "r1-a1") == 200
    assert (await h.http.post("/ng-rollout/r8/seed", json={"state": {}})).status_code == 200
    assert (await h.client.get_status()).retired_rollouts == 3


async def test_a_fresh_process_restores_with_rejoin_as_without_it(
    harness: Harness, checkpoint_dir: str
) -> None:
    await make_checkpoint(checkpoint_dir, STATES)
    h = harness
    reply = await h.client.restore("restore-1", h.deadline(), checkpoint_dir, SCOPE, rejoin=True)
    assert list(reply.restored) == ["r1-a1", "r2-a2"]
    assert h.participant.retired_log == []  # nothing held, nothing discarded
    assert (await h.client.get_status()).retired_rollouts == 2  # r1 and r2: the restore's own


async def test_a_failed_rejoin_keeps_the_discarded_episodes_retired_and_reopens(
    harness: Harness, checkpoint_dir: str
) -> None:
    await make_checkpoint(checkpoint_dir, STATES)
    manifest = json.loads((part(checkpoint_dir) / "manifest.json").read_text())
    records = part(checkpoint_dir) / manifest["records_file"]
    intact = records.read_bytes()
    tamper_flip_byte(records)
    h = harness
    await serve_as_a_survivor(h)
    await refused(
        h.client.restore("restore-1", h.deadline(), checkpoint_dir, SCOPE, rejoin=True),
        "INVALID_CHECKPOINT_STATE",
        "DATA_LOSS",
    )
    status = await h.client.get_status()
    assert status.state == IDLE and status.admission_open
    assert h.participant.states == {}
    # The discarded episodes are not coming back; new work is admitted again (unsealed).
    for key in ("r1", "r2-a1", "r7"):
        assert await data_plane_code(h, key) == "stale_attempt", key
    assert (await h.http.post("/ng-rollout/r8/seed", json={"state": {}})).status_code == 200
    # The same restore, retried once the part is intact again, works: it discards r8 too.
    records.write_bytes(intact)
    reply = await h.client.restore("restore-1", h.deadline(), checkpoint_dir, SCOPE, rejoin=True)
    assert list(reply.restored) == ["r1-a1", "r2-a2"]
    assert EpisodeId("r8") in h.participant.retired_log


async def test_a_process_still_serving_after_the_discard_is_refused_and_reopens(
    harness: Harness, checkpoint_dir: str
) -> None:
    await make_checkpoint(checkpoint_dir, STATES)
    h = harness
    await serve_as_a_survivor(h)
    # A request of r7 that its retire does not stop (the double's retire frees state only).
    held = asyncio.ensure_future(
        h.http.post("/ng-rollout/r7/update", json={"state": {"held": True}, "hold": True})
    )
    await h.until(lambda: h.participant.inflight.get("r7") == 1)
    await refused(
        h.client.restore("restore-1", h.deadline(), checkpoint_dir, SCOPE, rejoin=True),
        "FRESH_PROCESS_REQUIRED",
    )
    status = await h.client.get_status()
    assert status.state == IDLE and status.admission_open
    assert not h.control.start_closed_pending
    assert EpisodeId("r1", 1) not in h.participant.states
    # Refused after the discard: what it retired stays retired.
    assert set(h.participant.retired_log) == {EpisodeId("r1"), EpisodeId("r2", 1), EpisodeId("r7")}
    assert await data_plane_code(h, "r1") == "stale_attempt"
    await h.http.post("/test/release")
    assert (await held).status_code == 200


class Unforgetting(DoubleParticipant):
    """A kind that does not implement `forget_served`: the default keeps the memory."""

    def forget_served(self) -> None:
        Participant.forget_served(self)


async def test_a_kind_that_cannot_forget_refuses_a_rejoin(checkpoint_dir: str) -> None:
    await make_checkpoint(checkpoint_dir, STATES)
    h = await start_harness(participant=Unforgetting())
    try:
        await serve_as_a_survivor(h)
        await refused(
            h.client.restore("restore-1", h.deadline(), checkpoint_dir, SCOPE, rejoin=True),
            "FRESH_PROCESS_REQUIRED",
        )
        assert (await h.client.get_status()).admission_open
        assert h.participant.states == {}
    finally:
        await stop_harness(h)


async def test_a_resume_during_the_discard_abandons_the_restore_at_once(
    harness: Harness, checkpoint_dir: str
) -> None:
    await make_checkpoint(checkpoint_dir, STATES)
    h = harness
    await serve_as_a_survivor(h)
    release = h.participant.gate("retire")
    restore = asyncio.ensure_future(
        h.client.restore("restore-1", h.deadline(), checkpoint_dir, SCOPE, rejoin=True)
    )
    await asyncio.wait_for(h.participant.entered["retire"].wait(), 30)
    # Marked before the hooks run; sealed; the rollouts being discarded cannot be forgotten.
    assert await data_plane_code(h, "r1") == "stale_attempt"
    assert (await h.http.post("/ng-rollout/r9/seed", json={"state": {}})).json()["error"][
        "code"
    ] == "awaiting_restore"
    assert not (await h.client.get_status()).admission_open
    await refused(h.client.forget("cleanup-1", h.deadline(), ["r1"]), "RETIRE_INCOMPLETE")
    # The Resume does not wait for the discard's retires.
    resumed = await h.client.resume("restore-1", h.deadline())
    assert not resumed.idempotent
    status = await h.client.get_status()
    assert status.state == IDLE and status.admission_open
    assert not restore.done()
    release.set()
    await refused(restore, "STALE_CHECKPOINT")
    # The retires went on to their end; nothing was forgotten, nothing installed.
    assert set(h.participant.retired_log) == {EpisodeId("r1"), EpisodeId("r2", 1), EpisodeId("r7")}
    assert h.participant.states == {} and h.participant.served
    assert (await h.http.post("/ng-rollout/r9/seed", json={"state": {}})).status_code == 200


async def test_a_resources_survivor_restores_its_sessions_under_their_own_ids(
    tmp_path: Path,
) -> None:
    """The checkpointed sessions are the very sessions the rejoin retires (same ids): they
    must not stay remembered as retired, or the restored session would be refused."""
    ckpt = str(tmp_path / "ckpt")
    async with running() as r:
        episode = r.browser()
        assert (
            await episode.post("/ng-rollout/r/seed_session", json={"initial_count": 3})
        ).status_code == 200
        await episode.post("/ng-rollout/r/increment_counter", json={"count": 2})
        assert (await resources_prepared(r)).state == types_pb2.PARTICIPANT_STATE_PREPARED
        await r.client.commit("c1", r.deadline(), ckpt, [EpisodeId("r")])
        await r.client.resume("c1", r.deadline())
        # The survivor serves on: r's session moves past the cut, s starts after it.
        await episode.post("/ng-rollout/r/increment_counter", json={"count": 2})
        other = r.browser()
        await other.post("/ng-rollout/s/seed_session", json={"initial_count": 1})
        await refused(
            r.client.restore("restore-1", r.deadline(), ckpt, [EpisodeId("r")]),
            "FRESH_PROCESS_REQUIRED",
        )
        reply = await r.client.restore(
            "restore-1", r.deadline(), ckpt, [EpisodeId("r")], rejoin=True
        )
        assert list(reply.restored) == ["r-a1"]
        await r.client.resume("restore-1", r.deadline())
        stale = await episode.post("/ng-rollout/r/get_counter_value", json={})
        assert stale.status_code == 409 and stale.json()["error"]["code"] == "stale_attempt"
        stale = await other.post("/ng-rollout/s/get_counter_value", json={})
        assert stale.status_code == 409 and stale.json()["error"]["code"] == "stale_attempt"
        # The old cookie, as attempt N+1: the checkpointed count, not the survivor's later one.
        value = await episode.post("/ng-rollout/r-a1/get_counter_value", json={})
        assert value.status_code == 200 and value.json() == {"count": 5}
        verified = await episode.post("/ng-rollout/r-a1/verify", json={"expected_count": 5})
        assert verified.json()["reward"] == 1.0
