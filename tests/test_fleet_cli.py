"""The operator CLI and the CoordinatorService against a real fleet of example-server processes."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from grpc import aio

from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.server.core.rpc.wire import timestamp as stamp
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb
from rollout_checkpoint.v1 import coordinator_service_pb2_grpc as cpb_grpc
from rollout_checkpoint.v1 import types_pb2

from .conftest import TOKEN
from .processes import kill_group, started

CLI = [sys.executable, "-m", "rollout_checkpoint.client.cli.main"]
ENV = dict(os.environ, ROLLOUT_CHECKPOINT_TOKEN=TOKEN, GRPC_VERBOSITY="ERROR")


@dataclass
class Process:
    popen: subprocess.Popen[str]
    announced: dict[str, Any]


def start(command: list[str]) -> Process:
    popen, announced = started(command, env=ENV)
    return Process(popen, announced)


def stop(process: Process) -> None:
    kill_group(process.popen)


@dataclass
class RealFleet:
    servers: dict[str, Process]
    fleet_file: Path
    root: Path

    def http(self, name: str) -> str:
        return f"http://{self.servers[name].announced['http']}"


@contextlib.contextmanager
def real_fleet(tmp_path: Path, *, start_closed: bool = False) -> Iterator[RealFleet]:
    servers: dict[str, Process] = {}
    try:
        for name in ("counter", "weather"):
            command = [
                sys.executable,
                "-m",
                "rollout_checkpoint.examples.serve",
                name,
                "--session-secret",
                "fixed-secret",
            ]
            if start_closed:
                command.append("--start-closed")
            servers[name] = start(command)
        root = tmp_path / "checkpoints"
        fleet_file = tmp_path / f"fleet-{time.monotonic_ns()}.toml"
        lines = [f'checkpoint_root = "{root}"', "keep = 2"]
        for name, process in servers.items():
            lines += [
                "[[participants]]",
                f'name = "{name}"',
                f'address = "{process.announced["grpc"]}"',
            ]
        fleet_file.write_text("\n".join(lines) + "\n")
        yield RealFleet(servers, fleet_file, root)
    finally:
        for process in servers.values():
            stop(process)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env=ENV, capture_output=True, text=True, timeout=120)


def json_lines(output: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def test_cli_checkpoint_status_inspect_restore(tmp_path: Path) -> None:
    with real_fleet(tmp_path) as fleet:
        with httpx.Client(base_url=fleet.http("counter")) as episode:
            assert (
                episode.post("/ng-rollout/r1/seed_session", json={"initial_count": 4}).status_code
                == 200
            )
            episode.post("/ng-rollout/r1/increment_counter", json={"count": 3})
            cookies = episode.cookies
        status = cli("status", "--fleet", str(fleet.fleet_file), "--json")
        assert status.returncode == 0, status.stderr
        members = {m["name"]: m for m in json.loads(status.stdout)["members"]}
        assert (
            members["counter"]["state"] == "IDLE" and members["counter"]["counts"]["sessions"] == 1
        )
        taken = cli("checkpoint", "--fleet", str(fleet.fleet_file), "--json", "ckpt-a")
        assert taken.returncode == 0, taken.stderr
        lines = json_lines(taken.stdout)
        assert [line["phase"] for line in lines if "phase" in line][-4:] == [
            "COMMIT",
            "PUBLISH",
            "RESUME",
            "DONE",
        ]
        result = lines[-1]["result"]
        assert result["published"] and result["continued"] == ["r1"] and result["records"] == 1
        directory = Path(result["directory"])
        assert (fleet.root / "LATEST").read_text().strip() == "ckpt-a"
        inspected = cli("inspect", str(directory), "--json")
        assert inspected.returncode == 0, inspected.stderr
        summary = json.loads(inspected.stdout)
        assert summary["checkpoint_id"] == "ckpt-a"
    # A fresh fleet (the old processes are gone) restores the published checkpoint.
    with real_fleet(tmp_path, start_closed=True) as fresh:
        fresh.fleet_file.write_text(
            fresh.fleet_file.read_text().replace(str(fresh.root), str(fleet.root))
        )
        restored = cli("restore", "--fleet", str(fresh.fleet_file), "--json", "restore-1")
        assert restored.returncode == 0, restored.stderr
        assert json_lines(restored.stdout)[-1]["restored"] == {"counter": ["r1-a1"], "weather": []}
        assert cli("resume", "--fleet", str(fresh.fleet_file), "restore-1").returncode == 0
        with httpx.Client(base_url=fresh.http("counter"), cookies=cookies) as episode:
            assert episode.post("/ng-rollout/r1-a1/get_counter_value", json={}).json() == {
                "count": 7
            }


def test_a_corrupted_checkpoint_fails_inspect_and_restore_before_any_install(
    tmp_path: Path,
) -> None:
    with real_fleet(tmp_path) as fleet:
        httpx.post(fleet.http("counter") + "/ng-rollout/r1/seed_session", json={"initial_count": 1})
        assert (
            cli("checkpoint", "--fleet", str(fleet.fleet_file), "--json", "ckpt-b").returncode == 0
        )
        part = fleet.root / "ckpt-b" / "participants" / "resources" / "counter"
        records = next(part.glob("records-*.jsonl"))
        records.write_bytes(records.read_bytes().replace(b'"count":1', b'"count":9'))
        inspected = cli("inspect", str(fleet.root / "ckpt-b"))
        assert inspected.returncode == 6 and "digest" in inspected.stderr
    with real_fleet(tmp_path, start_closed=True) as fresh:
        fresh.fleet_file.write_text(
            fresh.fleet_file.read_text().replace(str(fresh.root), str(fleet.root))
        )
        restored = cli("restore", "--fleet", str(fresh.fleet_file), "--json", "restore-1")
        assert restored.returncode == 6
        assert json_lines(restored.stdout)[-1]["error"]["reason"] == "INVALID_CHECKPOINT_STATE"
        status = json.loads(cli("status", "--fleet", str(fresh.fleet_file), "--json").stdout)
        assert all(m["state"] == "IDLE" and m["restored_pending"] == 0 for m in status["members"])


def test_cli_restores_a_fleet_that_has_served_with_rejoin(tmp_path: Path) -> None:
    """The survivors of a crash (here: the same processes, still serving after the cut)
    restore only with --rejoin; the participant verb and the fleet verb both pass it."""
    with real_fleet(tmp_path) as fleet:
        with httpx.Client(base_url=fleet.http("counter")) as episode:
            episode.post("/ng-rollout/r1/seed_session", json={"initial_count": 4})
            episode.post("/ng-rollout/r1/increment_counter", json={"count": 3})
            taken = cli("checkpoint", "--fleet", str(fleet.fleet_file), "--json", "ckpt-a")
            assert taken.returncode == 0, taken.stderr
            directory = json_lines(taken.stdout)[-1]["result"]["directory"]
            episode.post("/ng-rollout/r1/increment_counter", json={"count": 5})  # past the cut
            cookies = episode.cookies
        address = fleet.servers["counter"].announced["grpc"]
        restore = ["participant", "restore", "--address", address, "restore-1"]
        restore += ["--dir", directory, "--episode", "r1"]
        plain = cli(*restore)
        assert plain.returncode != 0 and "FRESH_PROCESS_REQUIRED" in plain.stderr, plain.stderr
        rejoined = cli(*restore, "--rejoin")
        assert rejoined.returncode == 0, rejoined.stderr
        assert json.loads(rejoined.stdout)["restored"] == ["r1-a1"]
        # The fleet verb: the counter replays the same restore, the weather (fresh) restores.
        whole = cli("restore", "--fleet", str(fleet.fleet_file), "--json", "--rejoin", "restore-1")
        assert whole.returncode == 0, whole.stderr
        assert json_lines(whole.stdout)[-1]["restored"] == {"counter": ["r1-a1"], "weather": []}
        assert cli("resume", "--fleet", str(fleet.fleet_file), "restore-1").returncode == 0
        with httpx.Client(base_url=fleet.http("counter"), cookies=cookies) as episode:
            assert episode.post("/ng-rollout/r1-a1/get_counter_value", json={}).json() == {
                "count": 7
            }
            stale = episode.post("/ng-rollout/r1/get_counter_value", json={})
            assert stale.status_code == 409 and stale.json()["error"]["code"] == "stale_attempt"


async def test_coordinator_service_restores_a_fleet_that_has_served_with_rejoin(
    tmp_path: Path,
) -> None:
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    with real_fleet(tmp_path) as fleet:
        async with httpx.AsyncClient(base_url=fleet.http("counter")) as episode:
            await episode.post("/ng-rollout/r1/seed_session", json={"initial_count": 2})
            assert cli("checkpoint", "--fleet", str(fleet.fleet_file), "ckpt-r").returncode == 0
            await episode.post("/ng-rollout/r1/increment_counter", json={"count": 5})  # past it
            cookies = episode.cookies
        coordinator = start([*CLI, "coordinator", "--fleet", str(fleet.fleet_file)])
        try:
            async with aio.insecure_channel(coordinator.announced["grpc"]) as channel:
                stub = cpb_grpc.CoordinatorServiceStub(channel)
                restored = await stub.Restore(
                    cpb.CoordinatorServiceRestoreRequest(
                        checkpoint_id="restore-r", deadline=stamp(time.time() + 60), rejoin=True
                    ),
                    metadata=metadata,
                    timeout=60,
                )
                assert restored.source_checkpoint_id == "ckpt-r"
                assert [(m.name, list(m.restored)) for m in restored.members] == [
                    ("counter", ["r1-a1"]),
                    ("weather", []),
                ]
                await stub.Resume(
                    cpb.CoordinatorServiceResumeRequest(
                        checkpoint_id="restore-r", deadline=stamp(time.time() + 10)
                    ),
                    metadata=metadata,
                    timeout=10,
                )
        finally:
            stop(coordinator)
        async with httpx.AsyncClient(base_url=fleet.http("counter"), cookies=cookies) as episode:
            value = await episode.post("/ng-rollout/r1-a1/get_counter_value", json={})
            assert value.json() == {"count": 2}


def test_exit_codes_for_unreachable_and_usage(tmp_path: Path) -> None:
    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text('[[participants]]\nname = "gone"\naddress = "127.0.0.1:9"\n')
    assert cli("status", "--fleet", str(fleet_file)).returncode == 5
    fleet_file.write_text("nonsense = 1\n")
    assert cli("status", "--fleet", str(fleet_file)).returncode == 2


async def test_coordinator_service_checkpoint_stream_and_restore(tmp_path: Path) -> None:
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    with real_fleet(tmp_path) as fleet:
        httpx.post(fleet.http("counter") + "/ng-rollout/r1/seed_session", json={"initial_count": 2})
        coordinator = start([*CLI, "coordinator", "--fleet", str(fleet.fleet_file)])
        try:
            async with aio.insecure_channel(coordinator.announced["grpc"]) as channel:
                stub = cpb_grpc.CoordinatorServiceStub(channel)
                listed = await stub.ListParticipants(
                    cpb.ListParticipantsRequest(), metadata=metadata, timeout=10
                )
                assert [(m.name, m.kind) for m in listed.members] == [
                    ("counter", types_pb2.PARTICIPANT_KIND_RESOURCES),
                    ("weather", types_pb2.PARTICIPANT_KIND_RESOURCES),
                ]
                request = cpb.CheckpointRequest(
                    checkpoint_id="ckpt-c",
                    deadline=stamp(time.time() + 60),
                    derive_scope=True,
                    controller_state=b"\x00state",
                )
                messages = [
                    m async for m in stub.Checkpoint(request, metadata=metadata, timeout=60)
                ]
                phases = [m.phase for m in messages]
                assert (
                    phases[0] == cpb.CHECKPOINT_PHASE_PREPARE
                    and phases[-1] == cpb.CHECKPOINT_PHASE_DONE
                )
                assert (
                    cpb.CHECKPOINT_PHASE_PUBLISH in phases and sum(m.final for m in messages) == 1
                )
                result = messages[-1].result
                assert (
                    result.published
                    and result.prepare_outcome == cpb.FLEET_PREPARE_OUTCOME_PREPARED
                )
                assert [e.rollout_id for e in result.continued] == [
                    "r1"
                ] and result.record_count == 1
                # The fleet's pause (until the last Resume) and the retention after it.
                assert result.HasField("resumed_after") and result.HasField("retention_duration")
                assert (
                    result.resumed_after.ToTimedelta()
                    >= result.prepare_duration.ToTimedelta() + result.commit_duration.ToTimedelta()
                )
                assert cli("inspect", result.directory).returncode == 0
                with pytest.raises(aio.AioRpcError) as refused:
                    await stub.Prepare(
                        cpb.CoordinatorServicePrepareRequest(
                            checkpoint_id="x", deadline=stamp(time.time() + 5)
                        ),
                        timeout=10,
                    ).read()
                assert ControlError.from_rpc_error(refused.value).reason == "TOKEN_INVALID"
                # Resume is idempotent through the coordinator too.
                resumed = await stub.Resume(
                    cpb.CoordinatorServiceResumeRequest(
                        checkpoint_id="ckpt-c", deadline=stamp(time.time() + 10)
                    ),
                    metadata=metadata,
                    timeout=10,
                )
                assert sorted(resumed.idempotent_members) == ["counter", "weather"]
        finally:
            stop(coordinator)


def test_the_shipped_example_fleet_file_loads() -> None:
    from rollout_checkpoint.client.fleet import load_fleet_file

    spec = load_fleet_file(
        Path(__file__).resolve().parent.parent / "examples" / "fleet.toml",
        environ={"ROLLOUT_CHECKPOINT_TOKEN": "t"},
    )
    assert [m.name for m in spec.members] == [
        "environment",
        "policy_model",
        "agent",
        "prompt_injection",
        "counter",
    ]
    assert len({m.address for m in spec.members}) == 5
