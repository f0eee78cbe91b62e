"""Hostile input to both control services: every refusal typed, the server unharmed.

What tests/test_auth_and_input.py covers for ParticipantService (a few fixed garbage byte
strings, bad ids, Prepare's deadline bounds, missing deadlines, attempt bounds, a 100,000
episode commit scope) is not repeated. Here:

* hypothesis-generated garbage, and every truncation of a valid request, to every RPC of
  ParticipantService and CoordinatorService through a raw channel (identity serializers);
* out-of-range fields on every RPC of both services (past and far-future deadlines, invalid
  timestamps, empty and 129-character ids, attempts at the maximum, 100,000-episode scopes);
* path tricks: checkpoint directories (relative, `..`, outside the allowed roots, symlinks
  out of the directory) on Restore and through the coordinator, and instance names;
* tampered manifests and records through the Restore RPC;
* oversized messages (grpcio's own RESOURCE_EXHAUSTED).

Every outcome is OK or a status with an ErrorInfo of our domain, never UNKNOWN or INTERNAL;
the server keeps serving; nothing is written outside the checkpoint directory; nothing is
installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf import timestamp_pb2
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.checkpointing.fanout import FleetError
from rollout_checkpoint.client.coordinator.service import Coordinator
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import Fleet, FleetSpec, MemberSpec
from rollout_checkpoint.server.core.clock import SystemClock
from rollout_checkpoint.server.core.episodes import MAX_ATTEMPT, EpisodeId
from rollout_checkpoint.server.core.part_storage import LocalStorage, WriteFence
from rollout_checkpoint.server.core.rpc.wire import timestamp as stamp
from rollout_checkpoint.server.runtime.control_plane import ControlPlane
from rollout_checkpoint.server.runtime.install import install_checkpointing
from rollout_checkpoint.server.runtime.settings import CheckpointSettings
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb
from rollout_checkpoint.v1 import participant_service_pb2 as pb
from rollout_checkpoint.v1 import types_pb2

from .conftest import TOKEN, Harness, drain, refused, start_harness, stop_harness
from .double import DoubleParticipant, create_app
from .loop_thread import LoopThread

PARTICIPANT = "/rollout_checkpoint.v1.ParticipantService/"
COORDINATOR = "/rollout_checkpoint.v1.CoordinatorService/"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
DOMAIN = "rollout-checkpoint.dev"
MAX_ATTEMPT_WIRE = 2**31 - 1


def participant_requests(deadline: float, directory: str) -> dict[str, tuple[Message, bool]]:
    """A valid request of every ParticipantService RPC (and whether it streams)."""
    d = stamp(deadline)
    episodes = [types_pb2.EpisodeId(rollout_id="r1", attempt=3)]
    return {
        "GetParticipant": (pb.GetParticipantRequest(), False),
        "GetStatus": (pb.GetStatusRequest(), False),
        "ListEpisodes": (pb.ListEpisodesRequest(page_size=5, page_token="cjE="), False),
        "Prepare": (pb.PrepareRequest(checkpoint_id="hostile-1", deadline=d), True),
        "Renew": (pb.RenewRequest(checkpoint_id="hostile-1", deadline=d), False),
        "Commit": (
            pb.CommitRequest(
                checkpoint_id="hostile-1",
                deadline=d,
                checkpoint_dir=directory,
                scope=types_pb2.EpisodeScope(episodes=episodes),
            ),
            False,
        ),
        "Restore": (
            pb.RestoreRequest(
                checkpoint_id="hostile-1",
                deadline=d,
                checkpoint_dir=directory,
                scope=types_pb2.EpisodeScope(episodes=episodes),
            ),
            False,
        ),
        "Resume": (pb.ResumeRequest(checkpoint_id="hostile-1", deadline=d), False),
        "Retire": (
            pb.RetireRequest(checkpoint_id="hostile-1", deadline=d, episodes=episodes),
            False,
        ),
        "Forget": (
            pb.ForgetRequest(checkpoint_id="hostile-1", deadline=d, rollout_ids=["r1"]),
            False,
        ),
    }


def coordinator_requests(deadline: float, directory: str) -> dict[str, tuple[Message, bool]]:
    """A valid request of every CoordinatorService RPC (and whether it streams)."""
    d = stamp(deadline)
    episodes = [types_pb2.EpisodeId(rollout_id="r1", attempt=3)]
    scope = types_pb2.EpisodeScope(episodes=episodes)
    return {
        "ListParticipants": (cpb.ListParticipantsRequest(), False),
        "Prepare": (
            cpb.CoordinatorServicePrepareRequest(checkpoint_id="hostile-1", deadline=d),
            True,
        ),
        "Commit": (
            cpb.CoordinatorServiceCommitRequest(
                checkpoint_id="hostile-1", deadline=d, checkpoint_dir=directory, scope=scope
            ),
            False,
        ),
        "Restore": (
            cpb.CoordinatorServiceRestoreRequest(
                checkpoint_id="hostile-1", deadline=d, source_checkpoint_id="LATEST", scope=scope
            ),
            False,
        ),
        "Resume": (
            cpb.CoordinatorServiceResumeRequest(checkpoint_id="hostile-1", deadline=d),
            False,
        ),
        "Retire": (
            cpb.CoordinatorServiceRetireRequest(
                checkpoint_id="hostile-1", deadline=d, episodes=episodes
            ),
            False,
        ),
        "Forget": (
            cpb.CoordinatorServiceForgetRequest(
                checkpoint_id="hostile-1", deadline=d, rollout_ids=["r1"]
            ),
            False,
        ),
        "Renew": (cpb.CoordinatorServiceRenewRequest(checkpoint_id="hostile-1", deadline=d), False),
        "Checkpoint": (
            cpb.CheckpointRequest(
                checkpoint_id="hostile-1", deadline=d, derive_scope=True, controller_state=b"\x00"
            ),
            True,
        ),
    }


# -- the servers, on a loop of their own --------------------------------------------------


@dataclass
class Servers:
    loop: LoopThread
    harness: Harness
    coordinator: Coordinator
    channel: grpc.Channel
    coordinator_channel: grpc.Channel
    base: Path
    root: Path

    @property
    def coordinator_address(self) -> str:
        return f"127.0.0.1:{self.coordinator.port}"

    def call(
        self, path: str, raw: bytes, stream: bool, timeout: float = 20
    ) -> grpc.RpcError | None:
        """Send raw bytes; return the error (or None when the call succeeded)."""
        try:
            if stream:
                for _ in self.channel_for(path).unary_stream(path)(
                    raw, metadata=AUTH, timeout=timeout
                ):
                    pass
            else:
                self.channel_for(path).unary_unary(path)(raw, metadata=AUTH, timeout=timeout)
        except grpc.RpcError as error:
            return error
        return None

    def channel_for(self, path: str) -> grpc.Channel:
        return self.channel if path.startswith(PARTICIPANT) else self.coordinator_channel


def snapshot(base: Path, root: Path) -> list[str]:
    """Every path under `base` that is not under the allowed root."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(base):
        for name in [*dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            if not (path + "/").startswith(str(root) + "/"):
                found.append(os.path.relpath(path, base))
    return sorted(found)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    base = tmp_path_factory.mktemp("hostile")
    root = base / "root"
    root.mkdir()
    (base / "outside").mkdir()
    loop = LoopThread()

    async def start() -> tuple[Harness, Coordinator]:
        # The participant runs on the real clock: the coordinator's deadlines are real ones.
        harness = await start_harness(
            clock=SystemClock(),  # type: ignore[arg-type]
            allowed_checkpoint_roots=(str(root),),
        )
        spec = FleetSpec(
            members=(MemberSpec("double", harness.grpc_address),),
            token=TOKEN,
            checkpoint_root=str(root / "published"),
        )
        coordinator = Coordinator(spec, "127.0.0.1:0")
        await coordinator.start()
        return harness, coordinator

    harness, coordinator = loop.run(start())
    found = Servers(
        loop,
        harness,
        coordinator,
        grpc.insecure_channel(harness.grpc_address),
        grpc.insecure_channel(f"127.0.0.1:{coordinator.port}"),
        base,
        root,
    )
    try:
        yield found
    finally:
        found.channel.close()
        found.coordinator_channel.close()

        async def stop() -> None:
            await coordinator.stop()
            await stop_harness(harness)

        loop.run(stop())
        loop.close()


def typed(error: grpc.RpcError | None) -> ControlError | None:
    """The error as the client library reads it; it must be one the server decided on."""
    if error is None:
        return None
    assert isinstance(error, grpc.Call)
    code = error.code()
    assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (code, error.details())
    decoded = ControlError.from_rpc_error(error)  # type: ignore[arg-type]
    assert decoded.reason is not None and decoded.domain == DOMAIN, decoded
    return decoded


def parses(request_type: type[Message], raw: bytes) -> bool:
    try:
        request_type.FromString(raw)
    except (DecodeError, ValueError, RuntimeError):
        return False
    return True


def still_serving(s: Servers) -> None:
    """Both servers answer, nothing is installed, nothing was written outside the root."""
    status = s.call(PARTICIPANT + "GetStatus", b"", False)
    assert status is None
    listed = s.call(COORDINATOR + "ListParticipants", b"", False)
    assert listed is None
    assert s.harness.participant.states == {}
    assert snapshot(s.base, s.root) == ["outside"]


ALL_PARTICIPANT = participant_requests(0, "/x")
ALL_COORDINATOR = coordinator_requests(0, "/x")
TARGETS = [
    (PARTICIPANT + name, type(req), stream) for name, (req, stream) in ALL_PARTICIPANT.items()
] + [(COORDINATOR + name, type(req), stream) for name, (req, stream) in ALL_COORDINATOR.items()]


def check_garbage(
    s: Servers, path: str, request_type: type[Message], stream: bool, raw: bytes
) -> None:
    decoded = typed(s.call(path, raw, stream))
    if not parses(request_type, raw):
        assert decoded is not None
        assert (decoded.reason, decoded.code) == (
            "INVALID_REQUEST",
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        assert decoded.metadata.get("field") == "request"


@settings(
    derandomize=True,
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(target=st.sampled_from(TARGETS), raw=st.binary(max_size=300))
def test_random_bytes_to_every_rpc_are_typed(
    servers: Servers, target: tuple[str, type[Message], bool], raw: bytes
) -> None:
    path, request_type, stream = target
    check_garbage(servers, path, request_type, stream, raw)
    still_serving(servers)


@settings(
    derandomize=True,
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(target=st.sampled_from(range(len(TARGETS))), data=st.data())
def test_mutated_valid_requests_to_every_rpc_are_typed(
    servers: Servers, target: int, data: st.DataObject
) -> None:
    """Valid requests with bytes flipped, inserted or deleted: mostly still parseable, with
    fields out of every range a controller would send."""
    path, request_type, stream = TARGETS[target]
    name = path.rsplit("/", 1)[1]
    # Whole seconds: the request's size must not depend on the moment (hypothesis replays).
    deadline = int(time.time()) + data.draw(st.sampled_from([-100, 30, 90_000]))
    directory = data.draw(st.sampled_from([str(servers.root / "ckpt"), "/x", "rel", "/a/../b"]))
    requests = (
        participant_requests(deadline, directory)
        if path.startswith(PARTICIPANT)
        else coordinator_requests(deadline, directory)
    )
    raw = bytearray(requests[name][0].SerializeToString())
    for _ in range(data.draw(st.integers(0, 4))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete"]))
        at = data.draw(st.integers(0, len(raw)))
        if op == "insert":
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=4))
        elif raw and at < len(raw):
            if op == "flip":
                raw[at] ^= data.draw(st.integers(1, 255))
            else:
                del raw[at]
    check_garbage(servers, path, request_type, stream, bytes(raw))
    # A mutated Prepare may have opened a checkpoint: abort it so the next example starts IDLE.
    servers.loop.run(_reset(servers.harness))
    still_serving(servers)


async def _reset(h: Harness) -> None:
    control = h.control
    if control.active_checkpoint_id is not None:
        await control.resume(control.active_checkpoint_id, h.clock.now() + 30)


def test_every_truncation_of_every_valid_request_is_typed(servers: Servers) -> None:
    deadline = time.time() + 60
    directory = str(servers.root / "ckpt")
    for prefix, requests in (
        (PARTICIPANT, participant_requests(deadline, directory)),
        (COORDINATOR, coordinator_requests(deadline, directory)),
    ):
        for name, (request, stream) in requests.items():
            if name in ("Prepare", "Checkpoint", "Restore"):
                continue  # a valid prefix of these would run a real checkpoint; see below
            raw = request.SerializeToString()
            for cut in range(len(raw)):
                check_garbage(servers, prefix + name, type(request), stream, raw[:cut])
            servers.loop.run(_reset(servers.harness))
    # The streaming and restoring RPCs: truncations that no longer parse.
    for prefix, requests in (
        (PARTICIPANT, participant_requests(deadline, directory)),
        (COORDINATOR, coordinator_requests(deadline, directory)),
    ):
        for name in ("Prepare", "Checkpoint", "Restore"):
            if name not in requests:
                continue
            request, stream = requests[name]
            raw = request.SerializeToString()
            for cut in range(len(raw)):
                if not parses(type(request), raw[:cut]):
                    check_garbage(servers, prefix + name, type(request), stream, raw[:cut])
    servers.loop.run(_reset(servers.harness))
    still_serving(servers)


# -- out-of-range fields ---------------------------------------------------------------


def _bad_stamps() -> list[tuple[str, timestamp_pb2.Timestamp]]:
    return [
        ("negative-nanos", timestamp_pb2.Timestamp(seconds=int(time.time()) + 60, nanos=-1)),
        ("nanos-overflow", timestamp_pb2.Timestamp(seconds=int(time.time()) + 60, nanos=10**9)),
        ("epoch", timestamp_pb2.Timestamp(seconds=0)),
        ("negative", timestamp_pb2.Timestamp(seconds=-(2**62))),
        ("year-10000", timestamp_pb2.Timestamp(seconds=253402300800)),
        ("int64-max", timestamp_pb2.Timestamp(seconds=2**63 - 1, nanos=999_999_999)),
    ]


@pytest.mark.parametrize("service", ["participant", "coordinator"])
def test_deadlines_out_of_range_on_every_rpc(servers: Servers, service: str) -> None:
    now = time.time()
    prefix, build = (
        (PARTICIPANT, participant_requests)
        if service == "participant"
        else (COORDINATOR, coordinator_requests)
    )
    directory = str(servers.root / "ckpt")
    with_deadline = {
        name: (request, stream)
        for name, (request, stream) in build(now + 60, directory).items()
        if "deadline" in type(request).DESCRIPTOR.fields_by_name
    }
    for name, (request, stream) in with_deadline.items():
        path = prefix + name
        # Far future: an unbounded lease.
        far = type(request)()
        far.CopyFrom(request)
        far.deadline.CopyFrom(stamp(now + 86400 + 600))
        error = typed(servers.call(path, far.SerializeToString(), stream))
        assert error is not None and error.reason == "INVALID_REQUEST", (name, error)
        assert error.metadata["field"] == "deadline"
        # Past: refused, except Resume, which always reopens.
        past = type(request)()
        past.CopyFrom(request)
        past.deadline.CopyFrom(stamp(now - 5))
        error = typed(servers.call(path, past.SerializeToString(), stream))
        if name == "Resume":
            assert error is None, error
        else:
            assert error is not None and error.reason == "CHECKPOINT_DEADLINE_EXCEEDED", (
                name,
                error,
            )
            assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED
        # Not a timestamp at all: never a crash, never a wrap-around into the valid range.
        for label, bad in _bad_stamps():
            odd = type(request)()
            odd.CopyFrom(request)
            odd.deadline.CopyFrom(bad)
            error = typed(servers.call(path, odd.SerializeToString(), stream))
            if name == "Resume" and error is None:
                continue  # a past deadline is fine for a Resume
            assert error is not None, (name, label)
            assert error.reason in ("INVALID_REQUEST", "CHECKPOINT_DEADLINE_EXCEEDED"), (
                name,
                label,
                error,
            )
        servers.loop.run(_reset(servers.harness))
    still_serving(servers)


BAD_IDS = ["", "x" * 129, "../x", "a/b", ".", "..", "-rf", "x\x00y", "é"]


@pytest.mark.parametrize("service", ["participant", "coordinator"])
def test_bad_checkpoint_ids_on_every_rpc(servers: Servers, service: str) -> None:
    prefix, build = (
        (PARTICIPANT, participant_requests)
        if service == "participant"
        else (COORDINATOR, coordinator_requests)
    )
    for name, (request, stream) in build(time.time() + 60, str(servers.root / "ckpt")).items():
        if "checkpoint_id" not in type(request).DESCRIPTOR.fields_by_name:
            continue
        for bad in BAD_IDS:
            if name == "Checkpoint" and bad == "":
                continue  # empty: the coordinator picks an id
            changed = type(request)()
            changed.CopyFrom(request)
            changed.checkpoint_id = bad
            error = typed(servers.call(prefix + name, changed.SerializeToString(), stream))
            assert error is not None and error.reason == "INVALID_REQUEST", (name, bad, error)
            assert error.metadata["field"] == "checkpoint_id", (name, bad)
    still_serving(servers)


def test_coordinator_refuses_out_of_range_episodes_and_ids(servers: Servers) -> None:
    d = stamp(time.time() + 60)
    cases: list[tuple[str, Message, str]] = [
        (
            "Retire",
            cpb.CoordinatorServiceRetireRequest(
                checkpoint_id="c",
                deadline=d,
                episodes=[types_pb2.EpisodeId(rollout_id="r", attempt=MAX_ATTEMPT_WIRE)],
            ),
            "episodes[0].attempt",
        ),
        (
            "Retire",
            cpb.CoordinatorServiceRetireRequest(
                checkpoint_id="c",
                deadline=d,
                episodes=[types_pb2.EpisodeId(rollout_id="r", attempt=2**32 - 1)],
            ),
            "episodes[0].attempt",
        ),
        (
            "Retire",
            cpb.CoordinatorServiceRetireRequest(
                checkpoint_id="c", deadline=d, episodes=[types_pb2.EpisodeId(rollout_id="r-a1")]
            ),
            "episodes[0].rollout_id",
        ),
        ("Retire", cpb.CoordinatorServiceRetireRequest(checkpoint_id="c", deadline=d), "episodes"),
        (
            "Forget",
            cpb.CoordinatorServiceForgetRequest(checkpoint_id="c", deadline=d),
            "rollout_ids",
        ),
        (
            "Forget",
            cpb.CoordinatorServiceForgetRequest(
                checkpoint_id="c", deadline=d, rollout_ids=["x" * 129]
            ),
            "rollout_ids",
        ),
        (
            "Forget",
            cpb.CoordinatorServiceForgetRequest(
                checkpoint_id="c", deadline=d, rollout_ids=["../x"]
            ),
            "rollout_ids",
        ),
        (
            "Commit",
            cpb.CoordinatorServiceCommitRequest(
                checkpoint_id="c",
                deadline=d,
                checkpoint_dir="/x",
                scope=types_pb2.EpisodeScope(
                    episodes=[types_pb2.EpisodeId(rollout_id="r", attempt=MAX_ATTEMPT_WIRE)]
                ),
            ),
            "scope.episodes[0].attempt",
        ),
        (
            "Commit",
            cpb.CoordinatorServiceCommitRequest(
                checkpoint_id="c",
                deadline=d,
                checkpoint_dir="/x",
                scope=types_pb2.EpisodeScope(),
                derive_scope=True,
            ),
            "scope",
        ),
        (
            "Restore",
            cpb.CoordinatorServiceRestoreRequest(
                checkpoint_id="c", deadline=d, source_checkpoint_id="../x"
            ),
            "source_checkpoint_id",
        ),
        (
            "Restore",
            cpb.CoordinatorServiceRestoreRequest(
                checkpoint_id="c", deadline=d, source_checkpoint_id="LATEST/../../etc"
            ),
            "source_checkpoint_id",
        ),
        (
            "Restore",
            cpb.CoordinatorServiceRestoreRequest(
                checkpoint_id="c",
                deadline=d,
                scope=types_pb2.EpisodeScope(episodes=[types_pb2.EpisodeId(rollout_id="")]),
            ),
            "scope.episodes[0].rollout_id",
        ),
        (
            "Checkpoint",
            cpb.CheckpointRequest(
                deadline=d,
                scope=types_pb2.EpisodeScope(
                    episodes=[types_pb2.EpisodeId(rollout_id="r", attempt=MAX_ATTEMPT_WIRE)]
                ),
            ),
            "scope.episodes[0].attempt",
        ),
    ]
    marks = len(servers.harness.control.retired_attempts)
    for name, request, field in cases:
        stream = name in ("Prepare", "Checkpoint")
        error = typed(servers.call(COORDINATOR + name, request.SerializeToString(), stream))
        assert error is not None and error.reason == "INVALID_REQUEST", (name, field, error)
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT
        assert error.metadata["field"] == field, (name, error)
    assert len(servers.harness.control.retired_attempts) == marks  # nothing was marked
    still_serving(servers)


def test_path_tricks_through_the_coordinator_are_refused_by_the_members(servers: Servers) -> None:
    s = servers
    outside = s.base / "outside"
    (s.root / "escape").symlink_to(outside)
    try:
        d = stamp(time.time() + 60)
        prepare = cpb.CoordinatorServicePrepareRequest(checkpoint_id="paths-1", deadline=d)
        assert s.call(COORDINATOR + "Prepare", prepare.SerializeToString(), True) is None
        for directory in [
            "relative/ckpt",
            str(s.root / ".." / "outside"),
            str(outside / "ckpt"),
            str(s.root / "escape" / "ckpt"),
            str(s.root) + "/./ckpt",
            "",
        ]:
            commit = cpb.CoordinatorServiceCommitRequest(
                checkpoint_id="paths-1", deadline=d, checkpoint_dir=directory, derive_scope=True
            )
            error = typed(s.call(COORDINATOR + "Commit", commit.SerializeToString(), False))
            assert error is not None, directory
            assert error.reason == "PARTICIPANT_FAILED", error
            assert error.code == grpc.StatusCode.INVALID_ARGUMENT, error
            assert error.metadata["failedMembers"] == "double=INVALID_REQUEST"
            assert error.metadata["memberField"] == "checkpoint_dir"
        assert list(outside.iterdir()) == []
        resume = cpb.CoordinatorServiceResumeRequest(checkpoint_id="paths-1", deadline=d)
        assert s.call(COORDINATOR + "Resume", resume.SerializeToString(), False) is None
    finally:
        (s.root / "escape").unlink()
    still_serving(s)


def test_a_coordinator_commit_of_a_100000_episode_scope(servers: Servers) -> None:
    s = servers
    d = stamp(time.time() + 120)
    prepare = cpb.CoordinatorServicePrepareRequest(checkpoint_id="huge-1", deadline=d)
    assert s.call(COORDINATOR + "Prepare", prepare.SerializeToString(), True) is None
    scope = types_pb2.EpisodeScope(
        episodes=[types_pb2.EpisodeId(rollout_id=f"r{i}", attempt=i % 7) for i in range(100_000)]
    )
    commit = cpb.CoordinatorServiceCommitRequest(
        checkpoint_id="huge-1", deadline=d, checkpoint_dir=str(s.root / "huge"), scope=scope
    )
    reply = s.coordinator_channel.unary_unary(
        COORDINATOR + "Commit",
        response_deserializer=cpb.CoordinatorServiceCommitResponse.FromString,
    )(commit.SerializeToString(), metadata=AUTH, timeout=60)
    assert reply.members[0].manifest.record_count == 0 and len(reply.scope) == 100_000
    resume = cpb.CoordinatorServiceResumeRequest(checkpoint_id="huge-1", deadline=d)
    assert s.call(COORDINATOR + "Resume", resume.SerializeToString(), False) is None
    still_serving(s)


def test_oversized_messages_get_grpcio_resource_exhausted(servers: Servers) -> None:
    s = servers
    # The participant's limit is 16 MiB (max_message_bytes); the coordinator keeps grpcio's 4 MiB.
    for path, size in [(PARTICIPANT + "Forget", 17 * 2**20), (COORDINATOR + "Forget", 5 * 2**20)]:
        request = (
            pb.ForgetRequest
            if path.startswith(PARTICIPANT)
            else cpb.CoordinatorServiceForgetRequest
        )(
            checkpoint_id="c",
            deadline=stamp(time.time() + 60),
            rollout_ids=["r" * 100] * (size // 102),
        )
        error = s.call(path, request.SerializeToString(), False)
        assert isinstance(error, grpc.Call)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    still_serving(s)


# -- the participant: restore with path tricks, huge scopes, tampered parts -------------------


DEADLINE = 60.0
STATES = {
    EpisodeId("r1"): {"b": 1, "a": [2**70]},
    EpisodeId("r2", 1): {"n": 2},
    EpisodeId("r3"): {"n": 3},
}


def write_part(checkpoint_dir: Path, instance: str = "double", checkpoint_id: str = "c1") -> Path:
    """A genuine part, as the DoubleParticipant's commit writes it."""
    lines = [
        json.dumps({"episode_id": e.to_json(), "state": s}, separators=(",", ":")).encode()
        for e, s in sorted(STATES.items())
    ]
    LocalStorage().write_part(
        str(checkpoint_dir), "resources", instance, checkpoint_id, lines, WriteFence()
    )
    return checkpoint_dir / "participants" / "resources" / instance


async def assert_untouched(h: Harness) -> None:
    assert h.participant.states == {}
    status = await h.client.get_status()
    assert status.state == types_pb2.PARTICIPANT_STATE_IDLE and status.admission_open
    assert status.restored_pending == 0


async def restore_good_copy(h: Harness, base: Path) -> None:
    """The participant keeps serving, and is still fresh: a good restore works afterwards."""
    good = base / "good"
    write_part(good)
    reply = await h.client.restore("restore-good", h.deadline(), str(good), list(STATES))
    assert sorted(reply.restored) == ["r1-a1", "r2-a2", "r3-a1"]


async def test_restore_path_tricks_are_refused_and_nothing_is_read_outside(tmp_path: Path) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    root.mkdir()
    write_part(outside)  # a valid part outside: reading it would succeed
    h = await start_harness(allowed_checkpoint_roots=(str(root),))
    try:
        (root / "escape").symlink_to(outside)
        (root / "planted" / "participants").mkdir(parents=True)
        (root / "planted" / "participants" / "resources").symlink_to(
            outside / "participants" / "resources"
        )
        (root / "deep" / "participants" / "resources").mkdir(parents=True)
        (root / "deep" / "participants" / "resources" / "double").symlink_to(
            outside / "participants" / "resources" / "double"
        )
        for directory in [
            "relative",
            "",
            str(root / ".." / "outside"),
            str(outside),
            str(root / "escape"),
            str(root) + "//x",
            str(root) + "/x/",
            str(root / "planted"),
            str(root / "deep"),
            str(root) + "/x\x00y",
        ]:
            error = await refused(
                h.client.restore("restore-1", h.deadline(), directory, list(STATES)),
                "INVALID_REQUEST",
                "INVALID_ARGUMENT",
            )
            assert error.metadata["field"] == "checkpoint_dir", directory
            await assert_untouched(h)
        before = sorted(
            p.name for p in (outside / "participants" / "resources" / "double").iterdir()
        )
        write_part(root / "good")
        reply = await h.client.restore("restore-2", h.deadline(), str(root / "good"), list(STATES))
        assert len(reply.restored) == 3
        after = sorted(
            p.name for p in (outside / "participants" / "resources" / "double").iterdir()
        )
        assert before == after
    finally:
        await stop_harness(h)


async def test_restore_of_a_100000_episode_scope_installs_only_what_is_stored(
    tmp_path: Path,
) -> None:
    write_part(tmp_path / "ckpt")
    scope = [EpisodeId(f"x{i}", i % 5) for i in range(100_000)] + [EpisodeId("r2", 1)]
    h = await start_harness()
    try:
        reply = await h.client.restore("restore-1", h.deadline(), str(tmp_path / "ckpt"), scope)
        assert list(reply.restored) == ["r2-a2"]
        assert h.participant.states == {EpisodeId("r2", 2): {"n": 2}}
    finally:
        await stop_harness(h)


def _rewrite(part: Path, records: bytes | None = None, **fields: Any) -> None:
    manifest_path = part / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    if records is not None:
        (part / manifest["records_file"]).write_bytes(records)
    manifest.update(fields)
    manifest_path.unlink()
    manifest_path.write_text(json.dumps(manifest, sort_keys=True, indent=2) + "\n")


def _records(part: Path) -> tuple[Path, bytes]:
    manifest = json.loads((part / "manifest.json").read_text())
    path = part / manifest["records_file"]
    return path, path.read_bytes()


def _consistent(part: Path, data: bytes, count: int | None = None) -> None:
    """Replace the records with `data` and make the manifest match it exactly."""
    path, _ = _records(part)
    path.unlink()
    digest = hashlib.sha256(data).hexdigest()
    (part / f"records-{digest}.jsonl").write_bytes(data)
    _rewrite(
        part,
        records_file=f"records-{digest}.jsonl",
        records_sha256=digest,
        bytes=len(data),
        record_count=data.count(b"\n") + (0 if data.endswith(b"\n") else 1)
        if count is None
        else count,
    )


def tamper_kind(part: Path, outside: Path) -> None:
    _rewrite(part, kind="agent")


def tamper_instance(part: Path, outside: Path) -> None:
    _rewrite(part, instance="other")


def tamper_count(part: Path, outside: Path) -> None:
    _rewrite(part, record_count=2)


def tamper_bytes(part: Path, outside: Path) -> None:
    _, data = _records(part)
    _rewrite(part, bytes=len(data) + 1)


def tamper_digest(part: Path, outside: Path) -> None:
    """The manifest's digest (and name) of other content: the file does not match it."""
    path, data = _records(part)
    digest = hashlib.sha256(data + b"x").hexdigest()
    path.rename(part / f"records-{digest}.jsonl")
    _rewrite(part, records_file=f"records-{digest}.jsonl", records_sha256=digest)


def tamper_digest_field_only(part: Path, outside: Path) -> None:
    _rewrite(part, records_sha256="0" * 64)


def tamper_truncated_last_line(part: Path, outside: Path) -> None:
    path, data = _records(part)
    path.write_bytes(data[:-7])


def tamper_truncated_last_line_consistently(part: Path, outside: Path) -> None:
    """Even with a manifest that matches the torn file, the torn line is refused."""
    _, data = _records(part)
    _consistent(part, data[:-7])


def tamper_wrong_kind_of_record(part: Path, outside: Path) -> None:
    _, data = _records(part)
    _consistent(
        part, data.replace(b'{"episode_id":{"rollout_id":"r1","attempt":0}', b'{"episode_id":"r1"')
    )


def tamper_records_name_with_path(part: Path, outside: Path) -> None:
    path, data = _records(part)
    digest = path.name[len("records-") : -len(".jsonl")]
    (outside / f"records-{digest}.jsonl").write_bytes(data)
    _rewrite(part, records_file=f"../../../../outside/records-{digest}.jsonl")


def tamper_records_absolute_path(part: Path, outside: Path) -> None:
    path, _ = _records(part)
    _rewrite(part, records_file=str(outside / path.name))


def tamper_records_symlink(part: Path, outside: Path) -> None:
    path, data = _records(part)
    (outside / path.name).write_bytes(data)
    path.unlink()
    path.symlink_to(outside / path.name)


def tamper_manifest_symlink(part: Path, outside: Path) -> None:
    manifest = part / "manifest.json"
    (outside / "manifest.json").write_bytes(manifest.read_bytes())
    manifest.unlink()
    manifest.symlink_to(outside / "manifest.json")


def tamper_manifest_not_json(part: Path, outside: Path) -> None:
    (part / "manifest.json").write_bytes(b'{"schema_version": 1, ')


def tamper_manifest_huge_count(part: Path, outside: Path) -> None:
    _rewrite(part, record_count=2**64, bytes=2**70)


def tamper_manifest_nan(part: Path, outside: Path) -> None:
    (part / "manifest.json").write_text(
        (part / "manifest.json").read_text().replace('"bytes": ', '"bytes": NaN, "x": ')
    )


def tamper_records_not_utf8(part: Path, outside: Path) -> None:
    _, data = _records(part)
    _consistent(part, data.replace(b'"n":3', b'"n":"\xff\xfe"'))


def tamper_records_nan(part: Path, outside: Path) -> None:
    _, data = _records(part)
    _consistent(part, data.replace(b'"n":3', b'"n":NaN'))


def tamper_records_deep_nesting(part: Path, outside: Path) -> None:
    _, data = _records(part)
    _consistent(part, data.replace(b'"n":3', b'"n":' + b"[" * 100_000 + b"]" * 100_000))


def tamper_manifest_deep_nesting(part: Path, outside: Path) -> None:
    (part / "manifest.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)


def tamper_duplicate_episode(part: Path, outside: Path) -> None:
    _, data = _records(part)
    lines = data.splitlines(keepends=True)
    _consistent(part, data + lines[0])


TAMPERS = [
    (tamper_kind, "FAILED_PRECONDITION"),
    (tamper_instance, "FAILED_PRECONDITION"),
    (tamper_count, "DATA_LOSS"),
    (tamper_bytes, "DATA_LOSS"),
    (tamper_digest, "DATA_LOSS"),
    (tamper_digest_field_only, "DATA_LOSS"),
    (tamper_truncated_last_line, "DATA_LOSS"),
    (tamper_truncated_last_line_consistently, "DATA_LOSS"),
    (tamper_wrong_kind_of_record, "DATA_LOSS"),
    (tamper_records_name_with_path, "DATA_LOSS"),
    (tamper_records_absolute_path, "DATA_LOSS"),
    (tamper_records_symlink, "DATA_LOSS"),
    (tamper_manifest_symlink, "DATA_LOSS"),
    (tamper_manifest_not_json, "DATA_LOSS"),
    (tamper_manifest_huge_count, "DATA_LOSS"),
    (tamper_manifest_nan, "DATA_LOSS"),
    (tamper_records_not_utf8, "DATA_LOSS"),
    (tamper_records_nan, "DATA_LOSS"),
    (tamper_records_deep_nesting, "DATA_LOSS"),
    (tamper_manifest_deep_nesting, "DATA_LOSS"),
    (tamper_duplicate_episode, "DATA_LOSS"),
]


@pytest.mark.parametrize(
    ("tamper", "code"), TAMPERS, ids=[t.__name__[len("tamper_") :] for t, _ in TAMPERS]
)
async def test_tampered_parts_are_typed_refusals_and_install_nothing(
    tmp_path: Path, tamper: Callable[[Path, Path], None], code: str
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    part = write_part(tmp_path / "ckpt")
    tamper(part, outside)
    h = await start_harness()
    try:
        await refused(
            h.client.restore("restore-1", h.deadline(), str(tmp_path / "ckpt"), list(STATES)),
            "INVALID_CHECKPOINT_STATE",
            code,
        )
        await assert_untouched(h)
        await restore_good_copy(h, tmp_path)
    finally:
        await stop_harness(h)


# -- instance names -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "instance", ["..", ".", "../x", "a/b", "/abs", "-x", "x" * 129, "a\x00b", "é", ""]
)
def test_path_tricks_in_instance_names_are_refused_at_startup(instance: str) -> None:
    """An instance name becomes a path component of every part: never anything but a name."""
    app = create_app(DoubleParticipant(instance))

    def install() -> None:
        settings = CheckpointSettings(enabled=True, token=TOKEN, instance=instance)
        install_checkpointing(app, DoubleParticipant(instance), settings)

    with pytest.raises(ValueError, match="instance"):
        install()
    with pytest.raises(ValueError, match="instance"):
        ControlPlane(DoubleParticipant(instance))


def test_the_prepare_stream_survives_a_client_that_disappears(servers: Servers) -> None:
    """A controller that drops a Prepare stream mid-way harms nothing (cancel is not abort)."""
    s = servers
    d = stamp(time.time() + 60)
    call = s.channel.unary_stream(PARTICIPANT + "Prepare")(
        pb.PrepareRequest(checkpoint_id="dropped-1", deadline=d).SerializeToString(),
        metadata=AUTH,
        timeout=10,
    )
    next(call)
    call.cancel()
    assert s.loop.run(_state(s.harness)) in ("PREPARED", "PREPARING")
    s.loop.run(_reset(s.harness))
    still_serving(s)


async def _state(h: Harness) -> str:
    return str(h.control.state)


async def test_a_planted_unparseable_manifest_refuses_the_commit(tmp_path: Path) -> None:
    """Someone planted a manifest.json the JSON parser cannot even read: the commit is refused
    as a different commit, typed, and the planted file stays as it was."""
    part = tmp_path / "ckpt" / "participants" / "resources" / "double"
    part.mkdir(parents=True)
    planted = b"[" * 100_000 + b"]" * 100_000
    (part / "manifest.json").write_bytes(planted)
    h = await start_harness()
    try:
        h.participant.seed(EpisodeId("r1"), {"n": 1})
        final = (await drain(h.client.prepare("c1", h.deadline())))[-1]
        assert final.state == types_pb2.PARTICIPANT_STATE_PREPARED
        error = await refused(
            h.client.commit("c1", h.deadline(), str(tmp_path / "ckpt")),
            "INVALID_CHECKPOINT_STATE",
            "FAILED_PRECONDITION",
        )
        assert "different commit" in error.message
        assert (part / "manifest.json").read_bytes() == planted
        assert sorted(os.listdir(part)) == ["manifest.json"]
    finally:
        await stop_harness(h)


async def test_a_record_at_the_highest_attempt_is_refused_by_restore_typed(tmp_path: Path) -> None:
    """Attempt 2^31-2 is the highest an episode may carry, so it has no next attempt to be
    restored as: the restore refuses it naming the episode (it used to fail inside the
    install hook, HOOK_FAILED / INTERNAL), and the fleet restore's cleanup, which retires
    the next attempts, does not trip over it either."""
    checkpoint_dir = tmp_path / "ckpt"
    top = EpisodeId("r9", MAX_ATTEMPT)
    lines = [
        json.dumps({"episode_id": e.to_json(), "state": {"n": 9}}, separators=(",", ":")).encode()
        for e in (EpisodeId("r8"), top)
    ]
    LocalStorage().write_part(str(checkpoint_dir), "resources", "double", "c1", lines, WriteFence())
    h = await start_harness()
    try:
        error = await refused(
            h.client.restore("restore-1", h.deadline(), str(checkpoint_dir), [top]),
            "INVALID_CHECKPOINT_STATE",
            "FAILED_PRECONDITION",
        )
        assert error.metadata["captureKey"] == top.capture_key
        await assert_untouched(h)
        async with await Fleet.discover(FleetSpec.from_addresses([h.grpc_address], TOKEN)) as fleet:
            with pytest.raises(FleetError) as caught:
                await fanout.restore(
                    fleet, "restore-2", h.deadline(), str(checkpoint_dir), [EpisodeId("r8"), top]
                )
        assert caught.value.reason == "PARTICIPANT_FAILED"
        await assert_untouched(h)
        # Out of scope, the record is harmless: the rest restores.
        reply = await h.client.restore(
            "restore-3", h.deadline(), str(checkpoint_dir), [EpisodeId("r8")]
        )
        assert list(reply.restored) == ["r8-a1"]
    finally:
        await stop_harness(h)


async def test_a_data_plane_body_nested_too_deep_is_a_400(tmp_path: Path) -> None:
    """Not only the control plane: a JSON body deeper than the parser goes is `invalid_json`
    (it used to escape as a RecursionError, a 500), and the server keeps serving."""
    from rollout_checkpoint.examples.counter import CounterServer
    from rollout_checkpoint.server.resources import ResourcesServerConfig

    app = CounterServer(ResourcesServerConfig(session_secret="s")).build_app()
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://counter") as client:
        deep = b"[" * 100_000 + b"]" * 100_000
        for route in ("/seed_session", "/increment_counter", "/verify"):
            response = await client.post(route, content=deep)
            assert response.status_code in (400, 422), (route, response.status_code)
            assert response.json()["error"]["code"] in ("invalid_json", "no_session")
        seeded = await client.post("/seed_session", json={"initial_count": 2})
        assert seeded.status_code == 200
        response = await client.post("/increment_counter", content=deep)
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
        assert (await client.post("/get_counter_value", json={})).json() == {"count": 2}
