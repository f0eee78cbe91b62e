"""Crash consistency of a commit: SIGKILL the writer at every instrumented step, and disk errors.

A child process (`python -c`) runs a real commit (a DoubleParticipant under a ControlPlane)
into a checkpoint directory with `LocalStorage(crash_hook=...)` that SIGKILLs the process at
the chosen step (and the Nth record). After every kill the directory holds either a complete
part (its manifest exists, and digest, count and bytes verify) or no manifest at all; a
restore of a part without a manifest fails cleanly through a real participant's Restore RPC
(nothing installed, admission open); and a retried commit of the same id, from a fresh
participant holding the same (deterministic) state, succeeds with the first export's records
and sweeps whatever the dead writer left behind.

Full disks and I/O errors are injected through the storage interface into a real participant's
Commit RPC: STORAGE_FAILED (RESOURCE_EXHAUSTED for ENOSPC, UNAVAILABLE otherwise), no
manifest, no temporary file, the participant still PREPARED, and a retry succeeds.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import CheckpointError, Reason
from rollout_checkpoint.server.core.layout import StoredManifest
from rollout_checkpoint.server.core.part_storage import (
    LocalStorage,
    PublishedPart,
    WriteFence,
)
from rollout_checkpoint.v1 import types_pb2

from .conftest import (
    REPO,
    Harness,
    drain,
    refused,
    start_harness,
    stop_harness,
    temporaries,
    tree,
)

CHECKPOINT_ID = "crash-1"
KIND, INSTANCE = "resources", "double"
STATES: dict[str, Any] = {
    f"r{i}": {"n": i, "text": "é" * i, "big": 2**70 + i, "z": [i, {"b": 1, "a": 2}]}
    for i in range(5)
}
N_RECORDS = len(STATES)

CHILD = r"""
import asyncio, json, os, signal, sys

from rollout_checkpoint.server.core.clock import ManualClock
from rollout_checkpoint.server.runtime.control_plane import ControlPlane
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import CheckpointError, Reason
from rollout_checkpoint.server.core.part_storage import LocalStorage
from tests.double import DoubleParticipant

step, nth, checkpoint_dir, checkpoint_id = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
states = json.loads(sys.argv[5])
seen = 0


def hook(name):
    global seen
    if name == step:
        seen += 1
        if seen == nth:
            os.kill(os.getpid(), signal.SIGKILL)


async def main():
    participant = DoubleParticipant()
    clock = ManualClock()
    control = ControlPlane(participant, storage=LocalStorage(crash_hook=hook), clock=clock)
    for key, state in states.items():
        participant.seed(EpisodeId.from_capture_key(key), state)
    deadline = clock.now() + 60
    async for update in await control.prepare(checkpoint_id, deadline):
        last = update
    assert last.state == "PREPARED", last
    await control.commit(checkpoint_id, deadline, checkpoint_dir, None)
    await control.close()


asyncio.run(main())
print("survived", flush=True)
"""


def expected_lines() -> list[bytes]:
    """The records the DoubleParticipant exports for STATES, as the control plane writes them."""
    return [
        json.dumps(
            {"episode_id": EpisodeId.from_capture_key(key).to_json(), "state": state},
            allow_nan=False,
            ensure_ascii=False,
            separators=(",", ":"),
        ).encode()
        + b"\n"
        for key, state in sorted(STATES.items(), key=lambda kv: EpisodeId.from_capture_key(kv[0]))
    ]


def expected_digest() -> str:
    return hashlib.sha256(b"".join(expected_lines())).hexdigest()


def part_of(checkpoint_dir: str) -> Path:
    return Path(checkpoint_dir, "participants", KIND, INSTANCE)


def start_child(step: str, nth: int, checkpoint_dir: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            CHILD,
            step,
            str(nth),
            checkpoint_dir,
            CHECKPOINT_ID,
            json.dumps(STATES),
        ],
        cwd=REPO,
        env=dict(os.environ, GRPC_VERBOSITY="ERROR"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@dataclass
class Killed:
    """A child's commit into `checkpoint_dir`, and how the child ended."""

    checkpoint_dir: str
    returncode: int
    stdout: str
    stderr: str


def finish(child: subprocess.Popen[str], checkpoint_dir: str) -> Killed:
    stdout, stderr = child.communicate(timeout=120)
    return Killed(checkpoint_dir, child.returncode, stdout, stderr)


def read_all(checkpoint_dir: str) -> tuple[StoredManifest, list[dict[str, Any]]]:
    return LocalStorage().read_part(checkpoint_dir, KIND, INSTANCE, lambda _record: True)


def verify_complete(checkpoint_dir: str) -> None:
    """A manifest exists: its records file verifies and holds exactly the export."""
    manifest, records = read_all(checkpoint_dir)
    assert manifest.checkpoint_id == CHECKPOINT_ID
    assert manifest.records_sha256 == expected_digest()
    assert manifest.record_count == N_RECORDS
    assert manifest.bytes == len(b"".join(expected_lines()))
    assert [
        json.dumps(r, separators=(",", ":"), ensure_ascii=False).encode() + b"\n" for r in records
    ] == expected_lines()


def scope() -> list[EpisodeId]:
    return [EpisodeId.from_capture_key(k) for k in STATES]


async def seed_all(h: Harness) -> None:
    for key, state in STATES.items():
        response = await h.http.post(f"/ng-rollout/{key}/seed", json={"state": state})
        assert response.status_code == 200, response.text


async def commit_again(h: Harness, checkpoint_dir: str) -> Any:
    """The controller's retry: the same id into the same directory, from a participant that
    holds the same state (the dead one's export-once cache died with it)."""
    await seed_all(h)
    final = (await drain(h.client.prepare(CHECKPOINT_ID, h.deadline())))[-1]
    assert final.state == types_pb2.PARTICIPANT_STATE_PREPARED
    return await h.client.commit(CHECKPOINT_ID, h.deadline(), checkpoint_dir)


CRASH_POINTS = [
    ("before_sweep", 1),
    ("before_record", 1),
    ("after_record", 1),
    ("before_record", 3),
    ("after_record", 3),
    ("before_record", N_RECORDS),
    ("after_record", N_RECORDS),
    ("after_fsync", 1),
    ("before_part_lock", 1),
    ("before_rename", 1),
    ("after_rename", 1),
    ("before_publish", 1),
    ("before_manifest_link", 1),
    ("after_manifest_link", 1),
    ("before_dir_fsync", 1),
]
PUBLISHED_AT = {"after_manifest_link", "before_dir_fsync"}


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], Killed]:
    """Every child at once (each is mostly interpreter start-up), one directory each."""
    started = {}
    for step, nth in CRASH_POINTS:
        base = tmp_path_factory.mktemp(f"{step}-{nth}")
        checkpoint_dir = str(base / "ckpt")
        started[(step, nth)] = (start_child(step, nth, checkpoint_dir), checkpoint_dir)
    return {point: finish(child, directory) for point, (child, directory) in started.items()}


@pytest.mark.parametrize(("step", "nth"), CRASH_POINTS, ids=[f"{s}-{n}" for s, n in CRASH_POINTS])
async def test_sigkill_at_every_step_leaves_old_or_new_and_a_retry_succeeds(
    killed: dict[tuple[str, int], Killed], step: str, nth: int
) -> None:
    child = killed[(step, nth)]
    assert child.returncode == -signal.SIGKILL, (child.returncode, child.stdout, child.stderr)
    checkpoint_dir = child.checkpoint_dir
    base = Path(checkpoint_dir).parent
    part = part_of(checkpoint_dir)
    published = (part / "manifest.json").exists()
    assert published == (step in PUBLISHED_AT)
    # Nothing outside the participant's own directory.
    assert tree(base) == sorted(
        ["ckpt", "ckpt/participants", "ckpt/participants/resources", *tree_of_part(part)]
    )

    restorer = await start_harness()
    try:
        if published:
            verify_complete(checkpoint_dir)
            reply = await restorer.client.restore(
                "restore-1", restorer.deadline(), checkpoint_dir, scope()
            )
            assert sorted(reply.restored) == sorted(e.next_attempt().capture_key for e in scope())
            assert {e.capture_key: s for e, s in restorer.participant.states.items()} == {
                EpisodeId.from_capture_key(k).next_attempt().capture_key: s
                for k, s in STATES.items()
            }
        else:
            # Whatever files the dead writer left (a temporary, a renamed records file), the
            # part is not complete: a restore refuses it and installs nothing.
            with pytest.raises(CheckpointError) as caught:
                read_all(checkpoint_dir)
            assert caught.value.reason is Reason.INVALID_CHECKPOINT_STATE
            error = await refused(
                restorer.client.restore("restore-1", restorer.deadline(), checkpoint_dir, scope()),
                "INVALID_CHECKPOINT_STATE",
                "DATA_LOSS",
            )
            assert "manifest" in error.message or "no part" in error.message
            status = await restorer.client.get_status()
            assert status.state == types_pb2.PARTICIPANT_STATE_IDLE and status.admission_open
            assert restorer.participant.states == {}
    finally:
        await stop_harness(restorer)

    retrier = await start_harness()
    try:
        reply = await commit_again(retrier, checkpoint_dir)
        assert reply.manifest.records_sha256 == expected_digest()
        assert reply.manifest.record_count == N_RECORDS
        assert sorted(reply.exported) == sorted(STATES)
    finally:
        await stop_harness(retrier)
    verify_complete(checkpoint_dir)
    # The retry swept what the dead writer left (its lock died with it): exactly the part.
    assert sorted(os.listdir(part)) == ["manifest.json", f"records-{expected_digest()}.jsonl"]


def tree_of_part(part: Path) -> list[str]:
    if not part.exists():
        return []
    return [f"ckpt/participants/resources/{INSTANCE}"] + [
        f"ckpt/participants/resources/{INSTANCE}/{n}" for n in os.listdir(part)
    ]


def test_a_child_that_is_never_killed_publishes(tmp_path: Path) -> None:
    """The child itself is sound: with a step that never comes it commits normally."""
    checkpoint_dir = str(tmp_path / "ckpt")
    child = finish(start_child("no_such_step", 1, checkpoint_dir), checkpoint_dir)
    assert child.returncode == 0 and "survived" in child.stdout, child.stderr
    verify_complete(checkpoint_dir)
    assert temporaries(part_of(checkpoint_dir)) == []


# -- disk errors through the storage interface ---------------------------------------------


class FaultyStorage:
    """The storage interface around LocalStorage, failing one write with an OSError.

    `at` is a LocalStorage step (the error comes from the disk at that point) or `record:N`
    (the Nth record's write fails). Later writes go through untouched."""

    def __init__(self, at: str, err: int) -> None:
        self.at = at
        self.err = err
        self.failures_left = 1
        self.writes = 0
        self.dir_fsyncs_after_failure = 0
        self._failed = False

    def _hook(self, name: str) -> None:
        if name == self.at and self.failures_left:
            self.failures_left -= 1
            self._failed = True
            raise OSError(self.err, os.strerror(self.err))

    def _lines(self, lines: Iterable[bytes]) -> Iterator[bytes]:
        for number, line in enumerate(lines, 1):
            if self.at == f"record:{number}" and self.failures_left:
                self.failures_left -= 1
                self._failed = True
                raise OSError(self.err, os.strerror(self.err))
            yield line

    def write_part(
        self,
        checkpoint_dir: str,
        kind: str,
        instance: str,
        checkpoint_id: str,
        lines: Iterable[bytes],
        fence: WriteFence,
    ) -> PublishedPart:
        self.writes += 1
        return LocalStorage(crash_hook=self._hook).write_part(
            checkpoint_dir, kind, instance, checkpoint_id, self._lines(lines), fence
        )

    def read_part(
        self,
        checkpoint_dir: str,
        kind: str,
        instance: str,
        select: Callable[[dict[str, Any]], bool],
    ) -> tuple[StoredManifest, list[dict[str, Any]]]:
        return LocalStorage().read_part(checkpoint_dir, kind, instance, select)


DISK_FAULTS = [
    ("record:1", errno.ENOSPC, "RESOURCE_EXHAUSTED"),
    ("record:3", errno.EDQUOT, "RESOURCE_EXHAUSTED"),
    ("record:2", errno.EIO, "UNAVAILABLE"),
    ("after_record", errno.ENOSPC, "RESOURCE_EXHAUSTED"),
    ("after_fsync", errno.EIO, "UNAVAILABLE"),
    ("before_rename", errno.EROFS, "UNAVAILABLE"),
    ("after_rename", errno.ENOSPC, "RESOURCE_EXHAUSTED"),
    ("before_manifest_link", errno.EIO, "UNAVAILABLE"),
]


@pytest.mark.parametrize(
    ("at", "err", "code"), DISK_FAULTS, ids=[f"{a}-{errno.errorcode[e]}" for a, e, _ in DISK_FAULTS]
)
async def test_disk_errors_in_a_commit_are_storage_failed_and_a_retry_succeeds(
    tmp_path: Path, at: str, err: int, code: str
) -> None:
    checkpoint_dir = str(tmp_path / "ckpt")
    storage = FaultyStorage(at, err)
    h = await start_harness(storage=storage)
    try:
        await seed_all(h)
        final = (await drain(h.client.prepare(CHECKPOINT_ID, h.deadline())))[-1]
        assert final.state == types_pb2.PARTICIPANT_STATE_PREPARED
        error = await refused(
            h.client.commit(CHECKPOINT_ID, h.deadline(), checkpoint_dir), "STORAGE_FAILED", code
        )
        assert error.metadata["errno"] == errno.errorcode[err]
        part = part_of(checkpoint_dir)
        assert not (part / "manifest.json").exists()
        assert temporaries(part) == []
        status = await h.client.get_status()
        assert status.state == types_pb2.PARTICIPANT_STATE_PREPARED and not status.admission_open
        # Later state must not reach the retry: it stores the first export's records again.
        h.participant.states[EpisodeId("r0")] = {"changed": True}
        reply = await h.client.commit(CHECKPOINT_ID, h.deadline(), checkpoint_dir)
        assert reply.manifest.records_sha256 == expected_digest()
        assert h.participant.export_calls == 1 and storage.writes == 2
        assert temporaries(part) == []
        verify_complete(checkpoint_dir)
        assert (await h.client.get_status()).state == types_pb2.PARTICIPANT_STATE_COMMITTED
    finally:
        await stop_harness(h)


async def test_a_failed_directory_fsync_is_storage_failed_and_the_retry_makes_it_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory fsync comes after the manifest link: when it fails the part exists but
    is not known durable, so the commit fails; the retry finds the identical manifest and
    must fsync the directory before it reports success."""
    checkpoint_dir = str(tmp_path / "ckpt")
    storage = FaultyStorage("before_dir_fsync", errno.EIO)
    part = part_of(checkpoint_dir)
    synced_dirs: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        real_fsync(fd)
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            synced_dirs.append(os.readlink(f"/proc/self/fd/{fd}"))

    monkeypatch.setattr(os, "fsync", spy)
    h = await start_harness(storage=storage)
    try:
        await seed_all(h)
        await drain(h.client.prepare(CHECKPOINT_ID, h.deadline()))
        await refused(
            h.client.commit(CHECKPOINT_ID, h.deadline(), checkpoint_dir),
            "STORAGE_FAILED",
            "UNAVAILABLE",
        )
        assert temporaries(part) == []
        verify_complete(checkpoint_dir)  # linked, complete, just not known durable
        assert (await h.client.get_status()).state == types_pb2.PARTICIPANT_STATE_PREPARED
        synced_dirs.clear()
        reply = await h.client.commit(CHECKPOINT_ID, h.deadline(), checkpoint_dir)
        assert reply.manifest.records_sha256 == expected_digest()
        assert str(part.resolve()) in synced_dirs
    finally:
        await stop_harness(h)
