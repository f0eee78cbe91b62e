"""The history API: ListCheckpoints and GetCheckpoint over gRPC, and the same as JSON on the
coordinator's HTTP port, against a real coordinator process, a real fleet and the root's real
history; paging that neither skips nor repeats while the history changes; a corrupt index
reported, never a crash; nothing served without the token."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf import json_format
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from grpc import aio

from rollout_checkpoint.client.checkpointing.checkpoint import restore_published
from rollout_checkpoint.client.checkpointing.publication import open_checkpoint_root
from rollout_checkpoint.client.checkpointing.publication.history import (
    DETAILS_KEPT,
    INDEX_NAME,
    MemberRecord,
    details_name,
    open_history,
)
from rollout_checkpoint.client.checkpointing.publication.history_view import HistoryView
from rollout_checkpoint.client.coordinator.service import Coordinator
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import FleetSpec, MemberSpec
from rollout_checkpoint.server.core.rpc.wire import timestamp
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb
from rollout_checkpoint.v1 import coordinator_service_pb2_grpc as cpb_grpc
from rollout_checkpoint.v1 import types_pb2

from .conftest import TOKEN
from .processes import kill_group, started
from .s3_server import S3Connection, SeaweedS3
from .test_coordination import RunningFleet, fleet_of
from .test_fleet_cli import CLI, ENV
from .test_history import KINDS, entry, seed
from .tls_files import self_signed

AUTH = (("authorization", f"Bearer {TOKEN}"),)
HEADERS = {"authorization": f"Bearer {TOKEN}"}


@dataclasses.dataclass
class RunningCoordinator:
    grpc: str
    http: str


def write_fleet_file(tmp_path: Path, f: RunningFleet, root: Path) -> Path:
    lines = [f'checkpoint_root = "{root}"', "allow_agents_without_model = true"]
    for name, harness in f.h.items():
        lines += ["[[participants]]", f'name = "{name}"', f'address = "{harness.grpc_address}"']
    fleet_file = tmp_path / f"fleet-{secrets.token_hex(4)}.toml"
    fleet_file.write_text("\n".join(lines) + "\n")
    return fleet_file


@contextlib.asynccontextmanager
async def coordinator_process(fleet_file: Path, log: Path) -> AsyncIterator[RunningCoordinator]:
    """`rollout-checkpoint coordinator --http-address 127.0.0.1:0`, stopped by SIGTERM (its
    group killed whatever happens). Started from a thread: the fleet's members run in this
    loop and must keep answering meanwhile."""
    command = [*CLI, "coordinator", "--fleet", str(fleet_file), "--http-address", "127.0.0.1:0"]
    process, announced = await asyncio.to_thread(started, command, env=ENV, log=log)
    try:
        yield RunningCoordinator(announced["grpc"], f"http://{announced['http']}")
        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.wait, 60) == 0, log.read_text()
    finally:
        kill_group(process)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env=ENV, capture_output=True, text=True, timeout=120)


def deadline_in(seconds: float) -> Timestamp:
    return timestamp(time.time() + seconds)


def as_json(message: Message) -> Any:
    return json_format.MessageToDict(message)


def ids(response: cpb.ListCheckpointsResponse) -> list[str]:
    return [c.id for c in response.checkpoints]


async def list_checkpoints(stub: Any, **fields: Any) -> cpb.ListCheckpointsResponse:
    response: cpb.ListCheckpointsResponse = await stub.ListCheckpoints(
        cpb.ListCheckpointsRequest(**fields), metadata=AUTH, timeout=30
    )
    return response


async def get_checkpoint(stub: Any, checkpoint_id: str) -> cpb.GetCheckpointResponse:
    response: cpb.GetCheckpointResponse = await stub.GetCheckpoint(
        cpb.GetCheckpointRequest(id=checkpoint_id), metadata=AUTH, timeout=30
    )
    return response


async def refused(call: Any) -> ControlError:
    with pytest.raises(aio.AioRpcError) as failed:
        await call
    return ControlError.from_rpc_error(failed.value)


async def checkpoint_rpc(stub: Any, checkpoint_id: str) -> None:
    request = cpb.CheckpointRequest(checkpoint_id=checkpoint_id, deadline=deadline_in(60))
    async for _ in stub.Checkpoint(request, metadata=AUTH, timeout=60):
        pass


def error_of(response: httpx.Response) -> tuple[int, str, str]:
    error = response.json()["error"]
    return response.status_code, error["code"], error["reason"]


async def check_rest_matches_grpc(http: httpx.AsyncClient, stub: Any) -> None:
    """Every route answers the JSON of the gRPC method's very response."""
    page = await http.get("/checkpoints", params={"page_size": 2})
    assert page.status_code == 200
    assert page.json() == as_json(await list_checkpoints(stub, page_size=2))
    token = page.json()["nextPageToken"]
    second = await http.get("/checkpoints", params={"page_size": 2, "page_token": token})
    assert second.json() == as_json(await list_checkpoints(stub, page_size=2, page_token=token))
    latest = await http.get("/checkpoints/latest", params={"status": "failed"})
    assert latest.json() == as_json(
        await list_checkpoints(stub, page_size=1, status=cpb.ATTEMPT_STATUS_FAILED)
    )
    assert [c["id"] for c in latest.json()["checkpoints"]] == ["ckpt-bad"]
    restores = await http.get("/checkpoints", params={"operation": "ATTEMPT_OPERATION_RESTORE"})
    assert [c["id"] for c in restores.json()["checkpoints"]] == ["restore-one"]
    one = await http.get("/checkpoints/ckpt-rpc")
    assert one.json() == as_json(await get_checkpoint(stub, "ckpt-rpc"))
    assert one.json()["checkpoint"]["startedAt"].endswith("Z")


async def check_rest_refusals(http: httpx.AsyncClient) -> None:
    """Bad input is a typed 400 (nothing is looked up for an id that is not one); an absent
    attempt is a typed 404."""
    for params in ({"page_size": "many"}, {"page_size": "-1"}, {"status": "lost"}):
        answer = await http.get("/checkpoints", params=params)
        assert error_of(answer) == (400, "INVALID_ARGUMENT", "INVALID_REQUEST"), params
    bad_token = await http.get("/checkpoints", params={"page_token": "not-a-token"})
    assert error_of(bad_token) == (400, "INVALID_ARGUMENT", "INVALID_REQUEST")
    for hostile in ("a%2Fb", "%2E%2E", "..%2F..%2Fetc%2Fpasswd", "a%00b", ".history", "%20"):
        answer = await http.get(f"/checkpoints/{hostile}")
        assert error_of(answer) == (400, "INVALID_ARGUMENT", "INVALID_REQUEST"), hostile
    absent = await http.get("/checkpoints/never-taken")
    assert error_of(absent) == (404, "NOT_FOUND", "INVALID_REQUEST")
    assert (await http.get("/nowhere")).status_code == 404


async def check_unauthenticated(coordinator: RunningCoordinator, stub: Any) -> None:
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
        async with httpx.AsyncClient(base_url=coordinator.http, headers=headers) as anyone:
            for path in ("/checkpoints", "/checkpoints/ckpt-rpc", "/fleet", "/nowhere"):
                answer = await anyone.get(path)
                assert error_of(answer) == (401, "UNAUTHENTICATED", "TOKEN_INVALID"), path
                assert answer.headers["www-authenticate"].startswith("Bearer")
                assert "ckpt" not in answer.text
    for call in (
        stub.ListCheckpoints(cpb.ListCheckpointsRequest(), timeout=30),
        stub.GetCheckpoint(cpb.GetCheckpointRequest(id="ckpt-rpc"), timeout=30),
    ):
        error = await refused(call)
        assert (error.code, error.reason) == (grpc.StatusCode.UNAUTHENTICATED, "TOKEN_INVALID")


async def check_history(stub: Any) -> None:
    """The four attempts, newest first, paged; filters; counts; members of one."""
    first = await list_checkpoints(stub, page_size=3)
    assert ids(first) == ["restore-one", "ckpt-bad", "ckpt-rpc"] and first.next_page_token
    last = await list_checkpoints(stub, page_size=3, page_token=first.next_page_token)
    assert ids(last) == ["ckpt-cli"] and not last.next_page_token
    assert first.total_size == last.total_size == 4 and not first.history_problem
    assert as_json(first.counts) == {"completed": 2, "failed": 1, "restores": 1}
    every = await list_checkpoints(stub)
    assert ids(every) == ids(first) + ids(last)
    assert [(c.trigger, c.operation, c.status) for c in every.checkpoints] == [
        ("manual", cpb.ATTEMPT_OPERATION_RESTORE, cpb.ATTEMPT_STATUS_COMPLETED),
        ("manual", cpb.ATTEMPT_OPERATION_CHECKPOINT, cpb.ATTEMPT_STATUS_FAILED),
        ("manual", cpb.ATTEMPT_OPERATION_CHECKPOINT, cpb.ATTEMPT_STATUS_COMPLETED),
        ("manual", cpb.ATTEMPT_OPERATION_CHECKPOINT, cpb.ATTEMPT_STATUS_COMPLETED),
    ]
    failed = await list_checkpoints(stub, status=cpb.ATTEMPT_STATUS_FAILED)
    assert ids(failed) == ["ckpt-bad"] and failed.total_size == 1
    bad = failed.checkpoints[0]
    assert list(bad.failed_members) == ["resources"] and bad.reason == "PARTICIPANT_FAILED"
    assert failed.counts == every.counts  # the counts ignore the filters

    rpc = await get_checkpoint(stub, "ckpt-rpc")
    assert rpc.checkpoint == every.checkpoints[2] and not rpc.details_dropped
    assert [(m.name, m.kind) for m in rpc.members] == [
        ("agent", types_pb2.PARTICIPANT_KIND_AGENT),
        ("resources", types_pb2.PARTICIPANT_KIND_RESOURCES),
    ]
    assert all(m.part and m.HasField("prepared_seconds") for m in rpc.members)
    assert sum(m.records for m in rpc.members) == rpc.checkpoint.records == 2
    assert [s.stage for s in rpc.checkpoint.stages][:2] == ["prepare", "commit"]
    failing = await get_checkpoint(stub, "ckpt-bad")
    assert [m.name for m in failing.members if m.error] == ["resources"]
    restore = await get_checkpoint(stub, "restore-one")
    assert restore.checkpoint.source == "ckpt-rpc" and not restore.details_dropped


async def check_grpc_refusals(stub: Any) -> None:
    token = await list_checkpoints(stub, page_size=1, status=cpb.ATTEMPT_STATUS_COMPLETED)
    for request in (
        cpb.ListCheckpointsRequest(page_size=-1),
        cpb.ListCheckpointsRequest(page_token="garbage!"),
        cpb.ListCheckpointsRequest(page_token=token.next_page_token),  # other filters
        cpb.ListCheckpointsRequest(page_token=token.next_page_token[:-4]),
    ):
        error = await refused(stub.ListCheckpoints(request, metadata=AUTH, timeout=30))
        assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")
        assert error.metadata["field"] in ("page_size", "page_token")
    absent = await refused(get_checkpoint(stub, "never-taken"))
    assert (absent.code, absent.reason, absent.metadata["field"]) == (
        grpc.StatusCode.NOT_FOUND,
        "INVALID_REQUEST",
        "id",
    )
    hostile = await refused(get_checkpoint(stub, "../../etc"))
    assert (hostile.code, hostile.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")


async def test_the_history_over_grpc_and_http_survives_a_coordinator_restart(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    async with fleet_of(*KINDS) as f:
        seed(f)
        fleet_file = write_fleet_file(tmp_path, f, root)
        done = await asyncio.to_thread(
            run_cli, "checkpoint", "--fleet", str(fleet_file), "ckpt-cli"
        )
        assert done.returncode == 0, done.stderr
        async with (
            coordinator_process(fleet_file, tmp_path / "first.log") as coordinator,
            aio.insecure_channel(coordinator.grpc) as channel,
            httpx.AsyncClient(base_url=coordinator.http, headers=HEADERS, timeout=30) as http,
        ):
            stub = cpb_grpc.CoordinatorServiceStub(channel)
            await checkpoint_rpc(stub, "ckpt-rpc")
            f.h["resources"].participant.fail["export"] = RuntimeError("disk on fire")
            assert (await refused(checkpoint_rpc(stub, "ckpt-bad"))).reason == "PARTICIPANT_FAILED"
            del f.h["resources"].participant.fail["export"]
            fleet = await http.get("/fleet")
            listed = await stub.ListParticipants(
                cpb.ListParticipantsRequest(), metadata=AUTH, timeout=30
            )
            assert fleet.status_code == 200 and fleet.json() == as_json(listed)
            async with fleet_of(*KINDS) as fresh:
                await restore_published(
                    fresh.fleet, open_checkpoint_root(root), "restore-one", fresh.deadline()
                )
            await check_history(stub)
            await check_grpc_refusals(stub)
            await check_rest_matches_grpc(http, stub)
            await check_rest_refusals(http)
            await check_unauthenticated(coordinator, stub)
            before = (await http.get("/checkpoints")).json()
    # A new coordinator process of the same root lists the same history.
    async with (
        coordinator_process(fleet_file, tmp_path / "second.log") as coordinator,
        httpx.AsyncClient(base_url=coordinator.http, headers=HEADERS, timeout=30) as http,
    ):
        assert (await http.get("/checkpoints")).json() == before


async def test_a_corrupt_index_is_reported_and_the_coordinator_keeps_serving(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / INDEX_NAME).write_bytes(b'{"format": 1, "entries": [{"id": 3}')
    spec = FleetSpec(
        members=(MemberSpec("gone", "127.0.0.1:9"),), token=TOKEN, checkpoint_root=str(root)
    )
    coordinator = Coordinator(spec, "127.0.0.1:0", http_address="127.0.0.1:0")
    await coordinator.start()
    try:
        assert coordinator.http_listener is not None
        async with (
            aio.insecure_channel(f"127.0.0.1:{coordinator.port}") as channel,
            httpx.AsyncClient(
                base_url=f"http://{coordinator.http_listener.bound_address}", headers=HEADERS
            ) as http,
        ):
            stub = cpb_grpc.CoordinatorServiceStub(channel)
            for _ in range(2):  # the second read comes from the cache: the same report
                listed = await list_checkpoints(stub)
                assert not listed.checkpoints and "history skipped" in listed.history_problem
                assert not listed.next_page_token and listed.total_size == 0
            rest = await http.get("/checkpoints")
            assert rest.status_code == 200 and rest.json() == as_json(listed)
            error = await refused(get_checkpoint(stub, "ckpt-1"))
            assert (error.code, error.reason) == (
                grpc.StatusCode.DATA_LOSS,
                "INVALID_CHECKPOINT_STATE",
            )
            answer = await http.get("/checkpoints/ckpt-1")
            assert error_of(answer) == (500, "DATA_LOSS", "INVALID_CHECKPOINT_STATE")
            # A repaired index is read again at once (its version changed).
            open_history(root).append(entry(1), ())
            assert ids(await list_checkpoints(stub)) == ["ckpt-1"]
    finally:
        await coordinator.stop()


@contextlib.asynccontextmanager
async def history_coordinator(root: Path) -> AsyncIterator[Any]:
    """An in-process coordinator of `root` (no member is ever called) and its stub."""
    spec = FleetSpec(
        members=(MemberSpec("gone", "127.0.0.1:9"),), token=TOKEN, checkpoint_root=str(root)
    )
    coordinator = Coordinator(spec, "127.0.0.1:0")
    await coordinator.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{coordinator.port}") as channel:
            yield cpb_grpc.CoordinatorServiceStub(channel)
    finally:
        await coordinator.stop()


async def test_paging_neither_skips_nor_repeats_while_the_history_grows_and_drops(
    tmp_path: Path,
) -> None:
    history = open_history(tmp_path)
    for number in range(120):
        await asyncio.to_thread(history.append, entry(number), ())
    async with history_coordinator(tmp_path) as stub:
        default = await list_checkpoints(stub)
        assert len(default.checkpoints) == 50 and default.total_size == 120
        seen = ids(default)
        token = default.next_page_token
        # New attempts arrive between pages: the next page still continues after the last
        # one seen (newest first), and the new ones wait for a fresh first page.
        for number in range(120, 125):
            await asyncio.to_thread(history.append, entry(number), ())
        while token:
            page = await list_checkpoints(stub, page_size=50, page_token=token)
            seen += ids(page)
            token = page.next_page_token
        assert seen == [f"ckpt-{n}" for n in reversed(range(120))]
        # A page whose anchor was dropped as one of the oldest: nothing older is left.
        small = await list_checkpoints(stub, page_size=124)
        assert ids(small)[-1] == "ckpt-1" and small.next_page_token
        await asyncio.to_thread(history.append, entry(125), (), max_bytes=4096)
        after_drop = await list_checkpoints(stub, page_size=124, page_token=small.next_page_token)
        assert not after_drop.checkpoints and not after_drop.next_page_token
        assert "ckpt-1" not in ids(await list_checkpoints(stub))


async def test_an_attempt_older_than_the_kept_details_says_its_members_were_dropped(
    tmp_path: Path,
) -> None:
    history = open_history(tmp_path)
    member = MemberRecord(name="m", kind="agent", instance="m-1", commit_seconds=0.25)
    for number in range(DETAILS_KEPT + 1):
        kept = entry(number, details=details_name(f"ckpt-{number}"))
        await asyncio.to_thread(history.append, kept, (member,))
    async with history_coordinator(tmp_path) as stub:
        oldest = await get_checkpoint(stub, "ckpt-0")
        assert oldest.details_dropped and not oldest.members
        assert not oldest.checkpoint.has_details
        newest = await get_checkpoint(stub, f"ckpt-{DETAILS_KEPT}")
        assert not newest.details_dropped and newest.checkpoint.has_details
        assert [
            (m.name, m.commit_seconds, m.HasField("durable_seconds")) for m in newest.members
        ] == [("m", 0.25, False)]
        # Details that do not decode are reported beside the entry, never an error.
        details = next(tmp_path.glob(f".history-ckpt-{DETAILS_KEPT}.*.json"))
        details.write_bytes(b"[garbage")
        broken = await get_checkpoint(stub, f"ckpt-{DETAILS_KEPT}")
        assert not broken.members and "not JSON" in broken.details_problem


def test_the_view_parses_an_unchanged_index_once_and_a_changed_one_by_its_new_lines(
    tmp_path: Path,
) -> None:
    history = open_history(tmp_path)
    view = HistoryView(tmp_path)
    assert view.snapshot().newest_first == ()
    history.append(entry(1), ())
    first = view.snapshot()
    assert view.snapshot() is first and [e.id for e in first.newest_first] == ["ckpt-1"]
    history.append(entry(2), ())
    second = view.snapshot().newest_first
    assert [e.id for e in second] == ["ckpt-2", "ckpt-1"]
    assert second[1] is first.newest_first[0]  # the unchanged line was not decoded again
    index = tmp_path / INDEX_NAME
    # Another layout (a hand-written index) is decoded whole; a bad line is the whole
    # index's problem, as for any reader.
    document = json.loads(index.read_bytes())
    index.write_text(json.dumps(document, indent=2))
    assert [e.id for e in view.snapshot().newest_first] == ["ckpt-2", "ckpt-1"]
    history.append(entry(3), ())
    lines = index.read_bytes().replace(b'"id":"ckpt-2"', b'"id":2')
    index.write_bytes(lines)
    broken = view.snapshot()
    assert broken.newest_first == () and "id is not a str" in (broken.problem or "")


def test_the_view_of_an_object_store_root_parses_an_unchanged_index_once(
    s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    connection: S3Connection = s3_server.connection
    for name, value in connection.environment().items():
        monkeypatch.setenv(name, value)
    url = connection.url(f"history-view-{secrets.token_hex(6)}")
    view = HistoryView(url)
    assert view.snapshot().newest_first == ()
    history = open_history(url)
    history.append(entry(1), ())
    first = view.snapshot()
    assert view.snapshot() is first and [e.id for e in first.newest_first] == ["ckpt-1"]
    history.append(entry(2), ())
    assert [e.id for e in view.snapshot().newest_first] == ["ckpt-2", "ckpt-1"]


def test_a_taken_or_invalid_http_address_fails_the_start_and_is_named(tmp_path: Path) -> None:
    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text('[[participants]]\nname = "gone"\naddress = "127.0.0.1:9"\n')
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        for address in (f"127.0.0.1:{taken.getsockname()[1]}", "127.0.0.1:port"):
            done = run_cli("coordinator", "--fleet", str(fleet_file), "--http-address", address)
            assert done.returncode == 8, done.stderr
            assert address in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_with_tls_files_the_http_port_is_https_too(tmp_path: Path) -> None:
    """The token must not travel in plaintext beside a TLS gRPC port."""
    key, cert = self_signed(tmp_path)
    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text(
        f'checkpoint_root = "{tmp_path / "root"}"\n'
        '[[participants]]\nname = "gone"\naddress = "127.0.0.1:9"\n'
    )
    command = [
        *CLI,
        "coordinator",
        "--fleet",
        str(fleet_file),
        "--http-address",
        "127.0.0.1:0",
        "--tls-cert-file",
        str(cert),
        "--tls-key-file",
        str(key),
    ]
    process, announced = started(command, env=ENV, log=tmp_path / "tls.log")
    try:
        port = announced["http"].rsplit(":", 1)[1]
        trusting = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(verify=trusting, headers=HEADERS, timeout=30) as client:
            answer = client.get(f"https://localhost:{port}/checkpoints")
            assert answer.status_code == 200 and answer.json() == {"counts": {}}
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://localhost:{port}/checkpoints", headers=HEADERS, timeout=30)
    finally:
        kill_group(process)


async def test_polling_the_fleet_does_not_cut_a_checkpoint_in_progress(tmp_path: Path) -> None:
    async with fleet_of(*KINDS) as f:
        seed(f)
        spec = dataclasses.replace(f.fleet.spec, checkpoint_root=str(tmp_path / "root"))
        coordinator = Coordinator(spec, "127.0.0.1:0", http_address="127.0.0.1:0")
        await coordinator.start()
        try:
            assert coordinator.http_listener is not None
            base = f"http://{coordinator.http_listener.bound_address}"
            async with (
                aio.insecure_channel(f"127.0.0.1:{coordinator.port}") as channel,
                httpx.AsyncClient(base_url=base, headers=HEADERS, timeout=30) as http,
            ):
                stub = cpb_grpc.CoordinatorServiceStub(channel)
                release = f.h["resources"].participant.gate("export")
                taking = asyncio.create_task(checkpoint_rpc(stub, "ckpt-polled"))
                await f.h["resources"].participant.entered["export"].wait()
                fleet = await http.get("/fleet")
                assert [m["name"] for m in fleet.json()["members"]] == ["agent", "resources"]
                release.set()
                await taking  # its commit and resume went through the same channels
                listed = await list_checkpoints(stub)
                assert [(c.id, c.status) for c in listed.checkpoints] == [
                    ("ckpt-polled", cpb.ATTEMPT_STATUS_COMPLETED)
                ]
        finally:
            await coordinator.stop()


async def test_list_participants_during_a_checkpoint_does_not_close_its_channels(
    tmp_path: Path,
) -> None:
    """ListParticipants discovers the fleet afresh; the checkpoint that is running keeps the
    channels it holds (before, they were closed under it: "Channel is closed")."""
    async with fleet_of(*KINDS) as f:
        seed(f)
        spec = dataclasses.replace(f.fleet.spec, checkpoint_root=str(tmp_path / "root"))
        coordinator = Coordinator(spec, "127.0.0.1:0")
        await coordinator.start()
        try:
            async with aio.insecure_channel(f"127.0.0.1:{coordinator.port}") as channel:
                stub = cpb_grpc.CoordinatorServiceStub(channel)
                release = f.h["resources"].participant.gate("export")
                taking = asyncio.create_task(checkpoint_rpc(stub, "ckpt-listed"))
                await f.h["resources"].participant.entered["export"].wait()
                listed = await stub.ListParticipants(
                    cpb.ListParticipantsRequest(), metadata=AUTH, timeout=30
                )
                assert [m.name for m in listed.members] == ["agent", "resources"]
                release.set()
                await taking
                history = await list_checkpoints(stub)
                assert [(c.id, c.status) for c in history.checkpoints] == [
                    ("ckpt-listed", cpb.ATTEMPT_STATUS_COMPLETED)
                ]
                again = await stub.ListParticipants(
                    cpb.ListParticipantsRequest(), metadata=AUTH, timeout=30
                )
                assert [m.name for m in again.members] == ["agent", "resources"]
        finally:
            await coordinator.stop()
