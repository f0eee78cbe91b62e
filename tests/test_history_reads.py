"""How the coordinator reads its history: requests that arrive while a read of the store is
in flight share it (a hanging store holds one thread, not one per request), and GetCheckpoint
of an unchanged history is answered from its cache without reading the details again."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from google.protobuf import json_format

from rollout_checkpoint.client.checkpointing.publication.history import (
    MemberRecord,
    details_name,
    open_history,
)
from rollout_checkpoint.client.checkpointing.publication.history_view import HistoryView
from rollout_checkpoint.client.coordinator import history_api as history_api_module
from rollout_checkpoint.client.coordinator.history_api import CheckpointHistoryApi
from rollout_checkpoint.client.coordinator.service import Coordinator
from rollout_checkpoint.client.fleet import FleetSpec, MemberSpec
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb

from .conftest import TOKEN
from .test_history import entry

REQUESTS = 8


def root_spec(root: Path) -> FleetSpec:
    """A fleet of `root` whose one member is never called."""
    return FleetSpec(
        members=(MemberSpec("gone", "127.0.0.1:9"),), token=TOKEN, checkpoint_root=str(root)
    )


def history_api(root: Path) -> CheckpointHistoryApi:
    return CheckpointHistoryApi(root_spec(root))


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


async def test_pages_and_their_json_are_built_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page of 1,000 attempts was ~120 ms of the coordinator's loop: its messages and its
    JSON are built on a thread."""
    for number in range(3):
        open_history(tmp_path).append(entry(number), ())
    loop_thread = threading.get_ident()
    built_on: set[int] = set()
    message_of, dict_of = history_api_module.attempt_message, json_format.MessageToDict

    def attempt_message(attempt: Any) -> Any:
        built_on.add(threading.get_ident())
        return message_of(attempt)

    def message_to_dict(message: Any, **options: Any) -> Any:
        built_on.add(threading.get_ident())
        return dict_of(message, **options)

    monkeypatch.setattr(history_api_module, "attempt_message", attempt_message)
    monkeypatch.setattr(json_format, "MessageToDict", message_to_dict)
    async with history_coordinator_http(tmp_path) as http:
        page = await http.get("/checkpoints", params={"page_size": 1000})
        one = await http.get("/checkpoints/ckpt-1")
    assert page.status_code == 200 and len(page.json()["checkpoints"]) == 3
    assert one.status_code == 200 and one.json()["checkpoint"]["id"] == "ckpt-1"
    assert built_on and loop_thread not in built_on


@contextlib.asynccontextmanager
async def history_coordinator_http(root: Path) -> AsyncIterator[httpx.AsyncClient]:
    """An in-process coordinator of `root` with its HTTP port (no member is ever called)."""
    coordinator = Coordinator(root_spec(root), "127.0.0.1:0", http_address="127.0.0.1:0")
    await coordinator.start()
    try:
        assert coordinator.http_listener is not None
        address = coordinator.http_listener.bound_address
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(
            base_url=f"http://{address}", headers=headers, timeout=60
        ) as http:
            yield http
    finally:
        await coordinator.stop()
