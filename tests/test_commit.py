"""Commit through the real RPCs: phases, export-once, slow writes, conflicts, JSON fidelity."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path

import pytest

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.part_storage import LocalStorage, WriteFence
from rollout_checkpoint.v1 import types_pb2

from .conftest import Harness, prepared, refused, start_harness, stop_harness

PART = ("participants", "resources", "double")


def part_dir(checkpoint_dir: str) -> Path:
    return Path(checkpoint_dir, *PART)


def records_of(checkpoint_dir: str) -> list[str]:
    manifest = json.loads((part_dir(checkpoint_dir) / "manifest.json").read_text())
    return (part_dir(checkpoint_dir) / manifest["records_file"]).read_text().splitlines()


async def test_commit_before_prepare_is_invalid_phase(
    harness: Harness, checkpoint_dir: str
) -> None:
    error = await refused(
        harness.client.commit("c1", harness.deadline(), checkpoint_dir),
        "INVALID_PHASE",
        "FAILED_PRECONDITION",
    )
    assert error.metadata["state"] == "IDLE"
    assert not Path(checkpoint_dir).exists()


async def test_commit_writes_records_and_manifest(harness: Harness, checkpoint_dir: str) -> None:
    h = harness
    h.participant.seed(EpisodeId("r1"), {"z": 1, "a": {"y": 2, "b": 3}})
    h.participant.seed(EpisodeId("r2", 3), {"n": 2**80})
    await prepared(h)
    reply = await h.client.commit("c1", h.deadline(), checkpoint_dir)
    assert reply.state == types_pb2.PARTICIPANT_STATE_COMMITTED
    assert list(reply.exported) == ["r1", "r2-a3"]
    manifest_bytes = (part_dir(checkpoint_dir) / "manifest.json").read_bytes()
    manifest = json.loads(manifest_bytes)
    assert list(manifest) == sorted(manifest)
    assert manifest == {
        "schema_version": 1,
        "kind": "resources",
        "instance": "double",
        "checkpoint_id": "c1",
        "records_file": reply.manifest.records_file,
        "records_sha256": reply.manifest.records_sha256,
        "record_count": 2,
        "bytes": reply.manifest.bytes,
    }
    import hashlib

    assert reply.manifest_sha256 == hashlib.sha256(manifest_bytes).hexdigest()
    lines = records_of(checkpoint_dir)
    # Nested key order and integers beyond 64 bits survive byte for byte.
    assert lines == [
        '{"episode_id":{"rollout_id":"r1","attempt":0},"state":{"z":1,"a":{"y":2,"b":3}}}',
        '{"episode_id":{"rollout_id":"r2","attempt":3},"state":{"n":1208925819614629174706176}}',
    ]
    assert sorted(os.listdir(part_dir(checkpoint_dir))) == sorted(
        ["manifest.json", reply.manifest.records_file]
    )
    status = await h.client.get_status()
    assert status.state == types_pb2.PARTICIPANT_STATE_COMMITTED and not status.admission_open


async def test_commit_twice_is_identical_and_other_arguments_conflict(
    harness: Harness, checkpoint_dir: str, tmp_path: Path
) -> None:
    h = harness
    h.participant.seed(EpisodeId("r1"), {"n": 1})
    h.participant.seed(EpisodeId("r2"), {"n": 2})
    await prepared(h)
    scope = [EpisodeId("r1"), EpisodeId("r2")]
    first = await h.client.commit("c1", h.deadline(), checkpoint_dir, scope)
    h.participant.states[EpisodeId("r1")] = {"n": 99}
    second = await h.client.commit("c1", h.deadline(), checkpoint_dir, list(reversed(scope)))
    assert second == first
    assert h.participant.export_calls == 1
    await refused(
        h.client.commit("c1", h.deadline(), str(tmp_path / "elsewhere"), scope),
        "CHECKPOINT_CONFLICT",
        "ABORTED",
    )
    await refused(
        h.client.commit("c1", h.deadline(), checkpoint_dir, scope[:1]), "CHECKPOINT_CONFLICT"
    )
    await refused(h.client.commit("c1", h.deadline(), checkpoint_dir, None), "CHECKPOINT_CONFLICT")
    assert not (tmp_path / "elsewhere").exists()


async def test_scope_selects_and_empty_scope_differs_from_unscoped(
    harness: Harness, tmp_path: Path
) -> None:
    h = harness
    h.participant.seed(EpisodeId("r1"), {"n": 1})
    h.participant.seed(EpisodeId("r2"), {"n": 2})
    await prepared(h)
    empty = await h.client.commit("c1", h.deadline(), str(tmp_path / "a"), [])
    assert list(empty.exported) == [] and empty.manifest.record_count == 0
    await h.client.resume("c1", h.deadline())
    await prepared(h, "c2")
    unscoped = await h.client.commit("c2", h.deadline(), str(tmp_path / "b"))
    assert list(unscoped.exported) == ["r1", "r2"]
    await h.client.resume("c2", h.deadline())
    await prepared(h, "c3")
    scoped = await h.client.commit("c3", h.deadline(), str(tmp_path / "c"), [EpisodeId("r2")])
    assert list(scoped.exported) == ["r2"]


async def test_no_longer_ready_refuses_commit_and_writes_nothing(
    harness: Harness, checkpoint_dir: str
) -> None:
    h = harness
    h.participant.seed(EpisodeId("r1"), {})
    await prepared(h)
    # A request that slipped past (e.g. a participant prepared out of order) regresses readiness.
    async with _in_flight(h, "r1"):
        error = await refused(h.client.commit("c1", h.deadline(), checkpoint_dir), "INVALID_PHASE")
        assert "no longer ready" in error.message
    assert not Path(checkpoint_dir).exists()
    assert h.participant.export_calls == 0


class _in_flight:
    """Count a request in flight on the participant, bypassing admission (as a late one would)."""

    def __init__(self, h: Harness, key: str) -> None:
        self.participant = h.participant
        self.key = key

    async def __aenter__(self) -> None:
        self.participant.inflight[self.key] = 1
        self.participant.context.changed()

    async def __aexit__(self, *args: object) -> None:
        del self.participant.inflight[self.key]
        self.participant.context.changed()


async def test_unserializable_state_fails_naming_the_episode(
    harness: Harness, checkpoint_dir: str
) -> None:
    h = harness
    h.participant.seed(EpisodeId("r1"), {"ok": 1})
    h.participant.states[EpisodeId("bad", 2)] = {"x": float("nan")}
    await prepared(h)
    error = await refused(
        h.client.commit("c1", h.deadline(), checkpoint_dir),
        "UNSERIALIZABLE_STATE",
        "FAILED_PRECONDITION",
    )
    assert error.metadata["captureKey"] == "bad-a2"
    assert "bad-a2" in error.message
    assert not (part_dir(checkpoint_dir) / "manifest.json").exists()
    assert os.listdir(part_dir(checkpoint_dir)) == []


async def test_export_hook_failure_is_hook_failed(harness: Harness, checkpoint_dir: str) -> None:
    h = harness
    h.participant.seed(EpisodeId("r1"), {"secret": "do-not-leak"})
    h.participant.fail["export"] = RuntimeError("do-not-leak")
    await prepared(h)
    error = await refused(
        h.client.commit("c1", h.deadline(), checkpoint_dir), "HOOK_FAILED", "INTERNAL"
    )
    assert "do-not-leak" not in error.message and error.metadata["hook"] == "export"
    del h.participant.fail["export"]
    reply = await h.client.commit("c1", h.deadline(), checkpoint_dir)
    assert list(reply.exported) == ["r1"]


class GatedStorage(LocalStorage):
    """Local storage whose write blocks (in its thread) at a named step until released."""

    def __init__(self, step: str) -> None:
        self.release = threading.Event()
        self.reached = threading.Event()
        self.finished = threading.Event()
        self.writes = 0
        self.fence: WriteFence | None = None

        def hook(name: str) -> None:
            if name == step and not self.release.is_set():
                self.reached.set()
                self.release.wait(30)

        super().__init__(crash_hook=hook)

    def write_part(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.writes += 1
        self.fence = args[5]
        try:
            return super().write_part(*args, **kwargs)
        finally:
            self.finished.set()


async def wait_thread_event(event: threading.Event) -> None:
    assert await asyncio.to_thread(event.wait, 30)


async def test_slow_write_past_deadline_then_retry_stores_the_first_export(
    checkpoint_dir: str,
) -> None:
    storage = GatedStorage("before_record")
    h = await start_harness(storage=storage)
    try:
        h.participant.seed(EpisodeId("r1"), {"n": 1})
        await prepared(h)
        deadline = h.deadline(10)
        call = asyncio.ensure_future(h.client.commit("c1", deadline, checkpoint_dir))
        await wait_thread_event(storage.reached)
        h.clock.set(deadline + 1)
        error = await refused(call, "CHECKPOINT_DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED")
        assert "deadline" in error.metadata
        # Later state must never reach the checkpoint: the retry awaits the same write.
        h.participant.states[EpisodeId("r1")] = {"n": 2}
        retry = asyncio.ensure_future(h.client.commit("c1", h.deadline(), checkpoint_dir))
        storage.release.set()
        reply = await retry
        assert list(reply.exported) == ["r1"]
        assert records_of(checkpoint_dir) == [
            '{"episode_id":{"rollout_id":"r1","attempt":0},"state":{"n":1}}'
        ]
        assert h.participant.export_calls == 1 and storage.writes == 1
    finally:
        storage.release.set()
        await stop_harness(h)


async def test_resume_stops_an_unpublished_write(checkpoint_dir: str) -> None:
    storage = GatedStorage("before_record")
    h = await start_harness(storage=storage)
    try:
        h.participant.seed(EpisodeId("r1"), {"n": 1})
        await prepared(h)
        deadline = h.deadline(10)
        call = asyncio.ensure_future(h.client.commit("c1", deadline, checkpoint_dir))
        await wait_thread_event(storage.reached)
        h.clock.set(deadline + 1)
        await refused(call, "CHECKPOINT_DEADLINE_EXCEEDED")
        # The write has not begun publishing: the resume fences it off and reopens at once,
        # without waiting for a thread that storage may keep forever.
        reply = await h.client.resume("c1", h.deadline())
        assert not reply.idempotent
        assert storage.fence is not None and storage.fence.stopped
        assert (await h.client.get_status()).admission_open
        storage.release.set()
        await wait_thread_event(storage.finished)
        assert not (part_dir(checkpoint_dir) / "manifest.json").exists()
        assert os.listdir(part_dir(checkpoint_dir)) == []
    finally:
        storage.release.set()
        await stop_harness(h)


async def test_a_second_writer_cannot_replace_a_published_manifest(
    harness: Harness, checkpoint_dir: str
) -> None:
    h = harness
    h.participant.seed(EpisodeId("r1"), {"n": 1})
    await prepared(h)
    await h.client.commit("c1", h.deadline(), checkpoint_dir)
    before = {p.name: p.read_bytes() for p in part_dir(checkpoint_dir).iterdir()}
    await h.client.resume("c1", h.deadline())
    h.participant.states[EpisodeId("r1")] = {"n": 2}
    await prepared(h, "c2")
    error = await refused(
        h.client.commit("c2", h.deadline(), checkpoint_dir),
        "INVALID_CHECKPOINT_STATE",
        "FAILED_PRECONDITION",
    )
    assert "different commit" in error.message
    after = {p.name: p.read_bytes() for p in part_dir(checkpoint_dir).iterdir()}
    assert after == before


@pytest.mark.parametrize(
    "directory",
    ["relative/dir", "/tmp/a/../b", "/tmp/a/./b", "/tmp//a", "/tmp/a/", ""],
)
async def test_bad_checkpoint_directories_are_refused(harness: Harness, directory: str) -> None:
    h = harness
    await prepared(h)
    error = await refused(
        h.client.commit("c1", h.deadline(), directory), "INVALID_REQUEST", "INVALID_ARGUMENT"
    )
    assert error.metadata["field"] == "checkpoint_dir"
    assert (await h.client.get_status()).state == types_pb2.PARTICIPANT_STATE_PREPARED


async def test_directories_outside_allowed_roots_and_symlinked_parts_are_refused(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    h = await start_harness(allowed_checkpoint_roots=(str(root),))
    try:
        await prepared(h)
        await refused(h.client.commit("c1", h.deadline(), str(outside / "ckpt")), "INVALID_REQUEST")
        (root / "escape").symlink_to(outside)
        await refused(
            h.client.commit("c1", h.deadline(), str(root / "escape" / "ckpt")), "INVALID_REQUEST"
        )
        # A participant subdirectory planted as a symlink never redirects the write.
        ckpt = root / "ckpt"
        (ckpt / "participants").mkdir(parents=True)
        (ckpt / "participants" / "resources").symlink_to(outside)
        error = await refused(h.client.commit("c1", h.deadline(), str(ckpt)), "INVALID_REQUEST")
        assert "symlink" in error.message
        assert list(outside.iterdir()) == []
        assert (await h.client.get_status()).state == types_pb2.PARTICIPANT_STATE_PREPARED
    finally:
        await stop_harness(h)
