"""A corrupt or hostile history index or details file is reported and skipped everywhere
(ListCheckpoints, GetCheckpoint, the CLI) and set aside by the next append; it never fails an
RPC with INTERNAL, the CLI with a traceback, or stops recording.

The cases are the ones that got through before: integers outside their proto field's range
(they passed the type check, then building the wire message raised ValueError: INTERNAL for
every page holding the entry), a number JSON parses as infinity, and JSON nested deeper than
the interpreter recurses (RecursionError: neither ValueError nor TypeError, so the API
answered INTERNAL, the CLI printed a traceback, and every later append raised too)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from rollout_checkpoint.client.checkpointing.publication.history import (
    CORRUPT_INDEX_NAME,
    INDEX_NAME,
    MemberRecord,
    details_name,
    encode_index,
    open_history,
)

from .test_history import entry, history_cli
from .test_history_api import get_checkpoint, history_coordinator, list_checkpoints, refused

DEEP = b"[" * 100_000 + b"]" * 100_000


def index_of(**fields: Any) -> bytes:
    """An index of one entry, `ckpt-1`, with `fields` over a valid entry's."""
    line = json.dumps(entry(1).to_json() | fields, separators=(",", ":")).encode()
    return encode_index([line])


HOSTILE_INDEXES = {
    "members below uint32": index_of(members=-1),
    "members above uint32": index_of(members=1 << 32),
    "bytes above uint64": index_of(bytes=1 << 70),
    "duration infinite": index_of(duration_seconds=0.5).replace(b"0.5", b"1e400"),
    "stage seconds NaN": index_of(stages=[{"stage": "prepare", "seconds": 1.0}]).replace(
        b"1.0", b"NaN"
    ),
    "nested too deep (one line)": encode_index([DEEP]),
    "nested too deep (whole)": b'{"format": 1, "entries": ' + DEEP + b"}",
}


@pytest.mark.parametrize("raw", HOSTILE_INDEXES.values(), ids=HOSTILE_INDEXES.keys())
async def test_a_hostile_index_is_reported_skipped_and_set_aside(
    tmp_path: Path, raw: bytes
) -> None:
    (tmp_path / INDEX_NAME).write_bytes(raw)
    async with history_coordinator(tmp_path) as stub:
        listed = await list_checkpoints(stub)
        assert not listed.checkpoints and "history skipped" in listed.history_problem
        error = await refused(get_checkpoint(stub, "ckpt-1"))
        assert (error.code, error.reason) == (grpc.StatusCode.DATA_LOSS, "INVALID_CHECKPOINT_STATE")
    done = await asyncio.to_thread(history_cli, str(tmp_path))
    assert done.returncode == 6, done.stderr
    assert "Traceback" not in done.stderr and "history skipped" in done.stderr
    await asyncio.to_thread(open_history(tmp_path).append, entry(2), ())
    assert (tmp_path / CORRUPT_INDEX_NAME).read_bytes() == raw
    assert [e.id for e in open_history(tmp_path).read().entries] == ["ckpt-2"]


HOSTILE_MEMBERS = {
    "blockers_max below uint32": [
        {"name": "m", "kind": "agent", "instance": "i", "blockers_max": -1}
    ],
    "records above uint64": [{"name": "m", "kind": "agent", "instance": "i", "records": 1 << 64}],
    "commit seconds infinite": [
        {"name": "m", "kind": "agent", "instance": "i", "commit_seconds": "INF"}
    ],
}


@pytest.mark.parametrize(
    "details", [*HOSTILE_MEMBERS.values(), DEEP], ids=[*HOSTILE_MEMBERS.keys(), "nested too deep"]
)
async def test_hostile_details_are_a_details_problem_never_an_error(
    tmp_path: Path, details: Any
) -> None:
    name = details_name("ckpt-1")
    open_history(tmp_path).append(entry(1, details=name), (MemberRecord("m", "agent", "i"),))
    if isinstance(details, bytes):
        raw = details
    else:
        raw = json.dumps({"format": 1, "id": "ckpt-1", "members": details}).encode()
        raw = raw.replace(b'"INF"', b"1e400")
    (tmp_path / name).write_bytes(raw)
    async with history_coordinator(tmp_path) as stub:
        answer = await get_checkpoint(stub, "ckpt-1")
    assert answer.checkpoint.id == "ckpt-1" and not answer.members
    assert answer.details_problem.startswith(name)
    done = await asyncio.to_thread(history_cli, str(tmp_path), "--id", "ckpt-1")
    assert "Traceback" not in done.stderr, done.stderr
