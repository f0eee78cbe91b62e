"""How the coordinator reads its history: requests that arrive while a read of the store is
in flight share it (a hanging store holds one thread, not one per request), and GetCheckpoint
of an unchanged history is answered from its cache without reading the details again."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from rollout_checkpoint.client.checkpointing.publication.history import (
    MemberRecord,
    details_name,
    open_history,
)
from rollout_checkpoint.client.checkpointing.publication.history_view import HistoryView
from rollout_checkpoint.client.coordinator.history_api import CheckpointHistoryApi
from rollout_checkpoint.client.fleet import FleetSpec, MemberSpec
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb

from .conftest import TOKEN
from .test_history import entry

REQUESTS = 8


def history_api(root: Path) -> CheckpointHistoryApi:
    spec = FleetSpec(
        members=(MemberSpec("gone", "127.0.0.1:9"),), token=TOKEN, checkpoint_root=str(root)
    )
    return CheckpointHistoryApi(spec)


async def test_requests_during_a_hanging_read_share_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    open_history(tmp_path).append(entry(1), ())
    entered = threading.Event()
    release = threading.Event()
    reads: list[int] = []
    snapshot = HistoryView.snapshot

    def hanging(view: HistoryView) -> Any:
        reads.append(1)
        entered.set()
        release.wait(60)
        return snapshot(view)

    monkeypatch.setattr(HistoryView, "snapshot", hanging)
    api = history_api(tmp_path)
    first = asyncio.create_task(api.list_checkpoints(cpb.ListCheckpointsRequest()))
    assert await asyncio.to_thread(entered.wait, 60)
    later = [
        asyncio.create_task(api.list_checkpoints(cpb.ListCheckpointsRequest()))
        for _ in range(REQUESTS - 1)
    ]
    await asyncio.sleep(0)  # each later request runs to where it waits for the store
    release.set()
    answers = await asyncio.gather(first, *later)
    assert [[a.id for a in answer.checkpoints] for answer in answers] == [["ckpt-1"]] * REQUESTS
    assert len(reads) == 1


async def test_get_checkpoint_of_an_unchanged_history_reads_its_details_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    member = MemberRecord("m", "agent", "m-1", commit_seconds=0.5)
    open_history(tmp_path).append(entry(1, details=details_name("ckpt-1")), (member,))
    details_reads: list[int] = []
    members = HistoryView.members

    def counted(view: HistoryView, attempt: Any) -> Any:
        details_reads.append(1)
        return members(view, attempt)

    monkeypatch.setattr(HistoryView, "members", counted)
    api = history_api(tmp_path)
    request = cpb.GetCheckpointRequest(id="ckpt-1")
    first = await api.get_checkpoint(request)
    assert await api.get_checkpoint(request) == first
    assert [m.name for m in first.members] == ["m"] and len(details_reads) == 1
    open_history(tmp_path).append(entry(2), ())  # a new index: a new snapshot
    assert await api.get_checkpoint(request) == first
    assert len(details_reads) == 2
