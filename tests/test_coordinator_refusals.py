"""Coordinator refusals: every refusing member named, metadata keys within google.rpc's rule.

`ErrorInfo.metadata` keys must match `[a-z][a-zA-Z0-9-_]+` (errors.proto promises
lowerCamelCase), which a controller in another language may enforce; and a fleet refusal
must name every member that refused, not only the fastest, so a controller can act on all
of them at once.
"""

from __future__ import annotations

import ast
import contextlib
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc import aio

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.checkpointing.fanout import FleetError
from rollout_checkpoint.client.coordinator.calls import fleet_metadata, status_of
from rollout_checkpoint.client.coordinator.service import Coordinator
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import Fleet, FleetSpec, MemberSpec
from rollout_checkpoint.client.participant import timestamp
from rollout_checkpoint.server.core import errors as server_errors
from rollout_checkpoint.server.core.clock import SystemClock
from rollout_checkpoint.server.core.part_storage import _storage_error
from rollout_checkpoint.server.core.rpc.status import STATUS_DETAILS_KEY, to_status_proto
from rollout_checkpoint.server.runtime.participant import Kind
from rollout_checkpoint.server.runtime.refusals import conflict, hook_failed, stale
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb
from rollout_checkpoint.v1 import coordinator_service_pb2_grpc as cpb_grpc

from .conftest import TOKEN, Harness, start_harness, stop_harness
from .double import DoubleParticipant

KEY_RULE = r"[a-z][a-zA-Z0-9-_]+"
REPO = Path(__file__).resolve().parent.parent
AUTH = (("authorization", f"Bearer {TOKEN}"),)


def assert_keys_follow_the_rule(status: status_pb2.Status) -> None:
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            for key in info.metadata:
                assert re.fullmatch(KEY_RULE, key) and len(key) <= 64, key


# -- the metadata builders ------------------------------------------------------------------


def member_error(reason: str | None, **metadata: str) -> ControlError:
    code = grpc.StatusCode.ABORTED if reason is not None else grpc.StatusCode.UNAVAILABLE
    return ControlError(code, "refused", reason, "rollout-checkpoint.dev", metadata)


def test_one_refusing_member_forwards_its_metadata_under_member_keys() -> None:
    error = FleetError(
        "prepare",
        {
            "env": member_error(
                "CHECKPOINT_CONFLICT",
                checkpointId="c1",
                activeCheckpointId="other",
                **{"bad.key": "dropped", "with space": "dropped"},
            )
        },
    )
    assert fleet_metadata(error) == {
        "failedMembers": "env=CHECKPOINT_CONFLICT",
        "operation": "prepare",
        "memberCheckpointId": "c1",
        "memberActiveCheckpointId": "other",
    }
    assert_keys_follow_the_rule(status_of(error))


def test_several_failed_members_are_all_named_with_their_reasons() -> None:
    error = FleetError(
        "commit",
        {
            "b": member_error("STORAGE_FAILED", path="/x", errno="ENOSPC"),
            "a": member_error("INVALID_REQUEST", field="checkpoint_dir"),
            "c": member_error(None),
        },
    )
    assert fleet_metadata(error) == {
        "failedMembers": "a=INVALID_REQUEST,b=STORAGE_FAILED,c=UNREACHABLE",
        "operation": "commit",
    }
    assert_keys_follow_the_rule(status_of(error))


def test_every_status_the_coordinator_builds_follows_the_key_rule() -> None:
    statuses = [
        status_of(server_errors.invalid_request("scope", "x")),
        status_of(member_error("STALE_CHECKPOINT", checkpointId="c1", **{"Bad Key": "v"})),
        status_of(member_error(None)),
        status_of(FleetError("discover", {"m": member_error(None)})),
        status_of(RuntimeError("a bug")),
    ]
    for status in statuses:
        assert_keys_follow_the_rule(status)


def test_every_status_a_participant_builds_follows_the_key_rule() -> None:
    made = [
        server_errors.invalid_request("checkpoint_dir", "x"),
        server_errors.invalid_phase("IDLE", "commit", "x"),
        server_errors.deadline_exceeded("x", 1.0),
        server_errors.corrupt_checkpoint("x", "/p", "r-a1"),
        server_errors.rejected_checkpoint("x", "/p", "r"),
        stale("c1"),
        conflict("c1", "c0", "x"),
        hook_failed("export", RuntimeError("x")),
        _storage_error(OSError(28, "No space left on device"), "/p"),
    ]
    for error in made:
        assert_keys_follow_the_rule(to_status_proto(error))


def _metadata_keys(tree: ast.AST) -> Iterator[tuple[int, ast.expr]]:
    """Every key expression written into something called `metadata` in this source."""

    def named_metadata(node: ast.expr) -> bool:
        return (isinstance(node, ast.Name) and node.id == "metadata") or (
            isinstance(node, ast.Attribute) and node.attr == "metadata"
        )

    def dict_keys(node: ast.expr) -> Iterator[ast.expr]:
        if isinstance(node, ast.Dict):
            yield from (k for k in node.keys if k is not None)
        elif isinstance(node, ast.DictComp):
            yield node.key

    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "metadata":
            yield from ((node.lineno, k) for k in dict_keys(node.value))
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if named_metadata(target) and node.value is not None:
                    yield from ((node.lineno, k) for k in dict_keys(node.value))
                if isinstance(target, ast.Subscript) and named_metadata(target.value):
                    yield node.lineno, target.slice
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("setdefault", "update")
            and named_metadata(node.func.value)
            and node.args
        ):
            if node.func.attr == "setdefault":
                yield node.lineno, node.args[0]
            else:
                yield from ((node.lineno, k) for k in dict_keys(node.args[0]))


def test_every_metadata_key_written_in_the_sources_follows_the_rule() -> None:
    """A static sweep: each literal key is valid; a computed key must go through the
    coordinator's `fleet_metadata` (which checks it) rather than be formatted in place."""
    problems = []
    for folder in ("server", "client", "examples"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for line, key in _metadata_keys(ast.parse(path.read_text())):
                where = f"{path.relative_to(REPO)}:{line}"
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    if not re.fullmatch(KEY_RULE, key.value):
                        problems.append(f"{where}: {key.value!r}")
                elif isinstance(key, ast.JoinedStr):
                    problems.append(f"{where}: a formatted key")
    assert problems == []


# -- a fleet where two of four members refuse Prepare ---------------------------------------


@contextlib.asynccontextmanager
async def environments(count: int) -> AsyncIterator[dict[str, Harness]]:
    """`count` environment doubles (one stage, so Prepare reaches all of them at once), on
    the real clock: the coordinator's deadlines are real ones."""
    harnesses: dict[str, Harness] = {}
    try:
        for i in range(count):
            name = f"env-{i}"
            harnesses[name] = await start_harness(
                participant=DoubleParticipant(name, Kind.ENVIRONMENT),
                clock=SystemClock(),  # type: ignore[arg-type]
            )
        yield harnesses
    finally:
        for harness in harnesses.values():
            await stop_harness(harness)


async def hold_conflict_and_stale(h: dict[str, Harness], deadline: float) -> None:
    """env-1 holds another active checkpoint; env-3 already resumed `c1` (fenced for good)."""
    await h["env-1"].client.prepare_until_final("other", deadline)
    await h["env-3"].client.prepare_until_final("c1", deadline)
    await h["env-3"].client.resume("c1", deadline)


def spec_of(h: dict[str, Harness]) -> FleetSpec:
    return FleetSpec(
        members=tuple(MemberSpec(name, x.grpc_address) for name, x in h.items()), token=TOKEN
    )


async def test_the_fleet_library_names_every_member_that_refused_prepare() -> None:
    async with environments(4) as h:
        deadline = time.time() + 60
        await hold_conflict_and_stale(h, deadline)
        async with await Fleet.discover(spec_of(h)) as fleet:
            with pytest.raises(FleetError) as caught:
                async for _ in fanout.prepare(fleet, "c1", deadline):
                    pass
        failures = caught.value.failures
        assert {name: e.reason for name, e in failures.items()} == {
            "env-1": "CHECKPOINT_CONFLICT",
            "env-3": "STALE_CHECKPOINT",
        }


async def test_the_coordinator_names_both_members_that_refused_prepare() -> None:
    async with environments(4) as h:
        deadline = time.time() + 60
        await hold_conflict_and_stale(h, deadline)
        coordinator = Coordinator(spec_of(h), "127.0.0.1:0")
        await coordinator.start()
        try:
            async with aio.insecure_channel(f"127.0.0.1:{coordinator.port}") as channel:
                stub = cpb_grpc.CoordinatorServiceStub(channel)
                request = cpb.CoordinatorServicePrepareRequest(
                    checkpoint_id="c1", deadline=timestamp(deadline)
                )
                with pytest.raises(aio.AioRpcError) as caught:
                    async for _ in stub.Prepare(request, metadata=AUTH, timeout=30):
                        pass
        finally:
            await coordinator.stop()
    error = ControlError.from_rpc_error(caught.value)
    assert error.reason == "PARTICIPANT_FAILED"
    assert error.code == grpc.StatusCode.ABORTED
    assert error.metadata["failedMembers"] == "env-1=CHECKPOINT_CONFLICT,env-3=STALE_CHECKPOINT"
    assert error.metadata["operation"] == "prepare"
    for key, value in caught.value.trailing_metadata() or ():
        if key == STATUS_DETAILS_KEY and isinstance(value, bytes):
            assert_keys_follow_the_rule(status_pb2.Status.FromString(value))
