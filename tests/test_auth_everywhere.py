"""Auth on both control services: every RPC refuses a missing or wrong token, the comparison
is hmac.compare_digest (checked with a spy, not with timings), and the token never shows up
in logs, errors or status.

tests/test_auth_and_input.py covers ParticipantService's refusals and its health and
reflection; here the same for CoordinatorService, the spy on both, and the token's absence
from everything either service says or logs, in-process and from real processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf.message import Message
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout_checkpoint.client.coordinator.service import Coordinator
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import FleetSpec, MemberSpec
from rollout_checkpoint.server.core.clock import SystemClock
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.rpc import auth
from rollout_checkpoint.server.core.rpc.wire import timestamp as stamp
from rollout_checkpoint.server.runtime.settings import CheckpointSettings
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb
from rollout_checkpoint.v1 import participant_service_pb2 as pb
from rollout_checkpoint.v1 import types_pb2

from .conftest import TOKEN, Harness, start_harness, stop_harness
from .processes import announcement
from .processes import start as start_process

PARTICIPANT = "/rollout_checkpoint.v1.ParticipantService/"
COORDINATOR = "/rollout_checkpoint.v1.CoordinatorService/"
STREAMING = {"Prepare", "Checkpoint"}

WRONG = [
    pytest.param((), id="missing"),
    pytest.param((("authorization", "Bearer wrong"),), id="wrong"),
    pytest.param((("authorization", ""),), id="empty"),
    pytest.param((("authorization", "Bearer "),), id="bearer-only"),
    pytest.param((("authorization", TOKEN),), id="no-scheme"),
    pytest.param((("authorization", f"Basic {TOKEN}"),), id="basic"),
    pytest.param((("authorization", f"Bearer {TOKEN}x"),), id="token-plus-one"),
    pytest.param((("authorization", f"Bearer {TOKEN[:-1]}"),), id="token-minus-one"),
    pytest.param((("authorization", f"Bearer {TOKEN.upper()}"),), id="case"),
    pytest.param((("x-authorization", f"Bearer {TOKEN}"),), id="other-key"),
]


def coordinator_requests(deadline: float, directory: str) -> dict[str, Message]:
    d = stamp(deadline)
    episodes = [types_pb2.EpisodeId(rollout_id="r1")]
    return {
        "ListParticipants": cpb.ListParticipantsRequest(),
        "Prepare": cpb.CoordinatorServicePrepareRequest(checkpoint_id="auth-1", deadline=d),
        "Commit": cpb.CoordinatorServiceCommitRequest(
            checkpoint_id="auth-1", deadline=d, checkpoint_dir=directory, derive_scope=True
        ),
        "Restore": cpb.CoordinatorServiceRestoreRequest(checkpoint_id="auth-1", deadline=d),
        "Resume": cpb.CoordinatorServiceResumeRequest(checkpoint_id="auth-1", deadline=d),
        "Retire": cpb.CoordinatorServiceRetireRequest(
            checkpoint_id="auth-1", deadline=d, episodes=episodes
        ),
        "Forget": cpb.CoordinatorServiceForgetRequest(
            checkpoint_id="auth-1", deadline=d, rollout_ids=["r1"]
        ),
        "Renew": cpb.CoordinatorServiceRenewRequest(checkpoint_id="auth-1", deadline=d),
        "Checkpoint": cpb.CheckpointRequest(checkpoint_id="auth-1", deadline=d, derive_scope=True),
        "ListCheckpoints": cpb.ListCheckpointsRequest(),
        "GetCheckpoint": cpb.GetCheckpointRequest(id="auth-1"),
    }


def participant_requests(deadline: float, directory: str) -> dict[str, Message]:
    d = stamp(deadline)
    return {
        "GetParticipant": pb.GetParticipantRequest(),
        "GetStatus": pb.GetStatusRequest(),
        "ListEpisodes": pb.ListEpisodesRequest(),
        "Prepare": pb.PrepareRequest(checkpoint_id="auth-1", deadline=d),
        "Renew": pb.RenewRequest(checkpoint_id="auth-1", deadline=d),
        "Commit": pb.CommitRequest(checkpoint_id="auth-1", deadline=d, checkpoint_dir=directory),
        "Restore": pb.RestoreRequest(
            checkpoint_id="auth-1",
            deadline=d,
            checkpoint_dir=directory,
            scope=types_pb2.EpisodeScope(),
        ),
        "Resume": pb.ResumeRequest(checkpoint_id="auth-1", deadline=d),
        "Retire": pb.RetireRequest(
            checkpoint_id="auth-1", deadline=d, episodes=[types_pb2.EpisodeId(rollout_id="r1")]
        ),
        "Forget": pb.ForgetRequest(checkpoint_id="auth-1", deadline=d, rollout_ids=["r1"]),
    }


async def raw_call(
    address: str, path: str, request: Message, metadata: tuple[tuple[str, str], ...]
) -> list[bytes]:
    """Call with the given metadata; the replies' bytes, or ControlError."""
    name = path.rsplit("/", 1)[1]
    async with aio.insecure_channel(address) as channel:
        try:
            if name in STREAMING:
                call = channel.unary_stream(path)(
                    request.SerializeToString(), metadata=metadata, timeout=30
                )
                return [reply async for reply in call]
            return [
                await channel.unary_unary(path)(
                    request.SerializeToString(), metadata=metadata, timeout=30
                )
            ]
        except aio.AioRpcError as error:
            raise ControlError.from_rpc_error(error) from None


@dataclass
class Both:
    harness: Harness
    coordinator: Coordinator
    root: Path

    @property
    def coordinator_address(self) -> str:
        return f"127.0.0.1:{self.coordinator.port}"


@contextlib.asynccontextmanager
async def both(tmp_path: Path, *, member_token: str = TOKEN) -> AsyncIterator[Both]:
    # The participant runs on the real clock: the coordinator's deadlines are real ones.
    harness = await start_harness(clock=SystemClock())  # type: ignore[arg-type]
    spec = FleetSpec(
        members=(MemberSpec("double", harness.grpc_address),),
        token=member_token,
        checkpoint_root=str(tmp_path / "published"),
    )
    coordinator = Coordinator(spec, "127.0.0.1:0")
    await coordinator.start()
    try:
        yield Both(harness, coordinator, tmp_path)
    finally:
        await coordinator.stop()
        await stop_harness(harness)


@pytest.mark.parametrize("metadata", WRONG)
async def test_every_coordinator_rpc_refuses_a_missing_or_wrong_token(
    tmp_path: Path, metadata: tuple[tuple[str, str], ...]
) -> None:
    async with both(tmp_path) as s:
        requests = coordinator_requests(time.time() + 60, str(tmp_path / "ckpt"))
        for name, request in requests.items():
            with pytest.raises(ControlError) as caught:
                await raw_call(s.coordinator_address, COORDINATOR + name, request, metadata)
            error = caught.value
            assert (error.reason, error.code) == ("TOKEN_INVALID", grpc.StatusCode.UNAUTHENTICATED)
            assert TOKEN not in error.message and TOKEN not in json.dumps(error.metadata)
        # Nothing reached the member: no checkpoint began, nothing was written.
        status = await s.harness.client.get_status()
        assert status.state == types_pb2.PARTICIPANT_STATE_IDLE and status.admission_open
        assert not (tmp_path / "ckpt").exists() and not (tmp_path / "published").exists()


async def test_the_coordinator_accepts_the_token_and_health_needs_none(tmp_path: Path) -> None:
    async with both(tmp_path) as s:
        metadata = (("authorization", f"bearer  {TOKEN} "),)  # scheme case and spaces are fine
        [reply] = await raw_call(
            s.coordinator_address,
            COORDINATOR + "ListParticipants",
            cpb.ListParticipantsRequest(),
            metadata,
        )
        assert [m.name for m in cpb.ListParticipantsResponse.FromString(reply).members] == [
            "double"
        ]
        async with aio.insecure_channel(s.coordinator_address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "rollout_checkpoint.v1.CoordinatorService"):
                answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
            reflection = channel.stream_stream(
                "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
            )
            with pytest.raises(aio.AioRpcError) as caught:
                async for _ in reflection(iter([b""]), timeout=30):
                    pass
            assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_a_member_that_refuses_the_coordinators_token_is_reported_as_refusing(
    tmp_path: Path,
) -> None:
    """A fleet file with the wrong token: the member decided (TOKEN_INVALID), so the
    coordinator says PARTICIPANT_FAILED / UNAUTHENTICATED naming it, not that it is
    unreachable (a controller would wait for it forever)."""
    async with both(tmp_path, member_token="not-the-members-token") as s:
        metadata = (("authorization", "Bearer not-the-members-token"),)
        with pytest.raises(ControlError) as caught:
            await raw_call(
                s.coordinator_address,
                COORDINATOR + "ListParticipants",
                cpb.ListParticipantsRequest(),
                metadata,
            )
        error = caught.value
        assert error.reason == "PARTICIPANT_FAILED", error
        assert error.code == grpc.StatusCode.UNAUTHENTICATED, error
        assert error.metadata["failedMembers"] == "double=TOKEN_INVALID"
        assert "not-the-members-token" not in error.message + json.dumps(error.metadata)
        # The operator CLI says the same: refused (exit 4), not unreachable (exit 5).
        fleet = tmp_path / "fleet.toml"
        fleet.write_text(
            f'token_env = "WRONG_TOKEN"\n[[participants]]\nname = "double"\n'
            f'address = "{s.harness.grpc_address}"\n'
        )
        cli = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "rollout_checkpoint.client.cli.main",
            "status",
            "--fleet",
            str(fleet),
            "--json",
            env=dict(os.environ, WRONG_TOKEN="not-the-members-token", GRPC_VERBOSITY="ERROR"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(cli.communicate(), 60)
        assert cli.returncode == 4, (cli.returncode, out, err)
        assert json.loads(out)["error"]["reason"] == "PARTICIPANT_FAILED"


# -- the comparison is hmac.compare_digest --------------------------------------------------


class CompareSpy:
    """Stands in for the `hmac` module inside one module's namespace."""

    def __init__(self) -> None:
        self.calls: list[tuple[bytes, bytes]] = []

    def compare_digest(self, a: bytes, b: bytes) -> bool:
        self.calls.append((a, b))
        return hmac.compare_digest(a, b)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> CompareSpy:
    """The one bearer check of the participants and the coordinator alike."""
    compare = CompareSpy()
    monkeypatch.setattr(auth, "hmac", compare)
    return compare


CASES = [
    ((), b""),
    ((("authorization", "Bearer wrong"),), b"wrong"),
    ((("authorization", f"Basic {TOKEN}"),), TOKEN.encode()),  # compared, then refused
    ((("authorization", f"Bearer {TOKEN}x"),), f"{TOKEN}x".encode()),
]


async def test_every_check_goes_through_hmac_compare_digest(
    tmp_path: Path, spy: CompareSpy
) -> None:
    async with both(tmp_path) as s:
        directory = str(tmp_path / "ckpt")
        participant = participant_requests(time.time() + 60, directory)
        coordinator = coordinator_requests(time.time() + 60, directory)
        for metadata, presented in CASES:
            spy.calls.clear()
            for name, request in participant.items():
                with pytest.raises(ControlError):
                    await raw_call(s.harness.grpc_address, PARTICIPANT + name, request, metadata)
            # One constant-time comparison per call, of what was presented against the token.
            assert spy.calls == [(presented, TOKEN.encode())] * len(participant)
            spy.calls.clear()
            for name, request in coordinator.items():
                with pytest.raises(ControlError):
                    await raw_call(s.coordinator_address, COORDINATOR + name, request, metadata)
            assert spy.calls == [(presented, TOKEN.encode())] * len(coordinator)
        # Accepted calls are checked the same way (a coordinator call reaching the member is
        # checked by both).
        spy.calls.clear()
        good = (("authorization", f"Bearer {TOKEN}"),)
        await raw_call(
            s.harness.grpc_address, PARTICIPANT + "GetStatus", pb.GetStatusRequest(), good
        )
        assert spy.calls == [(TOKEN.encode(), TOKEN.encode())]
        spy.calls.clear()
        await raw_call(
            s.coordinator_address,
            COORDINATOR + "ListParticipants",
            cpb.ListParticipantsRequest(),
            good,
        )
        # The coordinator's own check, then the member's check of the discovery call.
        assert spy.calls == [(TOKEN.encode(), TOKEN.encode())] * 2


# -- the token never appears ----------------------------------------------------------------


async def test_the_token_is_in_no_log_error_or_status(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    texts: list[str] = []
    async with both(tmp_path) as s:
        h = s.harness
        good = (("authorization", f"Bearer {TOKEN}"),)
        for metadata in [good, *(p.values[0] for p in WRONG)]:
            for address, prefix, requests in (
                (h.grpc_address, PARTICIPANT, participant_requests(time.time() + 60, "/x")),
                (
                    s.coordinator_address,
                    COORDINATOR,
                    coordinator_requests(time.time() + 60, str(tmp_path / "c")),
                ),
            ):
                for name, request in requests.items():
                    try:
                        replies = await raw_call(address, prefix + name, request, metadata)
                        texts.extend(repr(r) for r in replies)
                    except ControlError as error:
                        texts.append(f"{error} {error.message} {json.dumps(error.metadata)}")
            # The good token ran the coordinator's checkpoint (and Resume ended it): undo it.
            with contextlib.suppress(ControlError):
                await h.client.resume("auth-1", time.time() + 60)
        # Failures that log: a hook that raises, a member that refuses.
        h.participant.seed(EpisodeId("r1"), {"n": 1})
        h.participant.fail["export"] = RuntimeError("export broke")
        with pytest.raises(ControlError) as caught:
            await raw_call(
                s.coordinator_address,
                COORDINATOR + "Checkpoint",
                cpb.CheckpointRequest(checkpoint_id="auth-2", deadline=stamp(time.time() + 60)),
                good,
            )
        assert caught.value.reason == "PARTICIPANT_FAILED"
        texts.append(f"{caught.value} {json.dumps(caught.value.metadata)}")
        status = await h.client.get_status()
        info = await h.client.get_participant()
        texts.extend([str(status), str(info), repr(s.coordinator.servicer.spec)])
        texts.append(repr(CheckpointSettings(enabled=True, token=TOKEN)))
        texts.append(str(CheckpointSettings(enabled=True, token=TOKEN).model_dump()))
    everything = "\n".join(texts)
    assert "TOKEN_INVALID" in everything and "export" in caplog.text  # we did look at something
    assert TOKEN not in everything
    assert TOKEN not in caplog.text
    for record in caplog.records:
        assert TOKEN not in str(record.args) and TOKEN not in str(record.__dict__)


COORDINATOR_AT_DEBUG = """
import logging, sys
from rollout_checkpoint.client.cli.main import main
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
sys.exit(main(sys.argv[1:]))
"""


def test_the_token_is_in_no_log_of_real_processes(tmp_path: Path) -> None:
    """A counter server and a coordinator as processes, at debug level, through accepted and
    refused calls and a whole checkpoint: neither writes the token anywhere."""
    env = dict(os.environ, GRPC_VERBOSITY="ERROR", ROLLOUT_CHECKPOINT_TOKEN=TOKEN)
    logs = {name: tmp_path / f"{name}.log" for name in ("counter", "coordinator")}
    processes: list[subprocess.Popen[str]] = []

    def start(name: str, command: list[str]) -> dict[str, Any]:
        process = start_process(command, env=env, log=logs[name])
        processes.append(process)
        return announcement(process, name, log=logs[name])

    try:
        counter = start(
            "counter",
            [
                sys.executable,
                "-m",
                "rollout_checkpoint.examples.serve",
                "counter",
                "--token",
                TOKEN,
                "--log-level",
                "debug",
            ],
        )
        fleet = tmp_path / "fleet.toml"
        fleet.write_text(
            f'checkpoint_root = "{tmp_path / "published"}"\n'
            f'[[participants]]\nname = "counter"\naddress = "{counter["grpc"]}"\n'
        )
        coordinator = start(
            "coordinator",
            [sys.executable, "-c", COORDINATOR_AT_DEBUG, "coordinator", "--fleet", str(fleet)],
        )
        with httpx.Client(base_url=f"http://{counter['http']}") as http:
            assert http.post("/ng-rollout/r1/seed_session", json={}).status_code == 200

        async def calls() -> None:
            for token in (TOKEN, "wrong"):
                metadata = (("authorization", f"Bearer {token}"),)
                with contextlib.suppress(ControlError):
                    await raw_call(
                        coordinator["grpc"],
                        COORDINATOR + "Checkpoint",
                        cpb.CheckpointRequest(deadline=stamp(time.time() + 60), derive_scope=True),
                        metadata,
                    )
                with contextlib.suppress(ControlError):
                    await raw_call(
                        counter["grpc"], PARTICIPANT + "GetStatus", pb.GetStatusRequest(), metadata
                    )

        asyncio.run(calls())
        assert (tmp_path / "published" / "LATEST").exists()  # the checkpoint really ran
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
    for name, path in logs.items():
        text = path.read_text()
        assert "DEBUG" in text or "debug" in text.lower(), (name, text[:2000])
        assert TOKEN not in text, name
