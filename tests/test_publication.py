"""Fleet checkpoint publication: checkpoint.json, LATEST, retention and the verifier.

Participant parts are written by hand here, byte for byte in the participants' format (see
`write_part`), so these tests exercise the controller's reader independently of the
participant runtime's writer.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from rollout_checkpoint.client.checkpointing import publication
from rollout_checkpoint.client.checkpointing.publication import (
    CheckpointConflict,
    CheckpointCorrupt,
    CheckpointRoot,
    FleetManifest,
    NoPublishedCheckpoint,
    PublicationError,
    PublishedParticipant,
    inspect,
    verify_checkpoint,
)
from rollout_checkpoint.server.core import safe_files
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.part_storage import LocalStorage, WriteFence

T0 = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)


def record(rollout_id: str, attempt: int = 0, **fields: Any) -> dict[str, Any]:
    return {"episode_id": {"rollout_id": rollout_id, "attempt": attempt}, **fields}


def write_part(
    checkpoint_dir: Path,
    kind: str,
    instance: str,
    checkpoint_id: str,
    records: Sequence[dict[str, Any]],
) -> str:
    """Write one participant's part exactly as a participant does; return the manifest sha."""
    part = checkpoint_dir / "participants" / kind / instance
    part.mkdir(parents=True)
    data = b"".join(json.dumps(r).encode() + b"\n" for r in records)
    digest = hashlib.sha256(data).hexdigest()
    (part / f"records-{digest}.jsonl").write_bytes(data)
    manifest = {
        "schema_version": 1,
        "kind": kind,
        "instance": instance,
        "checkpoint_id": checkpoint_id,
        "records_file": f"records-{digest}.jsonl",
        "records_sha256": digest,
        "record_count": len(records),
        "bytes": len(data),
    }
    raw = (json.dumps(manifest, sort_keys=True, indent=2) + "\n").encode()
    (part / "manifest.json").write_bytes(raw)
    return hashlib.sha256(raw).hexdigest()


FLEET: dict[str, tuple[str, str, list[dict[str, Any]]]] = {
    "env": ("environment", "env-0", [record("r1", boundary={"step": 2}), record("r2", 1)]),
    "resources": (
        "resources",
        "counter-0",
        [record("r2", 1, session_id="s2", state={"z": 1, "a": [1, 2]}), record("r1", state={})],
    ),
    "model": ("model", "model-0", []),
}


def make_parts(root: CheckpointRoot, checkpoint_id: str) -> list[PublishedParticipant]:
    directory = root.directory(checkpoint_id)
    return [
        PublishedParticipant(
            name, kind, instance, write_part(directory, kind, instance, checkpoint_id, recs)
        )
        for name, (kind, instance, recs) in FLEET.items()
    ]


CONTINUED = [EpisodeId("r2", 1), EpisodeId("r1"), EpisodeId("r2", 1)]


def publish_new(
    root: CheckpointRoot, checkpoint_id: str, created_at: datetime = T0, **kwargs: Any
) -> publication.PublishedCheckpoint:
    parts = make_parts(root, checkpoint_id)
    return root.publish(checkpoint_id, parts, CONTINUED, b"state", created_at=created_at, **kwargs)


def records_file(directory: Path, kind: str, instance: str) -> Path:
    (path,) = (directory / "participants" / kind / instance).glob("records-*.jsonl")
    return path


def no_temp_files(path: Path) -> bool:
    return not [p for p in path.rglob(".*") if p.name.endswith(".tmp") or ".trash." in p.name]


# -- publish, LATEST, load ----------------------------------------------------------------


def test_publish_writes_the_fleet_manifest_then_latest_and_loads_back(tmp_path: Path) -> None:
    root = CheckpointRoot(tmp_path / "root")  # created when missing
    result = publish_new(root, "ckpt-a")
    directory = tmp_path / "root" / "ckpt-a"
    raw = (directory / "checkpoint.json").read_bytes()
    content = json.loads(raw)
    assert raw == (json.dumps(content, sort_keys=True, indent=2) + "\n").encode()
    assert list(content) == sorted(content)
    assert content == {
        "schema_version": 1,
        "checkpoint_id": "ckpt-a",
        "created_at": "2030-01-02T03:04:05.678901Z",
        "participants": [
            {
                "name": name,
                "kind": kind,
                "instance": instance,
                "manifest": f"participants/{kind}/{instance}/manifest.json",
                "manifest_sha256": hashlib.sha256(
                    (directory / "participants" / kind / instance / "manifest.json").read_bytes()
                ).hexdigest(),
            }
            for name, (kind, instance, _) in sorted(FLEET.items())
        ],
        "continued": [{"attempt": 0, "rollout_id": "r1"}, {"attempt": 1, "rollout_id": "r2"}],
        "controller_state": base64.b64encode(b"state").decode(),
    }
    assert result.fleet_manifest_sha256 == hashlib.sha256(raw).hexdigest()
    assert result.directory == directory and not result.already_published
    assert (tmp_path / "root" / "LATEST").read_bytes() == b"ckpt-a\n"
    assert root.latest() == "ckpt-a"
    assert root.published() == ["ckpt-a"]
    assert root.load(None) == root.load("LATEST") == root.load("ckpt-a") == result.manifest
    assert result.manifest.continued == (EpisodeId("r1"), EpisodeId("r2", 1))
    assert no_temp_files(tmp_path)


@pytest.mark.parametrize(
    "state", [b"", b"\x00", bytes(range(256)) * 3, b"\xff\xfe{not json}\n", "é".encode()]
)
def test_controller_state_round_trips_arbitrary_bytes(tmp_path: Path, state: bytes) -> None:
    root = CheckpointRoot(tmp_path)
    root.publish("c1", make_parts(root, "c1"), [], state, created_at=T0)
    assert root.load(None).controller_state == state
    assert verify_checkpoint(tmp_path / "c1").controller_state == state


def test_identical_republish_is_idempotent(tmp_path: Path) -> None:
    clock = iter([T0, T0 + timedelta(hours=1)])
    root = CheckpointRoot(tmp_path, clock=lambda: next(clock))
    parts = make_parts(root, "c1")
    first = root.publish("c1", parts, CONTINUED, b"s")
    inode = (tmp_path / "c1" / "checkpoint.json").stat().st_ino
    # No created_at: the retry adopts the published one (the clock has moved on by an hour).
    again = root.publish("c1", list(reversed(parts)), reversed(CONTINUED), b"s")
    assert again.already_published and not first.already_published
    assert again.fleet_manifest_sha256 == first.fleet_manifest_sha256
    assert again.manifest == first.manifest and again.manifest.created_at == T0
    assert (tmp_path / "c1" / "checkpoint.json").stat().st_ino == inode
    assert root.latest() == "c1" and no_temp_files(tmp_path)


@pytest.mark.parametrize(
    "change",
    [
        {"continued": [EpisodeId("r9")]},
        {"controller_state": b"other"},
        {"created_at": T0 + timedelta(seconds=1)},
    ],
    ids=["continued", "controller_state", "created_at"],
)
def test_conflicting_republish_is_refused(tmp_path: Path, change: dict[str, Any]) -> None:
    root = CheckpointRoot(tmp_path)
    parts = make_parts(root, "c1")
    root.publish("c1", parts, CONTINUED, b"s", created_at=T0)
    before = (tmp_path / "c1" / "checkpoint.json").read_bytes()
    arguments: dict[str, Any] = {"continued": CONTINUED, "controller_state": b"s", "created_at": T0}
    arguments.update(change)
    with pytest.raises(CheckpointConflict, match="different fleet manifest"):
        root.publish(
            "c1",
            parts,
            arguments["continued"],
            arguments["controller_state"],
            created_at=arguments["created_at"],
        )
    assert (tmp_path / "c1" / "checkpoint.json").read_bytes() == before
    assert root.load("c1").continued == (EpisodeId("r1"), EpisodeId("r2", 1))
    assert no_temp_files(tmp_path)


def _missing_part(root: CheckpointRoot, parts: list[PublishedParticipant]) -> None:
    extra = PublishedParticipant("agent", "agent", "agent-0", "0" * 64)
    parts.append(extra)


def _manifest_sha_mismatch(root: CheckpointRoot, parts: list[PublishedParticipant]) -> None:
    parts[0] = PublishedParticipant(parts[0].name, parts[0].kind, parts[0].instance, "f" * 64)


def _wrong_checkpoint_id(root: CheckpointRoot, parts: list[PublishedParticipant]) -> None:
    directory = root.directory("c2")
    sha = write_part(directory, "agent", "agent-0", "c-other", [record("r1")])
    parts.append(PublishedParticipant("agent", "agent", "agent-0", sha))


def _kind_mismatch(root: CheckpointRoot, parts: list[PublishedParticipant]) -> None:
    # The part under participants/agent/agent-0 claims to be another participant's.
    directory = root.directory("c2")
    sha = write_part(directory, "agent", "agent-0", "c2", [record("r1")])
    manifest = directory / "participants/agent/agent-0/manifest.json"
    raw = manifest.read_bytes().replace(b'"agent-0"', b'"agent-1"')
    manifest.write_bytes(raw)
    sha = hashlib.sha256(raw).hexdigest()
    parts.append(PublishedParticipant("agent", "agent", "agent-0", sha))


def _bad_records(root: CheckpointRoot, parts: list[PublishedParticipant]) -> None:
    # A consistent manifest over a records file whose line is no episode record: the digest
    # matches, the content does not (publish verifies exactly what load will).
    directory = root.directory("c2")
    sha = write_part(directory, "agent", "agent-0", "c2", [{"no_episode": True}])
    parts.append(PublishedParticipant("agent", "agent", "agent-0", sha))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_missing_part, "missing"),
        (_manifest_sha_mismatch, "manifest digest mismatch"),
        (_wrong_checkpoint_id, "checkpoint_id is 'c-other'"),
        (_kind_mismatch, "instance is 'agent-1'"),
        (_bad_records, "invalid episode_id"),
    ],
)
def test_a_part_that_does_not_verify_publishes_nothing(
    tmp_path: Path,
    damage: Callable[[CheckpointRoot, list[PublishedParticipant]], None],
    message: str,
) -> None:
    root = CheckpointRoot(tmp_path)
    publish_new(root, "c1")
    parts = make_parts(root, "c2")
    damage(root, parts)
    with pytest.raises(CheckpointCorrupt, match=message) as caught:
        root.publish("c2", parts, [], b"", created_at=T0 + timedelta(hours=1), keep=1)
    assert str(caught.value.path).startswith(str(tmp_path / "c2"))
    assert not (tmp_path / "c2" / "checkpoint.json").exists()
    assert root.latest() == "c1" and root.published() == ["c1"]
    assert (tmp_path / "c2" / "participants").is_dir()  # nothing deleted either
    assert no_temp_files(tmp_path)


def test_publish_refuses_a_missing_checkpoint_directory_and_bad_arguments(tmp_path: Path) -> None:
    root = CheckpointRoot(tmp_path)
    part = PublishedParticipant("m", "model", "m0", "0" * 64)
    with pytest.raises(CheckpointCorrupt, match="no participant has committed"):
        root.publish("nothing-here", [part], [], b"")
    with pytest.raises(ValueError, match="at least one participant"):
        root.publish("c1", [], [], b"")
    with pytest.raises(ValueError, match="share a name"):
        root.publish("c1", [part, PublishedParticipant("m", "model", "m1", "0" * 64)], [], b"")
    with pytest.raises(ValueError, match="keep"):
        root.publish("c1", [part], [], b"", keep=0)
    with pytest.raises(ValueError, match="timezone"):
        root.publish("c1", [part], [], b"", created_at=datetime(2030, 1, 1))
    with pytest.raises(ValueError, match="not a valid id"):
        root.publish("c1", [PublishedParticipant("m", "..", "m0", "0" * 64)], [], b"")
    assert root.latest() is None and root.published() == []


def test_ids(tmp_path: Path) -> None:
    root = CheckpointRoot(tmp_path, clock=lambda: T0)
    new = root.new_checkpoint_id()
    assert re.fullmatch(r"ckpt-20300102T030405Z-[0-9a-f]{8}", new)
    assert root.directory(new) == tmp_path / new
    for bad in ("", "../x", "a/b", ".hidden", "-flag", "x" * 129):
        with pytest.raises(ValueError, match="not a valid checkpoint id"):
            root.directory(bad)
        if bad:
            with pytest.raises(ValueError, match="not a valid checkpoint id"):
                root.load(bad)
    with pytest.raises(ValueError, match="reserved"):
        root.directory("LATEST")


# -- retention ----------------------------------------------------------------------------


def set_mtime(path: Path, when: datetime) -> None:
    stamp = when.timestamp()
    os.utime(path, (stamp, stamp))


def partial(root: CheckpointRoot, checkpoint_id: str, mtime: datetime) -> Path:
    """An unpublished checkpoint: one participant committed, then the checkpoint failed."""
    directory = root.directory(checkpoint_id)
    write_part(directory, "model", "model-0", checkpoint_id, [record("r1")])
    set_mtime(directory, mtime)
    return directory


def test_retention_keeps_the_newest_and_deletes_older_and_partial_ones(tmp_path: Path) -> None:
    root = CheckpointRoot(tmp_path)
    hour = timedelta(hours=1)
    # Ids deliberately out of time order: retention orders published ones by created_at.
    for index, checkpoint_id in enumerate(["p-z", "p-b", "p-y"]):
        publish_new(root, checkpoint_id, created_at=T0 + index * hour, keep=10)
        set_mtime(tmp_path / checkpoint_id, T0 + index * hour)
    old_partial = partial(root, "failed-old", T0 + 3 * hour)
    empty_old = tmp_path / "empty-old"
    empty_old.mkdir()
    set_mtime(empty_old, T0)
    parts = make_parts(root, "p-new")
    set_mtime(tmp_path / "p-new", T0 + 4 * hour)
    newer_partial = partial(root, "started-later", T0 + 5 * hour)
    notes = tmp_path / "notes"  # not a checkpoint: an operator's directory is never deleted
    notes.mkdir()
    (notes / "readme.txt").write_text("keep me")
    set_mtime(notes, T0)
    stray = tmp_path / ".LATEST.0123456789abcdef.tmp"
    stray.write_text("p-z\n")
    (tmp_path / "dispatched.jsonl").write_text("{}\n")

    result = root.publish("p-new", parts, [], b"", created_at=T0 + 4 * hour, keep=2)

    assert root.published() == ["p-y", "p-new"]
    assert result.deleted == ("empty-old", "failed-old", "p-b", "p-z")
    assert not old_partial.exists() and not empty_old.exists() and not stray.exists()
    assert newer_partial.is_dir() and (notes / "readme.txt").read_text() == "keep me"
    assert (tmp_path / "dispatched.jsonl").exists()
    assert root.latest() == "p-new" and no_temp_files(tmp_path)
    root.load("p-y")


def test_retention_never_deletes_the_checkpoint_just_published(tmp_path: Path) -> None:
    root = CheckpointRoot(tmp_path)
    publish_new(root, "newest", created_at=T0 + timedelta(days=2))
    publish_new(root, "newer", created_at=T0 + timedelta(days=1))
    # Publishing an older checkpoint (keep=1): it is not among the newest, but it is what was
    # just published, so it stays next to the newest one, which LATEST keeps naming (LATEST
    # never moves back in time).
    result = publish_new(root, "older", created_at=T0, keep=1)
    assert result.deleted == ("newer",)
    assert root.published() == ["older", "newest"]
    assert root.latest() == "newest"
    assert root.load(None).checkpoint_id == "newest"


def test_deferred_retention_keeps_the_reference_taken_before_the_publication(
    tmp_path: Path,
) -> None:
    """`defer_retention=True` publishes (LATEST moves) and deletes nothing; completing it later
    deletes exactly what the publication would have, judged by the checkpoint directory's age
    as it was before the publication touched it, not as it is when retention runs."""
    root = CheckpointRoot(tmp_path)
    hour = timedelta(hours=1)
    ago = datetime.now(UTC) - 4 * hour  # mtimes in the past: the publication's writes are now
    publish_new(root, "p-old", created_at=T0, keep=10)
    set_mtime(tmp_path / "p-old", ago)
    old_partial = partial(root, "failed-old", ago + hour)
    parts = make_parts(root, "p-new")
    set_mtime(tmp_path / "p-new", ago + 2 * hour)
    newer_partial = partial(root, "started-later", ago + 3 * hour)
    before = (tmp_path / "p-new").stat().st_mtime_ns

    published = root.publish(
        "p-new", parts, [], b"", created_at=T0 + 2 * hour, keep=1, defer_retention=True
    )

    assert root.latest() == "p-new" and published.deleted == ()
    assert published.pending_retention == publication.PendingRetention(1, before)
    assert root.published() == ["p-old", "p-new"] and old_partial.is_dir()
    # The directory's mtime moved when the publication wrote checkpoint.json into it: a
    # reference read now would be newer than "started-later" and delete it.
    assert (tmp_path / "p-new").stat().st_mtime_ns > newer_partial.stat().st_mtime_ns

    completed = root.complete_retention(published)

    assert completed.deleted == ("failed-old", "p-old") and completed.pending_retention is None
    assert root.published() == ["p-new"] and newer_partial.is_dir() and not old_partial.exists()
    assert root.complete_retention(completed) is completed  # nothing left to do


# -- LATEST -------------------------------------------------------------------------------


def test_latest_and_load_without_a_publication(tmp_path: Path) -> None:
    root = CheckpointRoot(tmp_path)
    assert root.latest() is None
    with pytest.raises(NoPublishedCheckpoint):
        root.load(None)
    partial(root, "unpublished", T0)
    with pytest.raises(NoPublishedCheckpoint, match="never published"):
        root.load("unpublished")
    with pytest.raises(NoPublishedCheckpoint):
        root.load("no-such-id")


@pytest.mark.parametrize("content", [b"unpublished\n", b"gone\n", b"../etc\n", b""])
def test_latest_naming_an_unpublished_directory_is_corrupt(tmp_path: Path, content: bytes) -> None:
    root = CheckpointRoot(tmp_path)
    partial(root, "unpublished", T0)
    (tmp_path / "LATEST").write_bytes(content)
    with pytest.raises(CheckpointCorrupt) as caught:
        root.latest()
    assert caught.value.path == tmp_path / "LATEST"
    with pytest.raises(CheckpointCorrupt):
        root.load(None)


# -- crash between checkpoint.json and LATEST -----------------------------------------------


class Crash(Exception):
    pass


def test_crash_after_the_fleet_manifest_keeps_the_previous_latest(tmp_path: Path) -> None:
    crash_at: set[str] = set()

    def hook(step: str) -> None:
        if step in crash_at:
            raise Crash(step)

    root = CheckpointRoot(tmp_path, clock=lambda: T0, crash_hook=hook)
    publish_new(root, "c1", created_at=T0 - timedelta(days=1))
    parts = make_parts(root, "c2")
    crash_at.add("after_fleet_manifest")
    with pytest.raises(Crash):
        root.publish("c2", parts, [EpisodeId("r1")], b"two", keep=1)
    # c2 is durable but LATEST never moved: a restore still gets c1, whole.
    assert (tmp_path / "c2" / "checkpoint.json").exists()
    assert root.latest() == "c1" and root.load(None).controller_state == b"state"
    crash_at.clear()
    # The controller retries the same publication: it completes idempotently.
    result = root.publish("c2", parts, [EpisodeId("r1")], b"two", keep=1)
    assert result.already_published and result.deleted == ("c1",)
    assert root.latest() == "c2" and root.load(None).controller_state == b"two"


def test_failing_latest_replace_leaves_latest_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = CheckpointRoot(tmp_path)
    publish_new(root, "c1")
    parts = make_parts(root, "c2")

    def replace(*args: Any, **kwargs: Any) -> None:
        raise OSError(5, "Input/output error")

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", replace)  # the os module publication moves LATEST with
        with pytest.raises(PublicationError, match="Input/output error"):
            root.publish("c2", parts, [], b"", created_at=T0)
    assert (tmp_path / "LATEST").read_bytes() == b"c1\n"
    assert root.load(None).checkpoint_id == "c1"
    assert no_temp_files(tmp_path)
    assert root.publish("c2", parts, [], b"", created_at=T0).already_published
    assert root.latest() == "c2"


# -- the verifier -------------------------------------------------------------------------


def published_dir(tmp_path: Path) -> Path:
    root = CheckpointRoot(tmp_path / "root")
    publish_new(root, "c1")
    return tmp_path / "root" / "c1"


def _flip_byte(directory: Path) -> None:
    path = records_file(directory, "resources", "counter-0")
    data = bytearray(path.read_bytes())
    data[10] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(directory: Path) -> None:
    path = records_file(directory, "resources", "counter-0")
    path.write_bytes(path.read_bytes()[:-7])


def _extra_line(directory: Path) -> None:
    path = records_file(directory, "environment", "env-0")
    with path.open("ab") as handle:
        handle.write(json.dumps(record("r3")).encode() + b"\n")


def _records_gone(directory: Path) -> None:
    records_file(directory, "environment", "env-0").unlink()


def _tamper_manifest(directory: Path) -> None:
    path = directory / "participants/environment/env-0/manifest.json"
    path.write_bytes(path.read_bytes().replace(b'"record_count": 2', b'"record_count": 3'))


def _rewrite_fleet(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        path = directory / "checkpoint.json"
        content = json.loads(path.read_bytes())
        change(content)
        path.write_text(json.dumps(content, sort_keys=True))

    return damage


def _dotdot_path(content: dict[str, Any]) -> None:
    entry = content["participants"][0]
    entry["manifest"] = (
        f"participants/{entry['kind']}/../{entry['kind']}/{entry['instance']}/manifest.json"
    )


def _dotdot_instance(content: dict[str, Any]) -> None:
    entry = content["participants"][0]
    entry["instance"] = ".."
    entry["manifest"] = f"participants/{entry['kind']}/../manifest.json"


def _absolute_path(content: dict[str, Any]) -> None:
    content["participants"][0]["manifest"] = "/etc/passwd"


def _symlinked(relative: Callable[[Path], Path]) -> Callable[[Path], None]:
    """Move the real thing aside and put a symlink to it in its place: same bytes, refused."""

    def damage(directory: Path) -> None:
        target = relative(directory)
        aside = directory.parent / f"aside-{target.name}"
        target.rename(aside)
        target.symlink_to(aside)

    return damage


def _bad_json(directory: Path) -> None:
    (directory / "checkpoint.json").write_bytes(b'{"schema_version": 1,')


DAMAGE: list[tuple[str, Callable[[Path], None], str]] = [
    ("flipped-byte", _flip_byte, "records digest mismatch"),
    ("truncated-records", _truncate, "records digest mismatch"),
    ("extra-line", _extra_line, "records digest mismatch"),
    ("records-missing", _records_gone, "records file named by the manifest is missing"),
    ("manifest-tampered", _tamper_manifest, "manifest digest mismatch"),
    ("manifest-path-dotdot", _rewrite_fleet(_dotdot_path), "manifest must be"),
    ("instance-dotdot", _rewrite_fleet(_dotdot_instance), "not a valid id"),
    ("manifest-path-absolute", _rewrite_fleet(_absolute_path), "manifest must be"),
    (
        "manifest-path-other-kind",
        _rewrite_fleet(lambda c: c["participants"][0].update(kind="model")),
        "manifest must be",
    ),
    (
        "symlinked-instance-dir",
        _symlinked(lambda d: d / "participants/environment/env-0"),
        "symlink",
    ),
    ("symlinked-kind-dir", _symlinked(lambda d: d / "participants/environment"), "symlink"),
    ("symlinked-participants-dir", _symlinked(lambda d: d / "participants"), "symlink"),
    (
        "symlinked-manifest",
        _symlinked(lambda d: d / "participants/environment/env-0/manifest.json"),
        "symlink",
    ),
    (
        "symlinked-records",
        _symlinked(lambda d: records_file(d, "environment", "env-0")),
        "symlink",
    ),
    ("symlinked-fleet-manifest", _symlinked(lambda d: d / "checkpoint.json"), "symlink"),
    ("bad-json", _bad_json, "invalid fleet manifest"),
    (
        "schema-2",
        _rewrite_fleet(lambda c: c.update(schema_version=2)),
        "unsupported schema_version 2",
    ),
    ("schema-string", _rewrite_fleet(lambda c: c.update(schema_version="1")), "must be an integer"),
    ("extra-field", _rewrite_fleet(lambda c: c.update(extra=1)), r"unexpected \['extra'\]"),
    ("missing-field", _rewrite_fleet(lambda c: c.pop("continued")), r"missing \['continued'\]"),
    ("bad-created-at", _rewrite_fleet(lambda c: c.update(created_at="yesterday")), "RFC 3339"),
    ("bad-base64", _rewrite_fleet(lambda c: c.update(controller_state="!!")), "base64"),
    ("other-id", _rewrite_fleet(lambda c: c.update(checkpoint_id="c2")), "not c1"),
    (
        "duplicate-continued",
        _rewrite_fleet(lambda c: c["continued"].append(c["continued"][0])),
        "twice",
    ),
]


@pytest.mark.parametrize(
    ("damage", "message"), [pytest.param(d, m, id=name) for name, d, m in DAMAGE]
)
def test_verify_catches_damage(
    tmp_path: Path, damage: Callable[[Path], None], message: str
) -> None:
    directory = published_dir(tmp_path)
    damage(directory)
    with pytest.raises(CheckpointCorrupt, match=message) as caught:
        verify_checkpoint(directory, expected_id="c1")
    assert str(caught.value.path).startswith(str(directory))
    root = CheckpointRoot(tmp_path / "root")
    with pytest.raises(CheckpointCorrupt):
        root.load(None)


def test_digest_mismatches_say_digest(tmp_path: Path) -> None:
    for index, damage in enumerate([_flip_byte, _truncate, _extra_line, _tamper_manifest]):
        directory = published_dir(tmp_path / str(index))
        damage(directory)
        with pytest.raises(CheckpointCorrupt, match="digest"):
            verify_checkpoint(directory)


def test_a_torn_or_invalid_line_behind_a_matching_digest_is_refused(tmp_path: Path) -> None:
    root = CheckpointRoot(tmp_path)
    for checkpoint_id, records_bytes, message in [
        ("torn", b'{"episode_id": {"rollout_id": "r1", "attempt": 0}}', "torn"),
        ("array", b"[1]\n", "not a JSON object"),
        (
            "nan",
            b'{"episode_id": {"rollout_id": "r1", "attempt": 0}, "x": NaN}\n',
            "not valid JSON",
        ),
        ("ambiguous", b'{"episode_id": {"rollout_id": "r-a1", "attempt": 0}}\n', "episode_id"),
    ]:
        directory = root.directory(checkpoint_id)
        part = directory / "participants/model/m0"
        part.mkdir(parents=True)
        digest = hashlib.sha256(records_bytes).hexdigest()
        (part / f"records-{digest}.jsonl").write_bytes(records_bytes)
        manifest = {
            "schema_version": 1,
            "kind": "model",
            "instance": "m0",
            "checkpoint_id": checkpoint_id,
            "records_file": f"records-{digest}.jsonl",
            "records_sha256": digest,
            "record_count": 1,
            "bytes": len(records_bytes),
        }
        raw = json.dumps(manifest, sort_keys=True).encode()
        (part / "manifest.json").write_bytes(raw)
        entry = PublishedParticipant("m", "model", "m0", hashlib.sha256(raw).hexdigest())
        with pytest.raises(CheckpointCorrupt, match=message):
            root.publish(checkpoint_id, [entry], [], b"")
        # The size-only fast path publishes it; the full verifier still refuses to load it.
        root.publish(checkpoint_id, [entry], [], b"", verify_records=False, keep=10)
        with pytest.raises(CheckpointCorrupt, match=message):
            root.load(checkpoint_id)


def test_verify_refuses_an_unpublished_directory(tmp_path: Path) -> None:
    root = CheckpointRoot(tmp_path)
    directory = partial(root, "unpublished", T0)
    with pytest.raises(CheckpointCorrupt, match="never published"):
        verify_checkpoint(directory)
    with pytest.raises(CheckpointCorrupt, match="no such checkpoint directory"):
        verify_checkpoint(tmp_path / "absent")


def test_summary_numbers(tmp_path: Path) -> None:
    directory = published_dir(tmp_path)
    write_part(directory, "agent", "stray-0", "c1", [record("x")])  # on disk, not listed
    summary = inspect(directory)
    assert summary.checkpoint_id == "c1" and summary.created_at == T0
    by_name = {p.name: p for p in summary.participants}
    assert [p.name for p in summary.participants] == ["env", "model", "resources"]
    for name, (kind, instance, recs) in FLEET.items():
        part = by_name[name]
        path = directory / "participants" / kind / instance
        data = b"".join(json.dumps(r).encode() + b"\n" for r in recs)
        assert (part.kind, part.instance) == (kind, instance)
        assert part.record_count == len(recs) and part.bytes == len(data)
        assert part.records_sha256 == hashlib.sha256(data).hexdigest()
        assert (
            part.manifest_sha256
            == hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()
        )
    assert by_name["env"].episodes == ("r1", "r2-a1")
    assert by_name["resources"].episodes == ("r1", "r2-a1")
    assert by_name["model"].episodes == () and by_name["model"].bytes == 0
    assert summary.total_records == 4
    assert summary.total_bytes == sum(p.bytes for p in summary.participants) > 0
    assert summary.continued == (EpisodeId("r1"), EpisodeId("r2", 1))
    assert summary.controller_state == b"state"
    assert summary.warnings == (
        "participants/agent/stray-0 is on disk but not listed in the fleet manifest "
        "(a restore ignores it)",
    )
    as_json = json.loads(json.dumps(summary.to_json()))
    assert as_json["record_count"] == 4 and as_json["bytes"] == summary.total_bytes
    assert as_json["participants"][0]["episodes"] == ["r1", "r2-a1"]
    assert as_json["continued"] == [
        {"rollout_id": "r1", "attempt": 0},
        {"rollout_id": "r2", "attempt": 1},
    ]
    assert base64.b64decode(as_json["controller_state"]) == b"state"
    text = summary.format_text()
    assert "checkpoint c1" in text and "r1, r2-a1" in text and "stray-0" in text
    assert f"records         4 ({summary.total_bytes} bytes)" in text


def test_fleet_manifest_decode_is_the_inverse_of_encode(tmp_path: Path) -> None:
    root = CheckpointRoot(tmp_path)
    manifest = publish_new(root, "c1").manifest
    assert FleetManifest.decode(manifest.encode()) == manifest
    assert (tmp_path / "c1" / "checkpoint.json").read_bytes() == manifest.encode()


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_records_are_streamed_across_chunk_boundaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    monkeypatch.setattr(safe_files, "READ_CHUNK", chunk)
    directory = published_dir(tmp_path)
    summary = verify_checkpoint(directory)
    assert summary.total_records == 4
    assert [p.episodes for p in summary.participants] == [("r1", "r2-a1"), (), ("r1", "r2-a1")]
    _extra_line(directory)
    with pytest.raises(CheckpointCorrupt, match="digest"):
        verify_checkpoint(directory)


def test_parts_written_by_the_participant_runtime_verify(tmp_path: Path) -> None:
    """The independent reader agrees with the participants' real writer."""
    root = CheckpointRoot(tmp_path)
    checkpoint_id = root.new_checkpoint_id()
    directory = root.directory(checkpoint_id)
    lines = [
        json.dumps(record(f"r{i}", i % 3, state={"n": i, "big": 2**70})).encode() for i in range(50)
    ]
    part = LocalStorage().write_part(
        str(directory), "resources", "res-0", checkpoint_id, lines, WriteFence()
    )
    entry = PublishedParticipant("res", "resources", "res-0", part.manifest_sha256)
    result = root.publish(checkpoint_id, [entry], [EpisodeId("r1", 1)], b"\x00blob")
    summary = root.inspect(None)
    assert summary.fleet_manifest_sha256 == result.fleet_manifest_sha256
    (participant,) = summary.participants
    assert participant.record_count == part.manifest.record_count == 50
    assert participant.bytes == part.manifest.bytes
    assert participant.episodes == tuple(
        sorted(EpisodeId(f"r{i}", i % 3).capture_key for i in range(50))
    )


def test_a_late_retry_of_an_older_checkpoint_never_moves_latest_back(tmp_path: Path) -> None:
    root = CheckpointRoot(tmp_path / "root")
    publish_new(root, "ckpt-old", created_at=T0, keep=5)
    publish_new(root, "ckpt-new", created_at=T0 + timedelta(hours=1), keep=5)
    assert root.latest() == "ckpt-new"
    parts = [
        PublishedParticipant(name, kind, instance, _manifest_sha(root, "ckpt-old", kind, instance))
        for name, (kind, instance, _) in FLEET.items()
    ]
    retried = root.publish("ckpt-old", parts, CONTINUED, b"state", keep=5)
    assert retried.already_published
    assert root.latest() == "ckpt-new"


def _manifest_sha(root: CheckpointRoot, checkpoint_id: str, kind: str, instance: str) -> str:
    path = root.directory(checkpoint_id) / "participants" / kind / instance / "manifest.json"
    return hashlib.sha256(path.read_bytes()).hexdigest()
