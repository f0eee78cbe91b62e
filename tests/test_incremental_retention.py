"""Property: retention never deletes a checkpoint directory that a kept checkpoint references.

Hypothesis draws chains of checkpoints in one root: each a real part written by
`LocalStorage.write_part` (own records, and references to lines of parts still on disk,
flattened as the runtime writes them), published with the real `CheckpointRoot.publish` and
a random `keep` (retention runs after each publication). Some are left unpublished (a fleet
whose publication failed after this participant's part was durable), as an aborted
checkpoint's directory is. After every publication, every published checkpoint still in the
root must read back whole: each reference resolves and verifies.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_checkpoint.client.checkpointing.publication import (
    CheckpointRoot,
    PublishedParticipant,
)
from rollout_checkpoint.client.checkpointing.publication.verify import inspect
from rollout_checkpoint.server.core import layout
from rollout_checkpoint.server.core.layout import PartChain, PartReference
from rollout_checkpoint.server.core.part_references import RecordPointer, reference_line
from rollout_checkpoint.server.core.part_storage import (
    CheckpointStorage,
    LocalStorage,
    PublishedPart,
    WriteFence,
)

T0 = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
KIND, INSTANCE = "resources", "counter"


@dataclass(frozen=True)
class Line:
    """An own record line of a written part, as a later part references it."""

    checkpoint: str
    records_file: str
    file_bytes: int
    offset: int
    data: bytes
    episode: bytes


def own_line(checkpoint: str, index: int) -> tuple[bytes, bytes]:
    episode = json.dumps({"rollout_id": f"{checkpoint}-{index}", "attempt": 0}).encode()
    state = json.dumps({"session_id": f"s-{checkpoint}-{index}", "state": {"n": index}})
    return b'{"episode_id":' + episode + b"," + state.encode()[1:], episode


def write(
    root: Path | str,
    checkpoint: str,
    own: int,
    referenced: list[Line],
    storage: CheckpointStorage | None = None,
) -> tuple[PublishedPart, list[Line]]:
    """Write the part of `checkpoint` in `root` (a directory, or an object-store URL): `own`
    records of its own, then `referenced`."""
    files = sorted({(r.checkpoint, r.records_file, r.file_bytes) for r in referenced})
    index = {f: i for i, f in enumerate(files)}
    lines = [own_line(checkpoint, i) for i in range(own)]
    data = [line for line, _ in lines]
    for r in referenced:
        pointer = RecordPointer(
            index[(r.checkpoint, r.records_file, r.file_bytes)],
            r.offset,
            len(r.data),
            hashlib.sha256(r.data).hexdigest(),
        )
        data.append(reference_line(pointer))
    chain = (
        PartChain(
            own,
            len(referenced),
            sum(len(r.data) + 1 for r in referenced),
            2,
            tuple(PartReference(*f) for f in files),
        )
        if referenced
        else None
    )
    part = (storage or LocalStorage()).write_part(
        f"{root}/{checkpoint}", KIND, INSTANCE, checkpoint, data, WriteFence(), chain
    )
    manifest = part.manifest
    offsets, offset = [], 0
    for line in data:
        offsets.append(offset)
        offset += len(line) + 1
    written = [
        Line(checkpoint, manifest.records_file, manifest.bytes, offsets[i], line, episode)
        for i, (line, episode) in enumerate(lines)
    ]
    return part, written


def restorable(root: Path, checkpoint: str) -> bool:
    LocalStorage().read_part(str(root / checkpoint), KIND, INSTANCE, lambda r: True)
    return True


def draw_part_contents(
    data: st.DataObject, lines: list[Line], still_there: Callable[[str], bool]
) -> tuple[list[Line], int]:
    """References and an own-record count for the next part. What is still on disk or on the
    store depends on wall-clock time (retention deletes an unpublished checkpoint only when it
    was started before the one being published, compared at the storage's mtime resolution: a
    second on S3), so the draws must not: hypothesis replays a choice sequence and refuses one
    whose draws changed (FlakyStrategyDefinition). Draw from every line written so far, then
    keep those whose checkpoint is `still_there`."""
    picks = (
        data.draw(st.lists(st.sampled_from(lines), unique=True, max_size=6), label="refs")
        if lines
        else []
    )
    referenced = [line for line in picks if still_there(line.checkpoint)]
    own = data.draw(st.integers(0, 3), label="own")
    return referenced, own if referenced else max(own, 1)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_retention_keeps_every_directory_a_kept_checkpoint_references(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    root_dir = tmp_path_factory.mktemp("root")
    root = CheckpointRoot(root_dir)
    lines: list[Line] = []
    for number in range(data.draw(st.integers(2, 9), label="checkpoints")):
        checkpoint = f"c{number}"
        referenced, own = draw_part_contents(
            data, lines, lambda checkpoint: (root_dir / checkpoint).exists()
        )
        part, written = write(root_dir, checkpoint, own, referenced)
        lines += written
        if data.draw(st.booleans(), label="publication fails"):
            continue  # the part stays, durable but in an unpublished directory
        entry = PublishedParticipant("counter", KIND, INSTANCE, part.manifest_sha256)
        keep = data.draw(st.integers(1, 4), label="keep")
        root.publish(
            checkpoint, [entry], [], b"", created_at=T0 + timedelta(hours=number), keep=keep
        )
        for kept in root.published():
            assert restorable(root_dir, kept)
        assert layout.FLEET_MANIFEST_NAME in {p.name for p in (root_dir / checkpoint).iterdir()}


def test_inspect_shows_own_and_referenced_records_and_the_chain_length(tmp_path: Path) -> None:
    root_dir = tmp_path / "root"
    root = CheckpointRoot(root_dir)
    base, lines = write(root_dir, "c0", 3, [])
    chained, _ = write(root_dir, "c1", 1, lines[:2])
    for number, part in enumerate((base, chained)):
        entry = PublishedParticipant("counter", KIND, INSTANCE, part.manifest_sha256)
        root.publish(f"c{number}", [entry], [], b"", created_at=T0 + timedelta(hours=number))
    summary = inspect(root_dir / "c1")
    (participant,) = summary.participants
    assert (participant.own_records, participant.referenced_records) == (1, 2)
    assert participant.chain_length == 2
    assert participant.to_json()["chain_length"] == 2
    assert "counter: 1 own record(s), 2 referenced, chain length 2" in summary.format_text()
    (full,) = inspect(root_dir / "c0").participants
    assert "chain_length" not in full.to_json()  # a full part's entry is as it always was
