"""LocalStorage and validate_checkpoint_dir, called directly (blocking code) against tmp_path.

Every test looks at what is on disk afterwards: the published names, the manifest bytes, and
that no temporary file (`.records-*.tmp`, `.manifest-*.tmp`) is ever left behind.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout_checkpoint.server.core.errors import CheckpointError, Reason
from rollout_checkpoint.server.core.layout import MANIFEST_NAME
from rollout_checkpoint.server.core.part_storage import (
    LocalStorage,
    PublishedPart,
    StopRequested,
    WriteFence,
    validate_checkpoint_dir,
)

from .conftest import temporaries, tree

KIND = "resources"
INSTANCE = "inst-0"
MANIFEST_FIELDS = [
    "bytes",
    "checkpoint_id",
    "instance",
    "kind",
    "record_count",
    "records_file",
    "records_sha256",
    "schema_version",
]


# -- helpers --------------------------------------------------------------------------------


def record_line(rollout: str, state: Any, attempt: int = 0) -> bytes:
    return json.dumps(
        {"episode_id": {"rollout_id": rollout, "attempt": attempt}, "state": state},
        separators=(",", ":"),
    ).encode()


def sample_lines(tag: str = "x", n: int = 3) -> list[bytes]:
    return [record_line(f"r{i}", {"n": i, "tag": tag}) for i in range(n)]


def part_of(ckpt: Path, kind: str = KIND, instance: str = INSTANCE) -> Path:
    return ckpt / "participants" / kind / instance


def records_files(part: Path) -> list[str]:
    return sorted(n for n in os.listdir(part) if n.startswith("records-"))


def write(
    ckpt: Path,
    lines: Iterable[bytes],
    *,
    checkpoint_id: str = "ckpt-1",
    storage: LocalStorage | None = None,
    fence: WriteFence | None = None,
    kind: str = KIND,
    instance: str = INSTANCE,
) -> PublishedPart:
    return (storage or LocalStorage()).write_part(
        str(ckpt), kind, instance, checkpoint_id, lines, fence or WriteFence()
    )


def read(
    ckpt: Path,
    select: Callable[[dict[str, Any]], bool] = lambda _record: True,
    *,
    kind: str = KIND,
    instance: str = INSTANCE,
) -> tuple[Any, list[dict[str, Any]]]:
    return LocalStorage().read_part(str(ckpt), kind, instance, select)


def refused(call: Callable[[], Any], reason: Reason, code: str) -> CheckpointError:
    with pytest.raises(CheckpointError) as caught:
        call()
    assert caught.value.reason is reason, caught.value
    assert caught.value.code == code, caught.value
    return caught.value


def manifest_path(ckpt: Path) -> Path:
    return part_of(ckpt) / MANIFEST_NAME


def rewrite_manifest(ckpt: Path, **changes: Any) -> None:
    path = manifest_path(ckpt)
    fields = json.loads(path.read_bytes())
    fields.update(changes)
    path.write_bytes((json.dumps(fields, sort_keys=True, indent=2) + "\n").encode())


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


# -- write ----------------------------------------------------------------------------------


def test_write_then_read_round_trips_with_content_addressed_records(ckpt: Path) -> None:
    lines = sample_lines()
    published = write(ckpt, lines)

    part = part_of(ckpt)
    body = b"".join(line + b"\n" for line in lines)
    digest = hashlib.sha256(body).hexdigest()
    assert sorted(os.listdir(part)) == [MANIFEST_NAME, f"records-{digest}.jsonl"]
    assert (part / f"records-{digest}.jsonl").read_bytes() == body

    raw_manifest = (part / MANIFEST_NAME).read_bytes()
    fields = json.loads(raw_manifest)
    assert list(fields) == MANIFEST_FIELDS  # sorted keys, exactly these eight
    assert fields == {
        "schema_version": 1,
        "kind": KIND,
        "instance": INSTANCE,
        "checkpoint_id": "ckpt-1",
        "records_file": f"records-{digest}.jsonl",
        "records_sha256": digest,
        "record_count": 3,
        "bytes": len(body),
    }
    assert published.manifest_sha256 == hashlib.sha256(raw_manifest).hexdigest()
    assert published.manifest.records_sha256 == digest
    assert temporaries(part) == []

    manifest, records = read(ckpt)
    assert manifest == published.manifest
    assert records == [json.loads(line) for line in lines]


def test_empty_part_round_trips(ckpt: Path) -> None:
    published = write(ckpt, [])
    assert published.manifest.record_count == 0
    assert published.manifest.bytes == 0
    assert published.manifest.records_sha256 == hashlib.sha256(b"").hexdigest()
    assert read(ckpt)[1] == []


def test_identical_retry_returns_the_identical_part(ckpt: Path) -> None:
    first = write(ckpt, sample_lines())
    manifest_before = manifest_path(ckpt).read_bytes()

    again = write(ckpt, sample_lines())

    assert again == first
    assert manifest_path(ckpt).read_bytes() == manifest_before
    assert sorted(os.listdir(part_of(ckpt))) == [MANIFEST_NAME, first.manifest.records_file]


def test_a_different_commit_is_refused_and_leaves_the_published_part_alone(ckpt: Path) -> None:
    first = write(ckpt, sample_lines("first"))
    manifest_before = manifest_path(ckpt).read_bytes()
    records_before = (part_of(ckpt) / first.manifest.records_file).read_bytes()

    error = refused(
        lambda: write(ckpt, sample_lines("second"), checkpoint_id="ckpt-2"),
        Reason.INVALID_CHECKPOINT_STATE,
        "FAILED_PRECONDITION",
    )

    assert "different commit" in error.message
    part = part_of(ckpt)
    assert manifest_path(ckpt).read_bytes() == manifest_before
    # The second writer's records file was removed; the first one's is untouched.
    assert sorted(os.listdir(part)) == [MANIFEST_NAME, first.manifest.records_file]
    assert (part / first.manifest.records_file).read_bytes() == records_before
    assert temporaries(part) == []


def test_same_records_under_another_checkpoint_id_is_refused_and_keeps_the_shared_records(
    ckpt: Path,
) -> None:
    first = write(ckpt, sample_lines())
    manifest_before = manifest_path(ckpt).read_bytes()

    error = refused(
        lambda: write(ckpt, sample_lines(), checkpoint_id="ckpt-other"),
        Reason.INVALID_CHECKPOINT_STATE,
        "FAILED_PRECONDITION",
    )

    assert "different commit" in error.message
    assert manifest_path(ckpt).read_bytes() == manifest_before
    # Same bytes, same name: deleting "its own" file would destroy the published part.
    assert sorted(os.listdir(part_of(ckpt))) == [MANIFEST_NAME, first.manifest.records_file]
    assert read(ckpt)[1] == [json.loads(line) for line in sample_lines()]


def test_of_two_racing_writers_exactly_one_publishes(ckpt: Path) -> None:
    """Both have their records on disk and go for the part lock at once. (Not at the manifest
    link: writers of one part rename and link under that lock, one after the other; the
    second's link then fails because the name exists.)"""
    barrier = threading.Barrier(2, timeout=30)

    def hook(step: str) -> None:
        if step == "before_part_lock":
            barrier.wait()

    storage = LocalStorage(crash_hook=hook)
    outcomes: dict[str, object] = {}

    def writer(tag: str) -> None:
        try:
            outcomes[tag] = write(ckpt, sample_lines(tag), checkpoint_id=tag, storage=storage)
        except BaseException as exc:
            outcomes[tag] = exc

    threads = [threading.Thread(target=writer, args=(tag,)) for tag in ("alpha", "beta")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
        assert not thread.is_alive()

    winners = {t: o for t, o in outcomes.items() if isinstance(o, PublishedPart)}
    losers = {t: o for t, o in outcomes.items() if not isinstance(o, PublishedPart)}
    assert len(winners) == 1, outcomes
    assert len(losers) == 1, outcomes
    (winner_tag, winner), (_, loser) = next(iter(winners.items())), next(iter(losers.items()))
    assert isinstance(loser, CheckpointError), loser
    assert loser.reason is Reason.INVALID_CHECKPOINT_STATE
    assert loser.code == "FAILED_PRECONDITION"
    assert "different commit" in loser.message

    part = part_of(ckpt)
    assert sorted(os.listdir(part)) == [MANIFEST_NAME, winner.manifest.records_file]
    assert hashlib.sha256(manifest_path(ckpt).read_bytes()).hexdigest() == winner.manifest_sha256
    manifest, records = read(ckpt)
    assert manifest.checkpoint_id == winner_tag
    assert records == [json.loads(line) for line in sample_lines(winner_tag)]


def test_stop_before_the_write_leaves_nothing(ckpt: Path) -> None:
    fence = WriteFence()
    assert fence.stop() is False

    with pytest.raises(StopRequested):
        write(ckpt, sample_lines(), fence=fence)

    assert os.listdir(part_of(ckpt)) == []


def test_stop_between_records_leaves_nothing(ckpt: Path) -> None:
    fence = WriteFence()
    seen: list[str] = []
    answers: list[bool] = []

    def hook(step: str) -> None:
        seen.append(step)
        if step == "after_record":
            answers.append(fence.stop())

    with pytest.raises(StopRequested):
        write(ckpt, sample_lines(n=5), fence=fence, storage=LocalStorage(crash_hook=hook))

    # The fence is honoured at the next record: exactly one was written, none published.
    assert seen == ["before_sweep", "before_record", "after_record"]
    assert answers == [False]  # the writer had not begun publishing: nothing to wait for
    assert os.listdir(part_of(ckpt)) == []


def test_stop_after_the_last_record_still_stops_before_publishing(ckpt: Path) -> None:
    fence = WriteFence()
    lines = sample_lines(n=2)
    count = 0

    def hook(step: str) -> None:
        nonlocal count
        if step == "after_record":
            count += 1
            if count == len(lines):
                assert fence.stop() is False

    with pytest.raises(StopRequested):
        write(ckpt, lines, fence=fence, storage=LocalStorage(crash_hook=hook))

    assert os.listdir(part_of(ckpt)) == []


def test_a_failing_record_source_leaves_no_temporary_file(ckpt: Path) -> None:
    def lines() -> Iterator[bytes]:
        yield record_line("r0", {"ok": True})
        raise CheckpointError(Reason.UNSERIALIZABLE_STATE, "episode r1 cannot be stored")

    refused(lambda: write(ckpt, lines()), Reason.UNSERIALIZABLE_STATE, "FAILED_PRECONDITION")

    assert os.listdir(part_of(ckpt)) == []


@pytest.mark.parametrize(
    ("err", "code"),
    [
        (errno.ENOSPC, "RESOURCE_EXHAUSTED"),
        (errno.EDQUOT, "RESOURCE_EXHAUSTED"),
        (errno.EIO, "UNAVAILABLE"),
    ],
)
@pytest.mark.parametrize("step", ["after_record", "after_fsync", "before_manifest_link"])
def test_io_errors_map_to_storage_failed_and_leave_no_manifest(
    ckpt: Path, err: int, code: str, step: str
) -> None:
    def hook(name: str) -> None:
        if name == step:
            raise OSError(err, os.strerror(err))

    error = refused(
        lambda: write(ckpt, sample_lines(), storage=LocalStorage(crash_hook=hook)),
        Reason.STORAGE_FAILED,
        code,
    )

    assert error.metadata["errno"] == errno.errorcode[err]
    assert not manifest_path(ckpt).exists()
    # Nothing of the failed write is left: no temporary, and no records file (renamed into
    # place before the failure at the link, it was removed since no manifest names it).
    assert os.listdir(part_of(ckpt)) == []


def test_the_checkpoint_dir_is_created_but_never_its_parent(tmp_path: Path) -> None:
    created = tmp_path / "fresh"
    write(created, sample_lines())
    assert manifest_path(created).is_file()

    orphan = tmp_path / "missing-parent" / "ckpt"
    error = refused(lambda: write(orphan, sample_lines()), Reason.STORAGE_FAILED, "UNAVAILABLE")

    assert error.metadata["errno"] == "ENOENT"
    assert not (tmp_path / "missing-parent").exists()


@pytest.mark.parametrize("component", ["participants", f"participants/{KIND}", "instance"])
def test_a_symlinked_participant_subdirectory_is_refused(
    tmp_path: Path, ckpt: Path, component: str
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    link = part_of(ckpt) if component == "instance" else ckpt / component
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside, target_is_directory=True)

    error = refused(lambda: write(ckpt, sample_lines()), Reason.INVALID_REQUEST, "INVALID_ARGUMENT")

    assert error.field == "checkpoint_dir"
    assert error.metadata["field"] == "checkpoint_dir"
    assert os.listdir(outside) == []
    assert link.is_symlink()


@pytest.mark.parametrize(
    ("kind", "instance"),
    [(KIND, "../../.."), (KIND, ".."), ("../..", INSTANCE), (KIND, ".hidden")],
    ids=["instance-escapes", "instance-dotdot", "kind-escapes", "instance-leading-dot"],
)
def test_an_invalid_kind_or_instance_is_refused_and_nothing_is_written_outside(
    tmp_path: Path, kind: str, instance: str
) -> None:
    root = tmp_path / "root"
    ckpt = root / "ckpt"
    root.mkdir()

    with pytest.raises(CheckpointError) as caught:
        write(ckpt, sample_lines(), kind=kind, instance=instance)

    assert caught.value.reason is Reason.INVALID_REQUEST
    assert [p for p in tree(root) if not p.startswith("ckpt")] == []
    assert [p for p in tree(root) if os.path.basename(p).startswith(("manifest", "records"))] == []


# -- key order and big integers --------------------------------------------------------------


def test_key_order_and_big_integers_survive_a_round_trip(ckpt: Path) -> None:
    state = {
        "zeta": 1,
        "alpha": {"y": 2**80, "b": [-(2**70), {"k2": "v", "k1": 2**64 + 1}], "a": None},
        "mid": [3.5, "s", True],
    }
    line = json.dumps(
        {"episode_id": {"rollout_id": "r1", "attempt": 0}, "state": state},
        separators=(",", ":"),
    ).encode()
    write(ckpt, [line])

    _, [record] = read(ckpt)

    assert record["state"] == state
    assert list(record) == ["episode_id", "state"]
    assert list(record["state"]) == ["zeta", "alpha", "mid"]
    assert list(record["state"]["alpha"]) == ["y", "b", "a"]
    assert list(record["state"]["alpha"]["b"][1]) == ["k2", "k1"]
    assert record["state"]["alpha"]["y"] == 2**80
    assert type(record["state"]["alpha"]["y"]) is int
    # Byte for byte: re-serializing gives the line back.
    assert json.dumps(record, separators=(",", ":")).encode() == line


# -- read -----------------------------------------------------------------------------------


def test_reading_a_missing_part_is_data_loss(ckpt: Path) -> None:
    refused(lambda: read(ckpt), Reason.INVALID_CHECKPOINT_STATE, "DATA_LOSS")
    (ckpt / "participants" / KIND).mkdir(parents=True)
    refused(lambda: read(ckpt), Reason.INVALID_CHECKPOINT_STATE, "DATA_LOSS")


def test_a_part_without_manifest_is_data_loss(ckpt: Path) -> None:
    published = write(ckpt, sample_lines())
    manifest_path(ckpt).unlink()

    error = refused(lambda: read(ckpt), Reason.INVALID_CHECKPOINT_STATE, "DATA_LOSS")

    assert "manifest" in error.message
    assert (part_of(ckpt) / published.manifest.records_file).exists()


def test_a_missing_records_file_is_data_loss(ckpt: Path) -> None:
    published = write(ckpt, sample_lines())
    (part_of(ckpt) / published.manifest.records_file).unlink()

    refused(lambda: read(ckpt), Reason.INVALID_CHECKPOINT_STATE, "DATA_LOSS")


def _flip_value(data: bytes) -> bytes:
    index = data.index(b'"n":1') + 4
    return data[:index] + b"7" + data[index + 1 :]


def _flip_structure(data: bytes) -> bytes:
    index = data.index(b"}\n")
    return data[:index] + b"]" + data[index + 1 :]


def _append(data: bytes) -> bytes:
    return data + record_line("r9", {"n": 9, "tag": "x"}) + b"\n"


def _drop_last_newline(data: bytes) -> bytes:
    assert data.endswith(b"\n")
    return data[:-1]


def _delete_middle_line(data: bytes) -> bytes:
    lines = data.splitlines(keepends=True)
    del lines[1]
    return b"".join(lines)


def _swap_lines(data: bytes) -> bytes:
    lines = data.splitlines(keepends=True)
    lines[0], lines[1] = lines[1], lines[0]
    return b"".join(lines)


@pytest.mark.parametrize(
    "tamper",
    [_flip_value, _flip_structure, _append, _drop_last_newline, _delete_middle_line, _swap_lines],
)
def test_tampered_records_are_data_loss_naming_the_digest(
    ckpt: Path, tamper: Callable[[bytes], bytes]
) -> None:
    published = write(ckpt, sample_lines())
    records = part_of(ckpt) / published.manifest.records_file
    original = records.read_bytes()
    tampered = tamper(original)
    assert tampered != original
    records.write_bytes(tampered)

    error = refused(lambda: read(ckpt), Reason.INVALID_CHECKPOINT_STATE, "DATA_LOSS")

    assert "digest" in error.message


def test_an_appended_non_object_line_is_reported_as_a_digest_mismatch(ckpt: Path) -> None:
    published = write(ckpt, sample_lines())
    records = part_of(ckpt) / published.manifest.records_file
    records.write_bytes(records.read_bytes() + b"[]\n")

    error = refused(lambda: read(ckpt), Reason.INVALID_CHECKPOINT_STATE, "DATA_LOSS")

    assert "digest" in error.message


def test_a_manifest_of_another_kind_or_instance_is_refused(ckpt: Path) -> None:
    write(ckpt, sample_lines())

    rewrite_manifest(ckpt, kind="agent")
    refused(lambda: read(ckpt), Reason.INVALID_CHECKPOINT_STATE, "FAILED_PRECONDITION")

    rewrite_manifest(ckpt, kind=KIND, instance="inst-9")
    error = refused(lambda: read(ckpt), Reason.INVALID_CHECKPOINT_STATE, "FAILED_PRECONDITION")
    assert "inst-9" in error.message


@pytest.mark.parametrize(
    "template",
    ["../x", "sub/records-{d}.jsonl", "../records-{d}.jsonl", "/etc/records-{d}.jsonl"],
)
def test_a_records_file_with_a_path_is_data_loss_and_nothing_outside_is_opened(
    ckpt: Path, template: str
) -> None:
    published = write(ckpt, sample_lines())
    digest = published.manifest.records_sha256
    body = (part_of(ckpt) / published.manifest.records_file).read_bytes()
    # Plant valid records where each trick points: reading any of them would succeed.
    (part_of(ckpt) / "sub").mkdir()
    (part_of(ckpt) / "sub" / f"records-{digest}.jsonl").write_bytes(body)
    (part_of(ckpt).parent / f"records-{digest}.jsonl").write_bytes(body)
    (part_of(ckpt).parent / "x").write_bytes(body)
    rewrite_manifest(ckpt, records_file=template.format(d=digest))

    refused(lambda: read(ckpt), Reason.INVALID_CHECKPOINT_STATE, "DATA_LOSS")


def test_a_symlinked_records_file_is_not_followed(tmp_path: Path, ckpt: Path) -> None:
    published = write(ckpt, sample_lines())
    records = part_of(ckpt) / published.manifest.records_file
    outside = tmp_path / "outside.jsonl"
    outside.write_bytes(records.read_bytes())  # following the link would verify fine
    records.unlink()
    records.symlink_to(outside)

    with pytest.raises(CheckpointError):
        read(ckpt)


@pytest.mark.parametrize("which", ["records", "manifest"])
def test_a_symlinked_file_in_a_part_is_data_loss(tmp_path: Path, ckpt: Path, which: str) -> None:
    published = write(ckpt, sample_lines())
    if which == "records":
        target = part_of(ckpt) / published.manifest.records_file
    else:
        target = manifest_path(ckpt)
    outside = tmp_path / "outside"
    outside.write_bytes(target.read_bytes())
    target.unlink()
    target.symlink_to(outside)

    refused(lambda: read(ckpt), Reason.INVALID_CHECKPOINT_STATE, "DATA_LOSS")


@pytest.mark.parametrize(
    "change",
    [
        {"extra": 1},
        {"schema_version": 2},
        {"schema_version": True},
        {"record_count": -1},
        {"record_count": "3"},
        {"records_sha256": "0" * 64},
    ],
    ids=[
        "extra-field",
        "schema-2",
        "bool-version",
        "negative-count",
        "string-count",
        "sha-vs-name",
    ],
)
def test_a_malformed_manifest_is_data_loss(ckpt: Path, change: dict[str, Any]) -> None:
    write(ckpt, sample_lines())
    rewrite_manifest(ckpt, **change)

    refused(lambda: read(ckpt), Reason.INVALID_CHECKPOINT_STATE, "DATA_LOSS")


def test_a_manifest_missing_a_field_or_not_json_is_data_loss(ckpt: Path) -> None:
    write(ckpt, sample_lines())
    fields = json.loads(manifest_path(ckpt).read_bytes())
    del fields["bytes"]
    manifest_path(ckpt).write_text(json.dumps(fields))
    refused(lambda: read(ckpt), Reason.INVALID_CHECKPOINT_STATE, "DATA_LOSS")

    manifest_path(ckpt).write_bytes(b"{not json")
    refused(lambda: read(ckpt), Reason.INVALID_CHECKPOINT_STATE, "DATA_LOSS")

    manifest_path(ckpt).write_bytes(b"[1, 2]")
    refused(lambda: read(ckpt), Reason.INVALID_CHECKPOINT_STATE, "DATA_LOSS")


def test_select_sees_every_record_and_keeps_only_the_selected(ckpt: Path) -> None:
    lines = sample_lines(n=4)
    write(ckpt, lines)
    seen: list[str] = []

    def select(record: dict[str, Any]) -> bool:
        seen.append(record["episode_id"]["rollout_id"])
        return record["episode_id"]["rollout_id"] in {"r1", "r3"}

    _, records = read(ckpt, select)

    assert seen == ["r0", "r1", "r2", "r3"]
    assert records == [json.loads(lines[1]), json.loads(lines[3])]


def test_selection_never_narrows_the_digest_check(ckpt: Path) -> None:
    published = write(ckpt, sample_lines(n=3))
    records = part_of(ckpt) / published.manifest.records_file
    records.write_bytes(_flip_value(records.read_bytes()))  # tampers with r1 only

    error = refused(
        lambda: read(ckpt, lambda r: r["episode_id"]["rollout_id"] == "r0"),
        Reason.INVALID_CHECKPOINT_STATE,
        "DATA_LOSS",
    )

    assert "digest" in error.message


def test_reading_refuses_a_symlinked_participant_subdirectory(tmp_path: Path, ckpt: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    write(elsewhere, sample_lines())
    (ckpt / "participants").mkdir(parents=True)
    (ckpt / "participants" / KIND).symlink_to(elsewhere / "participants" / KIND)

    error = refused(lambda: read(ckpt), Reason.INVALID_REQUEST, "INVALID_ARGUMENT")
    assert error.field == "checkpoint_dir"


# -- validate_checkpoint_dir ----------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    ["", "relative/ckpt", "ckpt", "/a/../b", "/a/./b", "/a//b", "/a/b/", "/a/b/..", "/a\x00b"],
    ids=[
        "empty",
        "relative",
        "bare",
        "dotdot",
        "dot",
        "double-slash",
        "trailing-slash",
        "trailing-dotdot",
        "nul",
    ],
)
def test_validate_refuses_paths_that_are_not_absolute_and_normalized(raw: str) -> None:
    error = refused(
        lambda: validate_checkpoint_dir(raw, ()), Reason.INVALID_REQUEST, "INVALID_ARGUMENT"
    )
    assert error.field == "checkpoint_dir"


def test_validate_refuses_a_path_outside_the_allowed_roots(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    for outside in (tmp_path / "other" / "ckpt", tmp_path / "root-sibling" / "ckpt", tmp_path):
        refused(
            lambda p=outside: validate_checkpoint_dir(str(p), (str(root),)),
            Reason.INVALID_REQUEST,
            "INVALID_ARGUMENT",
        )


def test_validate_refuses_a_symlink_inside_a_root_that_resolves_outside(tmp_path: Path) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "escape").symlink_to(outside, target_is_directory=True)

    refused(
        lambda: validate_checkpoint_dir(str(root / "escape" / "ckpt"), (str(root),)),
        Reason.INVALID_REQUEST,
        "INVALID_ARGUMENT",
    )
    refused(
        lambda: validate_checkpoint_dir(str(root / "escape"), (str(root),)),
        Reason.INVALID_REQUEST,
        "INVALID_ARGUMENT",
    )


def test_validate_returns_the_real_path(tmp_path: Path) -> None:
    real_root = tmp_path / "real-root"
    real_root.mkdir()
    (real_root / "inner").mkdir()
    linked_root = tmp_path / "linked-root"
    linked_root.symlink_to(real_root, target_is_directory=True)

    # A plain path under a root (need not exist yet).
    plain = real_root / "ckpt-1"
    assert validate_checkpoint_dir(str(plain), (str(real_root),)) == os.path.realpath(plain)
    # Through a symlink that stays inside: the resolved path comes back.
    inside = linked_root / "inner" / "ckpt"
    assert validate_checkpoint_dir(str(inside), (str(real_root),)) == str(
        real_root / "inner" / "ckpt"
    )
    # A root given through a symlink accepts paths under its target.
    assert validate_checkpoint_dir(str(plain), (str(linked_root),)) == str(plain)
    # No roots configured: any absolute, normalized path.
    assert validate_checkpoint_dir(str(inside), ()) == str(real_root / "inner" / "ckpt")


# -- hostile files: nothing may wedge the writer or the reader --------------------------------


class Wedged(AssertionError):
    """The storage call did not return within its bound (it is blocked in the kernel)."""


def within(call: Callable[[], Any], seconds: float = 10.0) -> Any:
    """Run a blocking storage call in a thread and return its result or raise its error.

    A regression that blocks (open() of a FIFO waits for the other end forever) fails the test
    instead of hanging the suite; the `fifos` fixture unblocks the stuck thread afterwards."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise Wedged(f"the call is still blocked after {seconds} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@pytest.fixture
def fifos() -> Iterator[list[Path]]:
    """FIFOs a test plants; at teardown each gets a writer, so a reader stuck in open() ends."""
    planted: list[Path] = []
    yield planted
    for fifo in planted:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no reader waiting (ENXIO), or gone
            continue
        os.close(fd)


def plant_fifo(path: Path, fifos: list[Path]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    fifos.append(path)


@pytest.mark.parametrize(
    ("make", "what"),
    [("fifo", "not a regular file"), ("directory", "not a regular file"), ("symlink", "a symlink")],
)
def test_a_manifest_name_taken_by_something_else_is_a_typed_refusal_of_the_writer(
    tmp_path: Path, ckpt: Path, fifos: list[Path], make: str, what: str
) -> None:
    """The link of the manifest fails (the name exists) and the writer reads what holds the
    name to compare it: a FIFO there used to block that read forever."""
    if make == "fifo":
        plant_fifo(manifest_path(ckpt), fifos)
    elif make == "directory":
        manifest_path(ckpt).mkdir(parents=True)
    else:
        write(tmp_path / "elsewhere", sample_lines())  # identical: following it would "match"
        manifest_path(ckpt).parent.mkdir(parents=True)
        manifest_path(ckpt).symlink_to(manifest_path(tmp_path / "elsewhere"))

    error = refused(
        lambda: within(lambda: write(ckpt, sample_lines())),
        Reason.INVALID_CHECKPOINT_STATE,
        "FAILED_PRECONDITION",
    )

    assert f"manifest.json that is {what}" in error.message
    # The refused writer leaves nothing of its own behind: only what was planted.
    assert os.listdir(part_of(ckpt)) == [MANIFEST_NAME]


@pytest.mark.parametrize("make", ["fifo", "directory"])
def test_a_manifest_that_is_not_a_regular_file_is_data_loss_on_read(
    ckpt: Path, fifos: list[Path], make: str
) -> None:
    if make == "fifo":
        plant_fifo(manifest_path(ckpt), fifos)
    else:
        manifest_path(ckpt).mkdir(parents=True)

    error = refused(
        lambda: within(lambda: read(ckpt)), Reason.INVALID_CHECKPOINT_STATE, "DATA_LOSS"
    )

    assert "not a regular file" in error.message


@pytest.mark.parametrize("make", ["fifo", "directory"])
def test_a_records_file_that_is_not_a_regular_file_is_data_loss_on_read(
    ckpt: Path, fifos: list[Path], make: str
) -> None:
    published = write(ckpt, sample_lines())
    records = part_of(ckpt) / published.manifest.records_file
    records.unlink()
    if make == "fifo":
        plant_fifo(records, fifos)
    else:
        records.mkdir()

    error = refused(
        lambda: within(lambda: read(ckpt)), Reason.INVALID_CHECKPOINT_STATE, "DATA_LOSS"
    )

    assert "not a regular file" in error.message


def test_a_sparse_records_file_far_larger_than_its_manifest_is_refused_without_reading_it(
    ckpt: Path,
) -> None:
    """A hostile 1 TiB sparse file under the records name would keep the reader hashing zeros
    for hours: the size the manifest promises is checked before a byte is read."""
    published = write(ckpt, sample_lines())
    records = part_of(ckpt) / published.manifest.records_file
    with records.open("r+b") as handle:
        handle.truncate(1 << 40)

    error = refused(
        lambda: within(lambda: read(ckpt)), Reason.INVALID_CHECKPOINT_STATE, "DATA_LOSS"
    )

    assert "digest" in error.message
    assert f"{1 << 40} bytes" in error.message


# -- the allowed-roots check cannot be raced ------------------------------------------------

SWAPS = ["grandparent", "parent", "itself"]


def swap_for_symlink(tmp_path: Path, which: str) -> tuple[str, Path]:
    """Validate root/a/b/ckpt, then swap one of a, b, ckpt for a symlink to a directory outside
    every root that has the same shape below it. Returns (validated path, the outside)."""
    root = tmp_path / "root"
    (root / "a" / "b" / "ckpt").mkdir(parents=True)
    validated = validate_checkpoint_dir(str(root / "a" / "b" / "ckpt"), (str(root),))
    outside = tmp_path / "outside"
    swapped = {"grandparent": root / "a", "parent": root / "a" / "b", "itself": Path(validated)}
    below = {"grandparent": Path("b"), "parent": Path(), "itself": None}[which]
    target = outside / which
    target.mkdir(parents=True)
    if below is not None:
        (target / below).mkdir(parents=True, exist_ok=True)
    victim = swapped[which]
    victim.rename(victim.with_name(victim.name + ".moved"))
    victim.symlink_to(target, target_is_directory=True)
    return validated, outside


@pytest.mark.parametrize("which", SWAPS)
def test_a_component_swapped_for_a_symlink_after_validation_refuses_the_write(
    tmp_path: Path, which: str
) -> None:
    validated, outside = swap_for_symlink(tmp_path, which)
    before = tree(outside)

    error = refused(
        lambda: write(Path(validated), sample_lines()), Reason.INVALID_REQUEST, "INVALID_ARGUMENT"
    )

    assert error.field == "checkpoint_dir"
    assert "symlink" in error.message
    assert tree(outside) == before  # nothing written outside the allowed root


@pytest.mark.parametrize("which", SWAPS)
def test_a_component_swapped_for_a_symlink_after_validation_refuses_the_read(
    tmp_path: Path, which: str
) -> None:
    validated, outside = swap_for_symlink(tmp_path, which)
    target = outside / which / {"grandparent": "b/ckpt", "parent": "ckpt", "itself": ""}[which]
    write(target, sample_lines())  # a valid part outside: following the link would read it

    error = refused(lambda: read(Path(validated)), Reason.INVALID_REQUEST, "INVALID_ARGUMENT")

    assert error.field == "checkpoint_dir"


def test_a_component_that_became_a_file_refuses_the_write(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    validated = validate_checkpoint_dir(str(root / "a" / "ckpt"), (str(root),))
    (root / "a").rmdir()
    (root / "a").write_bytes(b"")

    error = refused(
        lambda: write(Path(validated), sample_lines()), Reason.INVALID_REQUEST, "INVALID_ARGUMENT"
    )

    assert "not a directory" in error.message
