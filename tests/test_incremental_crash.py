"""SIGKILL during an incremental write, and during retention with references.

A real child process writes (or publishes) and stops at a named step: it drops a marker file
and waits, so "killed while writing" is certain, not timing; the test then SIGKILLs its
process group. Afterwards:

* a chained part killed at any step of its write is either unpublished (no manifest, so no
  reader takes it) or complete: its own records and every reference read back verified; the
  part it references is untouched; a retry of the same write then publishes it;
* a publication killed while its retention deletes leaves every published checkpoint still
  in the root restorable (each reference resolves), and the next publication finishes the
  deletion without taking a directory a kept checkpoint references.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from rollout_checkpoint.client.checkpointing.publication import (
    CheckpointRoot,
    PublishedParticipant,
)
from rollout_checkpoint.server.core import layout
from rollout_checkpoint.server.core.errors import CheckpointError
from rollout_checkpoint.server.core.part_storage import LocalStorage

from .processes import kill_group
from .processes import start as start_process
from .test_incremental_retention import INSTANCE, KIND, T0, Line, restorable, write

CHILD = r"""
import json, sys, time, shutil
from pathlib import Path
from datetime import timedelta

from rollout_checkpoint.client.checkpointing.publication import CheckpointRoot, PublishedParticipant
from rollout_checkpoint.server.core.part_storage import LocalStorage
from tests.test_incremental_retention import INSTANCE, KIND, T0, write
from tests.test_incremental_crash import lines_of

mode, root, step, marker = sys.argv[1], Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4])


def stall():
    marker.touch()
    time.sleep(120)


if mode == "write":
    storage = LocalStorage(crash_hook=lambda name: stall() if name == step else None)
    write(root, "c2", 1, lines_of(root, "c1")[:2], storage)
else:
    real_rmtree = shutil.rmtree

    def stalling_rmtree(*args, **kwargs):
        stall()
        real_rmtree(*args, **kwargs)

    shutil.rmtree = stalling_rmtree
    part, _ = write(root, "c3", 1, lines_of(root, "c0")[:1] + lines_of(root, "c2")[:1])
    entry = PublishedParticipant("counter", KIND, INSTANCE, part.manifest_sha256)
    CheckpointRoot(root).publish("c3", [entry], [], b"", created_at=T0 + timedelta(hours=3), keep=1)
print("finished", flush=True)
"""

WRITE_STEPS = ("before_record", "after_fsync", "after_rename", "after_manifest_link")


def lines_of(root: Path, checkpoint: str) -> list[Line]:
    """The own record lines of a full part, as a later part references them."""
    part = Path(layout.part_path(str(root / checkpoint), KIND, INSTANCE))
    (records,) = part.glob("records-*.jsonl")
    data = records.read_bytes()
    lines, offset = [], 0
    for line in data.splitlines():
        episode = json.dumps(json.loads(line)["episode_id"]).encode()
        lines.append(Line(checkpoint, records.name, len(data), offset, line, episode))
        offset += len(line) + 1
    return lines


def run_until_marker(tmp_path: Path, *args: str, script: str = CHILD) -> None:
    """Start the child (`script`), wait for its marker (it stopped at the step), and
    SIGKILL it."""
    marker = tmp_path / "stopped"
    child = start_process(
        [sys.executable, "-c", script, *args, str(marker)], log=tmp_path / "child.log"
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert child.poll() is None, (tmp_path / "child.log").read_text()
            assert time.monotonic() < deadline, "the child never reached its step"
            time.sleep(0.05)
    finally:
        kill_group(child)


@pytest.mark.parametrize("step", WRITE_STEPS)
def test_a_chained_write_killed_at_any_step_is_all_or_nothing(tmp_path: Path, step: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    write(root, "c1", 3, [])
    base_before = restorable_records(root, "c1")
    run_until_marker(tmp_path, "write", str(root), step)
    assert restorable_records(root, "c1") == base_before  # the referenced part is untouched
    published = (
        Path(layout.part_path(str(root / "c2"), KIND, INSTANCE)) / "manifest.json"
    ).exists()
    if published:
        assert len(restorable_records(root, "c2")) == 3
    else:
        with pytest.raises(CheckpointError) as refused:
            restorable_records(root, "c2")
        assert refused.value.reason.value == "INVALID_CHECKPOINT_STATE"
    # A retry (a restarted process committing the same cut) publishes the complete part.
    write(root, "c2", 1, lines_of(root, "c1")[:2])
    records = restorable_records(root, "c2")
    assert records[1:] == base_before[:2]
    part = Path(layout.part_path(str(root / "c2"), KIND, INSTANCE))
    assert not [p.name for p in part.iterdir() if p.name.startswith(".")]  # swept


def restorable_records(root: Path, checkpoint: str) -> list[dict[str, object]]:
    return LocalStorage().read_part(str(root / checkpoint), KIND, INSTANCE, lambda r: True)[1]


def test_retention_killed_while_deleting_keeps_every_referenced_directory(tmp_path: Path) -> None:
    root_dir = tmp_path / "root"
    root = CheckpointRoot(root_dir)
    for number in range(3):
        part, _ = write(root_dir, f"c{number}", 2, [])
        entry = PublishedParticipant("counter", KIND, INSTANCE, part.manifest_sha256)
        root.publish(
            f"c{number}", [entry], [], b"", created_at=T0 + timedelta(hours=number), keep=5
        )
    # c3 references c0 and c2 and is published with keep=1: c1 goes, c0 and c2 stay.
    run_until_marker(tmp_path, "retention", str(root_dir), "")
    for kept in root.published():
        assert restorable(root_dir, kept)
    assert {"c0", "c2", "c3"} <= {p.name for p in root_dir.iterdir()}
    part, _ = write(root_dir, "c4", 0, lines_of(root_dir, "c0")[:1])
    entry = PublishedParticipant("counter", KIND, INSTANCE, part.manifest_sha256)
    root.publish("c4", [entry], [], b"", created_at=T0 + timedelta(hours=4), keep=1)
    assert sorted(p.name for p in root_dir.iterdir() if not p.name.startswith(".")) == [
        "LATEST",
        "c0",
        "c4",
    ]
    for kept in root.published():
        assert restorable(root_dir, kept)
