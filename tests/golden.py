"""The golden checkpoints under tests/fixtures/checkpoints: how they were made.

The checkpoint format has one implementation (`server.core.layout`, `safe_files`,
`part_storage`; publication builds on it). What keeps that one implementation honest is this
small set of committed checkpoints: the writer must reproduce them byte for byte
(`test_golden_checkpoints.py`), the participant's reader must read them back, and `inspect`
must summarize them exactly as recorded in `<id>.inspect.json`. A change of the on-disk
format fails those tests until the fixtures are regenerated on purpose:

    .venv/bin/python -m tests.golden
"""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rollout_checkpoint.client.checkpointing.publication import CheckpointRoot, PublishedParticipant
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.part_storage import LocalStorage, WriteFence

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "checkpoints"


def _record(rollout_id: str, attempt: int, state: Any) -> dict[str, Any]:
    return {"episode_id": {"rollout_id": rollout_id, "attempt": attempt}, "state": state}


# (checkpoint id, created_at, parts, continued, controller state); a part is
# (name, kind, instance, records). Records are written as compact JSON lines.
CHECKPOINTS: list[
    tuple[str, datetime, list[tuple[str, str, str, list[dict[str, Any]]]], list[EpisodeId], bytes]
] = [
    (
        "golden-fleet",
        datetime(2025, 1, 31, 12, 0, 0, 250000, tzinfo=UTC),
        [
            (
                "env",
                "environment",
                "env-0",
                [
                    _record("r1", 0, {"step": 3, "task": "weather"}),
                    _record("r2", 1, {"step": 0, "task": "counter"}),
                ],
            ),
            ("model", "model", "m0", []),
            (
                "resources",
                "resources",
                "res-0",
                [
                    _record("r1", 0, {"count": 2, "note": "caf\u00e9 \u2713"}),
                    _record("r2", 1, {"count": 2**70, "nested": {"a": [1, 2.5, None, True]}}),
                ],
            ),
        ],
        [EpisodeId("r1"), EpisodeId("r2", 1)],
        b"trainer step 41\x00\xff",
    ),
    (
        "golden-single",
        datetime(2025, 2, 1, 8, 30, tzinfo=UTC),
        [
            (
                "agent",
                "agent",
                "agent-0",
                [_record("r9", 2, {"turns": ["hi", "there"]}), _record("r9.x_y", 0, {})],
            )
        ],
        [],
        b"",
    ),
]


def lines_of(records: list[dict[str, Any]]) -> list[bytes]:
    return [json.dumps(r, separators=(",", ":"), ensure_ascii=False).encode() for r in records]


def build(root: Path) -> None:
    """Write every golden checkpoint into `root` with the real writer and publisher."""
    publisher = CheckpointRoot(root)
    for checkpoint_id, created_at, parts, continued, state in CHECKPOINTS:
        directory = publisher.directory(checkpoint_id)
        entries = []
        for name, kind, instance, records in parts:
            part = LocalStorage().write_part(
                str(directory), kind, instance, checkpoint_id, lines_of(records), WriteFence()
            )
            entries.append(PublishedParticipant(name, kind, instance, part.manifest_sha256))
        publisher.publish(checkpoint_id, entries, continued, state, created_at=created_at, keep=10)


def inspect_json(summary_json: dict[str, Any]) -> dict[str, Any]:
    """An inspect summary without its machine-specific directory."""
    return {k: v for k, v in summary_json.items() if k != "directory"}


def regenerate() -> None:
    from rollout_checkpoint.client.checkpointing.publication import verify_checkpoint

    shutil.rmtree(FIXTURES, ignore_errors=True)
    build(FIXTURES)
    for checkpoint_id, *_ in CHECKPOINTS:
        summary = verify_checkpoint(FIXTURES / checkpoint_id)
        text = json.dumps(inspect_json(summary.to_json()), indent=2, sort_keys=True) + "\n"
        (FIXTURES.parent / f"{checkpoint_id}.inspect.json").write_text(text)


if __name__ == "__main__":
    regenerate()
