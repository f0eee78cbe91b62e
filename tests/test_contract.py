"""The proto contract and its generated code: buf lint/format/breaking and gen/ freshness.

These run as tests (not only as steps of scripts/test) so a contract problem shows up in
the test report next to everything else. The tools are taken from the interpreter's own
bin/ (the venv scripts/test installs), never from PATH, so a stray system buf cannot
answer in their place.

The constants the protos name (constants.proto: health service names and the error domain,
as `wire_value` options) are the runtime's, and the servers answer exactly those names; the
`deadline` ErrorInfo metadata has the format errors.proto documents.
"""

from __future__ import annotations

import json
import os
import re
import sys
from decimal import Decimal
from pathlib import Path

import grpc
import pytest
from google.protobuf import timestamp_pb2
from google.rpc import error_details_pb2
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from rollout_checkpoint.client.coordinator import service as coordinator_service
from rollout_checkpoint.client.fleet import FleetSpec, MemberSpec
from rollout_checkpoint.server.core import errors
from rollout_checkpoint.server.runtime import health, servicer
from rollout_checkpoint.v1 import constants_pb2, coordinator_service_pb2, errors_pb2
from rollout_checkpoint.v1 import participant_service_pb2 as pb
from rollout_checkpoint.v1 import participant_service_pb2_grpc as pb_grpc

from .conftest import TOKEN, start_harness, stop_harness
from .processes import REPO, explain, run

BIN = Path(sys.executable).parent
BUF = BIN / "buf"
# The last released contract; rewritten only on purpose by scripts/refresh-baseline.
BASELINE = "protos/baseline/v1.binpb"


def test_buf_lint() -> None:
    # STANDARD + COMMENTS (buf.yaml): COMMENTS is what requires a leading comment on
    # every service, RPC, message, field, oneof, enum and enum value.
    proc = run(BUF, "lint")
    assert proc.returncode == 0, explain(proc)


def test_buf_lint_requires_leading_comments() -> None:
    # Guard for the test above: the "everything is documented" rule lives only in
    # buf.yaml, so make sure it is still switched on for our module.
    proc = run(
        BUF,
        "config",
        "ls-lint-rules",
        "--configured-only",
        "--module-path",
        "protos",
        "--format",
        "json",
    )
    assert proc.returncode == 0, explain(proc)
    rules = {json.loads(line)["id"] for line in proc.stdout.splitlines() if line.strip()}
    required = {
        "COMMENT_SERVICE",
        "COMMENT_RPC",
        "COMMENT_MESSAGE",
        "COMMENT_FIELD",
        "COMMENT_ONEOF",
        "COMMENT_ENUM",
        "COMMENT_ENUM_VALUE",
    }
    assert required <= rules, f"buf.yaml no longer enforces {sorted(required - rules)}"


def test_buf_format() -> None:
    proc = run(BUF, "format", "-d", "--exit-code")
    assert proc.returncode == 0, "protos are not buf-formatted (run `buf format -w`)\n" + explain(
        proc
    )


def test_buf_breaking_against_baseline() -> None:
    assert (REPO / BASELINE).is_file(), f"{BASELINE} is missing: run scripts/refresh-baseline"
    # `protos` alone: the vendored googleapis module is never breaking-checked.
    proc = run(BUF, "breaking", "protos", "--against", BASELINE)
    assert proc.returncode == 0, (
        "the contract breaks the released baseline; if that is intended, run "
        "scripts/refresh-baseline and commit it with the reason\n" + explain(proc)
    )


def generated(root: Path) -> dict[str, bytes]:
    """What scripts/generate writes under a gen/ folder, by relative path: the Python package,
    the Go module's *.pb.go and the npm package's src/gen. The hand-written parts of the
    packages beside them (helpers, go.mod, package.json, README, node_modules, dist) are not
    generated and not compared."""
    files = sorted(
        [p for p in (root / "rollout_checkpoint").rglob("*") if "__pycache__" not in p.parts]
        + list((root / "go" / "rollout_checkpoint" / "v1").glob("*.pb.go"))
        + list((root / "ts" / "src" / "gen").rglob("*"))
    )
    # __pycache__ appears in gen/ as soon as anything imports the generated modules.
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in files if p.is_file()}


def test_gen_is_fresh(tmp_path: Path) -> None:
    # PYTHON pins the generator to this interpreter, so the same grpcio-tools and
    # mypy-protobuf that the tests import are the ones that write the code.
    env = {**os.environ, "PYTHON": sys.executable}
    proc = run("bash", "scripts/generate", tmp_path, env=env)
    assert proc.returncode == 0, explain(proc)
    fresh = generated(tmp_path)
    committed = generated(REPO / "gen")
    for language in ("rollout_checkpoint/", "go/", "ts/"):
        assert any(name.startswith(language) for name in fresh), f"no {language} generated"
    stale = sorted(
        set(fresh) ^ set(committed)
        | {name for name in fresh.keys() & committed.keys() if fresh[name] != committed[name]}
    )
    assert not stale, "gen/ is stale: run scripts/generate and commit. Differs: " + ", ".join(stale)


# -- named constants ------------------------------------------------------------------------


def wire_values(enum: object) -> dict[str, str]:
    """Every value of a constants enum but UNSPECIFIED -> its `wire_value` option."""
    descriptor = enum.DESCRIPTOR  # type: ignore[attr-defined]
    values = {}
    for value in descriptor.values:
        options = value.GetOptions()
        if value.number == 0:
            assert not options.HasExtension(constants_pb2.wire_value), value.name
            continue
        assert options.HasExtension(constants_pb2.wire_value), value.name
        values[value.name] = options.Extensions[constants_pb2.wire_value]
    return values


HEALTH = wire_values(constants_pb2.HealthServiceName)
PARTICIPANT_HEALTH = {
    v for k, v in HEALTH.items() if k == "HEALTH_SERVICE_NAME_SERVER" or "_PARTICIPANT_" in k
}
COORDINATOR_HEALTH = {
    v for k, v in HEALTH.items() if k == "HEALTH_SERVICE_NAME_SERVER" or "_COORDINATOR_" in k
}


def test_the_protos_name_the_runtime_constants() -> None:
    assert HEALTH == {
        "HEALTH_SERVICE_NAME_SERVER": "",
        "HEALTH_SERVICE_NAME_PARTICIPANT_SERVICE": servicer.SERVICE_NAME,
        "HEALTH_SERVICE_NAME_PARTICIPANT_LIVENESS": health.LIVENESS,
        "HEALTH_SERVICE_NAME_PARTICIPANT_READINESS": health.READINESS,
        "HEALTH_SERVICE_NAME_COORDINATOR_SERVICE": coordinator_service.SERVICE_NAME,
    }
    # The service names are the services' own full names in the contract.
    assert pb.DESCRIPTOR.services_by_name["ParticipantService"].full_name == servicer.SERVICE_NAME
    coordinator = coordinator_service_pb2.DESCRIPTOR.services_by_name["CoordinatorService"]
    assert coordinator.full_name == coordinator_service.SERVICE_NAME
    assert wire_values(errors_pb2.ErrorDomain) == {
        "ERROR_DOMAIN_ROLLOUT_CHECKPOINT": errors.ERROR_DOMAIN,
    }
    assert errors.ERROR_DOMAIN == "rollout-checkpoint.dev"  # one source, both sides


async def listed_health(address: str) -> set[str]:
    async with aio.insecure_channel(address) as channel:
        listed = await health_pb2_grpc.HealthStub(channel).List(
            health_pb2.HealthListRequest(), timeout=10
        )
        return set(listed.statuses)


async def test_the_servers_answer_exactly_the_documented_health_names() -> None:
    h = await start_harness()
    try:
        assert await listed_health(h.grpc_address) == PARTICIPANT_HEALTH
    finally:
        await stop_harness(h)
    spec = FleetSpec(members=(MemberSpec("counter", "127.0.0.1:9"),), token=TOKEN)
    server = coordinator_service.Coordinator(spec, "127.0.0.1:0")
    await server.start()
    try:
        assert await listed_health(f"127.0.0.1:{server.port}") == COORDINATOR_HEALTH
    finally:
        await server.stop()


# -- the deadline metadata ------------------------------------------------------------------


async def test_a_deadline_refusal_carries_the_documented_deadline_format() -> None:
    h = await start_harness()
    try:
        seconds = int(h.clock.now()) - 10
        for nanos in (250_000_000, 0, 123_456_789, 1_500):
            deadline = timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos)
            async with aio.insecure_channel(h.grpc_address) as channel:
                stub = pb_grpc.ParticipantServiceStub(channel)
                with pytest.raises(aio.AioRpcError) as caught:
                    await stub.Renew(
                        pb.RenewRequest(checkpoint_id="ck-deadline", deadline=deadline),
                        metadata=(("authorization", f"Bearer {TOKEN}"),),
                        timeout=10,
                    )
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            status = rpc_status.from_call(caught.value)
            assert status is not None
            (detail,) = [d for d in status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            assert (
                info.domain
                == wire_values(errors_pb2.ErrorDomain)["ERROR_DOMAIN_ROLLOUT_CHECKPOINT"]
            )
            assert info.reason == "CHECKPOINT_DEADLINE_EXCEEDED"
            # errors.proto: seconds since the epoch, plain decimal, exactly six decimals.
            assert re.fullmatch(r"[0-9]+\.[0-9]{6}", info.metadata["deadline"]), info.metadata
            text = info.metadata["deadline"]
            assert text == f"{seconds + nanos / 1e9:.6f}"  # by way of a double
            exact = Decimal(seconds) + Decimal(nanos) / 10**9
            assert abs(Decimal(text) - exact) <= Decimal("0.000001"), (text, exact)
            if nanos == 250_000_000:
                assert text == f"{seconds}.250000"
    finally:
        await stop_harness(h)
