"""The golden checkpoints: the format's one implementation checked against committed bytes.

The participant's writer and reader and the controller's publication and `inspect` share one
implementation of the checkpoint format (`server.core.layout`, `safe_files`, `part_storage`).
Their independence from any one reading of the format comes from these fixtures instead of a
second parser: the writer must reproduce them byte for byte, the reader must read them back
record for record, and `inspect` must summarize them exactly as committed. A damaged copy is
refused by both readers. See tests/golden.py for how they were made (and how to regenerate
them on purpose).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from rollout_checkpoint.client.checkpointing.publication import (
    CheckpointCorrupt,
    CheckpointRoot,
    inspect,
    verify_checkpoint,
)
from rollout_checkpoint.server.core.errors import CheckpointError, Reason
from rollout_checkpoint.server.core.part_storage import LocalStorage

from .golden import CHECKPOINTS, FIXTURES, build, inspect_json

IDS = [checkpoint_id for checkpoint_id, *_ in CHECKPOINTS]


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def test_the_writer_reproduces_the_golden_checkpoints_byte_for_byte(tmp_path: Path) -> None:
    build(tmp_path / "root")
    written = _files(tmp_path / "root")
    golden = _files(FIXTURES)
    assert sorted(written) == sorted(golden)
    for name, data in golden.items():
        assert written[name] == data, name


@pytest.mark.parametrize("checkpoint_id", IDS)
def test_inspect_summarizes_each_golden_checkpoint_as_committed(checkpoint_id: str) -> None:
    expected = json.loads((FIXTURES.parent / f"{checkpoint_id}.inspect.json").read_text())
    summary = inspect(FIXTURES / checkpoint_id)
    assert inspect_json(summary.to_json()) == expected
    assert summary.warnings == ()
    assert summary.checkpoint_id == checkpoint_id


def test_the_golden_root_names_its_latest_and_lists_both() -> None:
    root = CheckpointRoot(FIXTURES)
    assert root.published() == IDS
    assert root.latest() == IDS[-1]
    assert root.load(None).checkpoint_id == IDS[-1]


@pytest.mark.parametrize(
    ("checkpoint_id", "created_at", "parts", "continued", "state"), CHECKPOINTS
)
def test_the_participants_reader_reads_the_golden_parts_back(
    checkpoint_id: str,
    created_at: object,
    parts: list[tuple[str, str, str, list[dict[str, Any]]]],
    continued: object,
    state: object,
) -> None:
    directory = str((FIXTURES / checkpoint_id).resolve())
    for _name, kind, instance, records in parts:
        manifest, read = LocalStorage().read_part(directory, kind, instance, lambda r: True)
        assert read == records
        assert (manifest.kind, manifest.instance, manifest.checkpoint_id) == (
            kind,
            instance,
            checkpoint_id,
        )
        assert manifest.record_count == len(records)


def _flip_a_records_byte(directory: Path) -> tuple[str, str]:
    (records,) = (directory / "participants/resources/res-0").glob("records-*.jsonl")
    data = bytearray(records.read_bytes())
    data[data.index(b'"count":2') + 8] = ord("3")
    records.write_bytes(bytes(data))
    return "resources", "res-0"


def _tear_a_manifest(directory: Path) -> tuple[str, str]:
    manifest = directory / "participants/environment/env-0/manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:-10])
    return "environment", "env-0"


@pytest.mark.parametrize("damage", [_flip_a_records_byte, _tear_a_manifest])
def test_a_damaged_copy_is_refused_by_both_readers(tmp_path: Path, damage: Any) -> None:
    copy = tmp_path / "golden-fleet"
    shutil.copytree(FIXTURES / "golden-fleet", copy)
    kind, instance = damage(copy)
    with pytest.raises(CheckpointCorrupt):
        verify_checkpoint(copy)
    with pytest.raises(CheckpointError) as caught:
        LocalStorage().read_part(str(copy.resolve()), kind, instance, lambda r: True)
    assert caught.value.reason is Reason.INVALID_CHECKPOINT_STATE
    assert caught.value.code == "DATA_LOSS"
