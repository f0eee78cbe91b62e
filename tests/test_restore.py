"""Restore through the real RPCs: verify-then-install, scope, fresh process, readiness."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.runtime import restore_job
from rollout_checkpoint.v1 import types_pb2

from .conftest import Harness, drain, refused, start_harness, stop_harness

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
RESTORED = types_pb2.PARTICIPANT_STATE_RESTORED


async def make_checkpoint(checkpoint_dir: str, states: dict[EpisodeId, object]) -> None:
    """Commit `states` into `checkpoint_dir` from a participant that then goes away."""
    h = await start_harness()
    try:
        for episode, state in states.items():
            h.participant.seed(episode, state)
        await drain(h.client.prepare("c1", h.deadline()))
        await h.client.commit("c1", h.deadline(), checkpoint_dir)
    finally:
        await stop_harness(h)


def part(checkpoint_dir: str) -> Path:
    return Path(checkpoint_dir, "participants", "resources", "double")


async def wait_health(h: Harness, service: str, status: int) -> None:
    await h.wait_health(service, status)


STATES = {
    EpisodeId("r1"): {"b": 1, "a": [1, 2, {"y": 0, "x": 2**70}]},
    EpisodeId("r2", 1): {"n": 2},
    EpisodeId("r3"): {"n": 3},
}


async def test_restore_installs_the_scope_as_the_next_attempt_and_stays_closed(
    harness: Harness, checkpoint_dir: str
) -> None:
    await make_checkpoint(checkpoint_dir, STATES)
    h = harness
    reply = await h.client.restore(
        "restore-1",
        h.deadline(),
        checkpoint_dir,
        [EpisodeId("r1"), EpisodeId("r2", 1), EpisodeId("zz")],
    )
    assert reply.state == RESTORED
    assert reply.source_checkpoint_id == "c1"
    assert list(reply.restored) == ["r1-a1", "r2-a2"]
    assert h.participant.states == {
        EpisodeId("r1", 1): STATES[EpisodeId("r1")],
        EpisodeId("r2", 2): {"n": 2},
    }
    assert json.dumps(h.participant.states[EpisodeId("r1", 1)]) == json.dumps(
        STATES[EpisodeId("r1")]
    )
    status = await h.client.get_status()
    assert status.state == RESTORED and status.checkpoint_id == "restore-1"
    assert not status.admission_open and status.restored_pending == 2
    assert status.HasField("lease_expires_at")
    # Admission stays closed until Resume; readiness is NOT_SERVING while RESTORED.
    refused_seed = await h.http.post("/ng-rollout/r9/seed", json={"state": {}})
    assert (
        refused_seed.status_code == 409
        and refused_seed.json()["error"]["code"] == "admission_closed"
    )
    await wait_health(h, "participant-readiness", NOT_SERVING)
    assert await h.health("participant-liveness") == SERVING
    episodes = await h.client.all_episodes()
    assert [(e.capture_key, e.restored_pending) for e in episodes] == [
        ("r1-a1", True),
        ("r2-a2", True),
    ]
    # A retry replays; other arguments conflict.
    again = await h.client.restore(
        "restore-1",
        h.deadline(),
        checkpoint_dir,
        [EpisodeId("zz"), EpisodeId("r2", 1), EpisodeId("r1")],
    )
    assert again == reply
    await refused(
        h.client.restore("restore-1", h.deadline(), checkpoint_dir, [EpisodeId("r1")]),
        "CHECKPOINT_CONFLICT",
    )
    await h.client.resume("restore-1", h.deadline())
    await wait_health(h, "participant-readiness", SERVING)
    assert (await h.http.get("/ng-rollout/r1-a1/state")).json() == {
        "state": STATES[EpisodeId("r1")]
    }
    assert (await h.http.post("/ng-rollout/r9/seed", json={"state": {}})).status_code == 200


async def test_restored_states_share_their_equal_short_strings_and_keep_their_values(
    harness: Harness, checkpoint_dir: str
) -> None:
    """Each decoded record's equal short strings are one object across the restored states
    (restored_memory.py: they made a third of a restore's memory), and nothing else changes:
    values, key order, number types, long strings, and each state's own containers."""
    long_text = "a note much longer than sixty-four characters, as prose usually is " * 2
    states: dict[EpisodeId, object] = {
        EpisodeId(f"r{i}"): {
            "status": "active",
            "tags": ["urgent", "lab", f"own-{i}"],
            "mail": {"from": "l.marsh@clinic.example", "body": long_text},
            "numbers": [1, 1.0, True, None, "1", 2**70],
            "nested": [[{"role": "assistant", "tool": "send_email"}]],
        }
        for i in range(3)
    }
    await make_checkpoint(checkpoint_dir, states)
    h = harness
    scope = list(states)
    await h.client.restore("restore-1", h.deadline(), checkpoint_dir, scope)
    restored = [h.participant.states[e.next_attempt()] for e in scope]
    for episode, state in zip(scope, restored, strict=True):
        assert json.dumps(state) == json.dumps(states[episode])
        assert [type(v) for v in state["numbers"]] == [int, float, bool, type(None), str, int]
    first, *others = restored
    for other in others:
        assert other["status"] is first["status"]
        assert other["tags"][0] is first["tags"][0] and other["tags"][1] is first["tags"][1]
        assert other["mail"]["from"] is first["mail"]["from"]
        assert other["nested"][0][0]["role"] is first["nested"][0][0]["role"]
        assert other["nested"][0][0]["tool"] is first["nested"][0][0]["tool"]
        assert other["numbers"][4] is first["numbers"][4]
        assert other["mail"]["body"] == first["mail"]["body"]
        assert other["mail"] is not first["mail"] and other["tags"] is not first["tags"]
    # The states stay independent: changing one changes no other.
    first["tags"].append("changed")
    first["mail"]["from"] = "someone@else.example"
    assert all(o["tags"][-1] != "changed" for o in others)
    assert all(o["mail"]["from"] == "l.marsh@clinic.example" for o in others)


async def test_the_reading_thread_returns_the_free_heap_after_the_records_are_read(
    harness: Harness, checkpoint_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`malloc_trim` runs once per restore, in the reading thread (never on the loop),
    and the restore goes on as before."""
    calls: list[str] = []

    def release() -> bool:
        calls.append(threading.current_thread().name)
        return True

    monkeypatch.setattr(restore_job, "release_free_heap", release)
    await make_checkpoint(checkpoint_dir, STATES)
    h = harness
    reply = await h.client.restore("restore-1", h.deadline(), checkpoint_dir, [EpisodeId("r3")])
    assert list(reply.restored) == ["r3-a1"]
    assert h.participant.states == {EpisodeId("r3", 1): {"n": 3}}
    assert len(calls) == 1 and calls[0] != threading.main_thread().name


async def test_restore_with_an_empty_scope_installs_nothing(
    harness: Harness, checkpoint_dir: str
) -> None:
    await make_checkpoint(checkpoint_dir, STATES)
    reply = await harness.client.restore("restore-1", harness.deadline(), checkpoint_dir, [])
    assert list(reply.restored) == [] and reply.state == RESTORED
    assert harness.participant.states == {}


def tamper_flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[data.index(b'"n":3') + 4] = ord("4")
    path.write_bytes(bytes(data))


def tamper_drop_last_newline(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1])


def tamper_append_line(path: Path) -> None:
    path.write_bytes(
        path.read_bytes() + b'{"episode_id":{"rollout_id":"x","attempt":0},"state":1}\n'
    )


@pytest.mark.parametrize("tamper", [tamper_flip_byte, tamper_drop_last_newline, tamper_append_line])
async def test_tampered_records_install_nothing_and_reopen(
    harness: Harness, checkpoint_dir: str, tamper
) -> None:  # type: ignore[no-untyped-def]
    await make_checkpoint(checkpoint_dir, STATES)
    manifest = json.loads((part(checkpoint_dir) / "manifest.json").read_text())
    tamper(part(checkpoint_dir) / manifest["records_file"])
    h = harness
    # Only r1 is in scope, but the whole file is verified: tampering elsewhere still fails.
    error = await refused(
        h.client.restore("restore-1", h.deadline(), checkpoint_dir, [EpisodeId("r1")]),
        "INVALID_CHECKPOINT_STATE",
        "DATA_LOSS",
    )
    assert "digest" in error.message
    assert h.participant.states == {}
    status = await h.client.get_status()
    assert status.state == types_pb2.PARTICIPANT_STATE_IDLE and status.admission_open


async def test_a_record_the_participant_rejects_installs_nothing(
    harness: Harness, checkpoint_dir: str
) -> None:
    await make_checkpoint(checkpoint_dir, STATES)
    # Rewrite a consistent part (digest and all) whose r3 record has an unexpected field.
    h = harness
    manifest_path = part(checkpoint_dir) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    records = (part(checkpoint_dir) / manifest["records_file"]).read_bytes()
    records = records.replace(b'"state":{"n":3}', b'"state":{"n":3},"extra":1')
    import hashlib

    digest = hashlib.sha256(records).hexdigest()
    (part(checkpoint_dir) / manifest["records_file"]).unlink()
    (part(checkpoint_dir) / f"records-{digest}.jsonl").write_bytes(records)
    manifest.update(
        records_file=f"records-{digest}.jsonl", records_sha256=digest, bytes=len(records)
    )
    manifest_path.write_text(json.dumps(manifest, sort_keys=True))
    error = await refused(
        h.client.restore(
            "restore-1", h.deadline(), checkpoint_dir, [EpisodeId("r1"), EpisodeId("r3")]
        ),
        "INVALID_CHECKPOINT_STATE",
        "FAILED_PRECONDITION",
    )
    assert error.metadata["captureKey"] == "r3"
    assert h.participant.states == {}
    assert (await h.client.get_status()).admission_open


async def test_restore_of_another_instance_is_refused(checkpoint_dir: str, tmp_path: Path) -> None:
    await make_checkpoint(checkpoint_dir, STATES)
    manifest_path = part(checkpoint_dir) / "manifest.json"
    other = Path(checkpoint_dir, "participants", "resources", "other")
    other.mkdir()
    for item in part(checkpoint_dir).iterdir():
        (other / item.name).write_bytes(item.read_bytes())
    assert manifest_path.exists()
    from .double import DoubleParticipant

    h = await start_harness(participant=DoubleParticipant("other"))
    try:
        error = await refused(
            h.client.restore("restore-1", h.deadline(), checkpoint_dir, [EpisodeId("r1")]),
            "INVALID_CHECKPOINT_STATE",
            "FAILED_PRECONDITION",
        )
        assert "double" in error.message
    finally:
        await stop_harness(h)


async def test_missing_part_is_data_loss(harness: Harness, tmp_path: Path) -> None:
    await refused(
        harness.client.restore("restore-1", harness.deadline(), str(tmp_path), []),
        "INVALID_CHECKPOINT_STATE",
        "DATA_LOSS",
    )


async def test_a_process_that_served_refuses_restore(harness: Harness, checkpoint_dir: str) -> None:
    await make_checkpoint(checkpoint_dir, STATES)
    h = harness
    assert (await h.http.post("/ng-rollout/r7/seed", json={"state": {}})).status_code == 200
    await refused(
        h.client.restore("restore-1", h.deadline(), checkpoint_dir, [EpisodeId("r1")]),
        "FRESH_PROCESS_REQUIRED",
        "FAILED_PRECONDITION",
    )
    assert EpisodeId("r1", 1) not in h.participant.states


async def test_restore_is_refused_outside_idle(harness: Harness, checkpoint_dir: str) -> None:
    await make_checkpoint(checkpoint_dir, STATES)
    h = harness
    await drain(h.client.prepare("c9", h.deadline()))
    await refused(h.client.restore("c9", h.deadline(), checkpoint_dir, []), "INVALID_PHASE")
    await refused(
        h.client.restore("other", h.deadline(), checkpoint_dir, []), "CHECKPOINT_CONFLICT"
    )


async def test_commit_after_restore_retires_restored_state_the_scope_leaves_out(
    harness: Harness, checkpoint_dir: str, tmp_path: Path
) -> None:
    await make_checkpoint(checkpoint_dir, STATES)
    h = harness
    await h.client.restore("restore-1", h.deadline(), checkpoint_dir, list(STATES))
    await h.client.resume("restore-1", h.deadline())
    await drain(h.client.prepare("c2", h.deadline()))
    # The controller continues only r1-a1; r2-a2 and r3-a1 were never started here.
    reply = await h.client.commit("c2", h.deadline(), str(tmp_path / "c2"), [EpisodeId("r1", 1)])
    assert list(reply.exported) == ["r1-a1"]
    assert list(reply.retired) == ["r2-a2", "r3-a1"]
    assert set(h.participant.states) == {EpisodeId("r1", 1)}
    status = await h.client.get_status()
    # Every restored rollout refuses its crashed attempt (r1 too), and r2, r3 their N+1.
    assert status.retired_rollouts == 3 and status.restored_pending == 1
    await h.client.resume("c2", h.deadline())
    late = await h.http.post("/ng-rollout/r2-a2/seed", json={"state": {}})
    assert late.status_code == 409 and late.json()["error"]["code"] == "stale_attempt"
    # The next attempt of the rollout is admitted (the controller restarts it from its input).
    assert (await h.http.post("/ng-rollout/r2-a3/seed", json={"state": {}})).status_code == 200
