"""`status` (every member's state, admission, readiness and lease) and `health` (a
sidecar's grpc.health.v1 answers, no token needed).

Both ask the standard health service, so `ready` means what a load balancer sees; a member
that cannot be asked is a row saying why, never a missing row."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2
from rich.table import Table

from rollout_checkpoint.client.cli.console import PROG, ExitCode, make_console
from rollout_checkpoint.client.cli.errors import control_error
from rollout_checkpoint.client.cli.names import state_name
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import KIND_NAMES, FleetSpec, MemberSpec
from rollout_checkpoint.client.participant import (
    LIVENESS_HEALTH,
    READINESS_HEALTH,
    SERVER_HEALTH,
)
from rollout_checkpoint.server.core.errors import Reason
from rollout_checkpoint.v1 import participant_service_pb2 as pb

HEALTH_TIMEOUT_SECONDS = 5.0
HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"


async def _health_status(
    address: str, service: str, credentials: grpc.ChannelCredentials | None
) -> str:
    """One grpc.health.v1 Check: `SERVING`, `NOT_SERVING`, `SERVICE_UNKNOWN`, or raises."""
    options = [("grpc.enable_retries", 0)]
    channel = (
        aio.insecure_channel(address, options=options)
        if credentials is None
        else aio.secure_channel(address, credentials, options=options)
    )
    async with channel:
        try:
            check = channel.unary_unary(
                HEALTH_CHECK_METHOD,
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString,
            )
            reply: health_pb2.HealthCheckResponse = await check(
                health_pb2.HealthCheckRequest(service=service), timeout=HEALTH_TIMEOUT_SECONDS
            )
        except aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            raise ControlError.from_rpc_error(error) from None
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


async def _member_row(spec: FleetSpec, member: MemberSpec) -> dict[str, Any]:
    """One member's status row; a member that cannot be asked is a row saying why."""
    row: dict[str, Any] = {"name": member.name, "address": member.address}
    credentials = spec.credentials()
    async with spec.client(
        member, timeout=HEALTH_TIMEOUT_SECONDS, credentials=credentials
    ) as client:
        try:
            described, status = await asyncio.gather(client.get_participant(), client.get_status())
            readiness = await _health_status(member.address, READINESS_HEALTH, credentials)
        except ControlError as error:
            row["error"] = control_error(error).message
            row["reachable"] = error.decided_by_server
            row["state"] = "refused" if error.decided_by_server else "unreachable"
            return row
    row.update(
        {
            "reachable": True,
            "kind": KIND_NAMES.get(described.kind, "?"),
            "instance": described.instance,
            "state": state_name(status.state, "?"),
            "checkpoint_id": status.checkpoint_id,
            "admission_open": status.admission_open,
            "ready": readiness == "SERVING",
            "readiness_health": readiness,
            "prepare_ready": status.readiness.ready,
            "blockers": status.readiness.blocker_count,
            "counts": dict(status.readiness.counts),
            "retired_rollouts": status.retired_rollouts,
            "restored_pending": status.restored_pending,
            "lease_expires_at": status.lease_expires_at.ToJsonString()
            if status.HasField("lease_expires_at")
            else None,
            "last_part": _last_part(status.last_part) if status.HasField("last_part") else None,
        }
    )
    return row


def _last_part(part: pb.PublishedPart) -> dict[str, Any]:
    """The last part the member published: what it wrote, what it references in earlier
    parts, and how many parts a restore of it reads."""
    return {
        "checkpoint_id": part.checkpoint_id,
        "checkpoint_dir": part.checkpoint_dir,
        "asynchronous": part.asynchronous,
        "record_count": part.record_count,
        "records_written": part.records_written,
        "records_referenced": part.records_referenced,
        "chain_length": part.chain_length,
        "bytes": part.bytes,
    }


def _last_part_cell(part: dict[str, Any] | None) -> str:
    """Records written of the part's records, and its chain length, in a cell narrow
    enough that a fleet's table still fits a terminal (a wide cell squeezes the name and
    readiness columns to nothing); the id and the rest are in `--json`."""
    if part is None:
        return "-"
    return f"{part['records_written']}/{part['record_count']} new, chain {part['chain_length']}"


async def status_verb(args: argparse.Namespace, spec: FleetSpec) -> int:
    """Print every member's row (a table, or one JSON object); 0, or 5 when a member is
    unreachable (4 when one refused), with every row shown either way."""
    rows = await asyncio.gather(*(_member_row(spec, m) for m in spec.members))
    failed = [row for row in rows if "error" in row]
    code = ExitCode.OK
    if failed:
        code = (
            ExitCode.UNREACHABLE
            if any(not row["reachable"] for row in failed)
            else ExitCode.REFUSED
        )
    if args.json:
        payload: dict[str, Any] = {"members": rows}
        if failed:
            payload["error"] = {
                "reason": Reason.PARTICIPANT_UNREACHABLE
                if code == ExitCode.UNREACHABLE
                else Reason.PARTICIPANT_FAILED,
                "message": "; ".join(f"{row['name']}: {row['error']}" for row in failed),
                "exit_code": int(code),
            }
        print(json.dumps(payload, sort_keys=True), flush=True)
    else:
        _print_status_table(rows)
        for row in failed:
            print(f"{PROG}: {row['name']} ({row['address']}): {row['error']}", file=sys.stderr)
    return code


def _print_status_table(rows: Sequence[dict[str, Any]]) -> None:
    table = Table(title="fleet status")
    columns = ("name", "kind", "instance", "state", "checkpoint", "admission", "ready")
    for column in (*columns, "blockers", "lease expires", "counts", "last part"):
        table.add_column(column, no_wrap=True)
    for row in rows:
        if "error" in row:
            table.add_row(
                row["name"], "-", "-", row["state"], "-", "-", "-", "-", "-", row["address"], "-"
            )
            continue
        counts = " ".join(f"{k}={v}" for k, v in sorted(row["counts"].items()))
        table.add_row(
            row["name"],
            row["kind"],
            row["instance"],
            row["state"],
            row["checkpoint_id"] or "-",
            "open" if row["admission_open"] else "closed",
            "yes" if row["ready"] else "no",
            str(row["blockers"]),
            row["lease_expires_at"] or "-",
            counts,
            _last_part_cell(row["last_part"]),
        )
    make_console().print(table)


async def health_verb(args: argparse.Namespace) -> int:
    """Ask the sidecar's health names (retrying an unreachable one for `--wait` seconds);
    0 when every one is SERVING, 4 otherwise; `ControlError` when it cannot be asked."""
    services = args.service or [READINESS_HEALTH, LIVENESS_HEALTH, SERVER_HEALTH]
    credentials = (
        grpc.ssl_channel_credentials(args.tls_ca_file.read_bytes())
        if args.tls_ca_file is not None
        else None
    )
    give_up = time.monotonic() + args.wait
    while True:
        try:
            answers = {s: await _health_status(args.address, s, credentials) for s in services}
            break
        except ControlError as error:
            if error.decided_by_server or time.monotonic() >= give_up:
                raise
            await asyncio.sleep(0.1)
    if args.json:
        print(json.dumps({"address": args.address, "services": answers}, sort_keys=True))
    else:
        for service, answer in answers.items():
            print(f"{service or '(server)'}: {answer}")
    return ExitCode.OK if set(answers.values()) == {"SERVING"} else ExitCode.REFUSED
