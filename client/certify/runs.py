"""What a baseline and a trial share: the collector's command line, and reading back what a
run left behind into a `RunObservation`.

Everything here reads what a user could read themselves: the collector's output file, its
dispatch log and published checkpoints, the members' logs, the policy model's replay
statistics, and a scoped checkpoint certify takes of the fleet after the run into a private
root (the sessions' exported state, written by the user's own export hooks).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import re
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import httpx

from rollout_checkpoint.client.certify.fleet_processes import FleetProcesses, http_url
from rollout_checkpoint.client.certify.member_logs import untyped_in_log
from rollout_checkpoint.client.certify.observations import RunObservation
from rollout_checkpoint.client.certify.setup import CertifySetup
from rollout_checkpoint.client.checkpointing.checkpoint import checkpoint
from rollout_checkpoint.client.checkpointing.publication import (
    PublicationRoot,
    open_checkpoint_root,
    store_call,
)
from rollout_checkpoint.client.cli.console import ExitCode
from rollout_checkpoint.client.collect.inputs import load_input, rollout_id_of
from rollout_checkpoint.client.collect.receipts import ENTRY_KINDS, serves_no_outbox
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import Fleet, FleetSpec
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.keep_alive import client_limits
from rollout_checkpoint.server.core.part_storage import LocalStorage

Mode = Literal["record", "replay"]
RUN_SECONDS = 600.0
"""The bound of one collector run: far beyond what a certify run of a few dozen rollouts
takes, so hitting it means the run hangs (killed, reported), not that it is slow."""
EXPORT_SECONDS = 60.0
"""The deadline of certify's own scoped checkpoint after a run."""
STATS_SECONDS = 10.0
DISPATCH_LOG = "dispatched.jsonl"
"""The collector's dispatch log, in its checkpoint directory."""
MISS_LOGGED = re.compile(
    r"not_in_recording rollout_id=(?P<rollout>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\") "
    r"digest=(?P<digest>\S+) path=(?P<path>\S+)"
)
"""The policy model's warning for a call its recording does not hold (recording.py): the
rollout id is logged as a Python string literal (`%r`), so any id reads back exactly."""


class RunFailed(Exception):
    """A run that must succeed did not (a baseline's collector did not exit 0): nothing can be
    compared with it. The message carries the collector's last notes."""


def model_args(setup: CertifySetup, mode: Mode, recording: Path) -> dict[str, list[str]]:
    """The policy model's extra argv: `--record FILE`, or `--replay FILE --replay-latency S`
    (a replay that answers at once leaves no rollout in flight for a fault to meet)."""
    model = setup.model_member
    if model is None:
        return {}
    if mode == "record":
        return {model: ["--record", str(recording)]}
    return {model: ["--replay", str(recording), "--replay-latency", str(setup.model_latency)]}


def collect_args(
    setup: CertifySetup,
    directory: Path,
    *,
    fleet: Path | None = None,
    concurrency: int,
    checkpoint_every: float | None,
    extra: Sequence[str] = (),
) -> list[str]:
    """`collect`'s flags for a run whose files live in `directory` (`rollouts.jsonl`,
    `checkpoints/`); `fleet` replaces the user's fleet file (a derived one)."""
    every = ["--checkpoint-every", str(checkpoint_every)] if checkpoint_every else []
    return [
        "--fleet",
        str(fleet or setup.fleet_path),
        "--entry-url",
        setup.entry_url,
        "--input",
        str(setup.tasks),
        "--output",
        str(directory / "rollouts.jsonl"),
        "--checkpoint-dir",
        str(directory / "checkpoints"),
        "--num-repeats",
        str(setup.num_repeats),
        "--concurrency",
        str(concurrency),
        "--checkpoint-timeout",
        str(setup.checkpoint_timeout),
        *every,
        *extra,
        "--json",
    ]


async def new_observation(setup: CertifySetup, label: str) -> RunObservation:
    """An observation with the run's expected rollouts and their tasks, read as `collect`
    reads its input (so both agree on every rollout id)."""
    rows, _ = await asyncio.to_thread(load_input, setup.tasks, setup.num_repeats)
    expected, tasks = [], {}
    for row in rows:
        for repeat in range(setup.num_repeats):
            rollout_id = rollout_id_of(row.task_id, repeat)
            expected.append(rollout_id)
            tasks[rollout_id] = row.row
    return RunObservation(label=label, expected=expected, tasks=tasks)


async def read_rows(output: Path) -> list[dict[str, Any]]:
    """Every whole JSON line of the collector's output, in file order (none: no file)."""

    def read() -> list[dict[str, Any]]:
        if not output.exists():
            return []
        rows = []
        for line in output.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a torn last line of a killed collector: the collector cuts it too
            if isinstance(row, dict):
                rows.append(row)
        return rows

    return await asyncio.to_thread(read)


async def collect_exports(
    setup: CertifySetup, rows: Iterable[dict[str, Any]], root_directory: Path
) -> dict[str, dict[str, Any]]:
    """Every resources member's exported session state of every finished rollout: certify's
    own checkpoint of the fleet, scoped to the final episode of each `ok` row, into a private
    root, read back from its parts. Sessions that ended (at their `/verify`) are exported too,
    since every member runs with `ROLLOUT_CHECKPOINT_EXPORT_ENDED_SESSIONS` (`fleet_processes`);
    one whose server freed its state when it ended (prompt_injection's verify) is not here."""
    scope = [
        EpisodeId(row["rollout_id"], int(row["attempt"]))
        for row in rows
        if row.get("status") == "ok"
    ]
    members = set(setup.resources_members)
    if not scope or not members:
        return {}
    root = await asyncio.to_thread(open_checkpoint_root, root_directory)
    fleet = await Fleet.discover(setup.spec)
    try:
        published = None
        async for event in checkpoint(
            fleet, root, time.time() + EXPORT_SECONDS, scope=scope, keep=1
        ):
            if event.final and event.outcome is not None:
                published = event.outcome.published
        if published is None:
            raise RunFailed("certify's own checkpoint of the sessions after the run failed")
        instances = {m.name: (m.kind_name, m.instance) for m in fleet.members}
    finally:
        await fleet.close()
    directory = Path(str(root.directory(published.checkpoint_id)))
    return await asyncio.to_thread(_read_exports, directory, instances, members)


async def held_after(spec: FleetSpec) -> dict[str, int]:
    """Entry member -> the results it still holds under receipts (ListResults), for the
    members holding any. A member that serves no outbox (an older server) holds none."""
    fleet = await Fleet.discover(spec)
    try:
        held: dict[str, int] = {}
        for member in fleet.members:
            if member.kind not in ENTRY_KINDS:
                continue
            try:
                count = (await member.client.list_results()).held
            except ControlError as error:
                if serves_no_outbox(error):
                    continue
                raise
            if count:
                held[member.name] = count
        return held
    finally:
        await fleet.close()


def _read_exports(
    directory: Path, instances: dict[str, tuple[str, str]], members: set[str]
) -> dict[str, dict[str, Any]]:
    """Each member's exported state per rollout, read with the runtime's own reader
    (`LocalStorage.read_part`): a member that checkpoints incrementally writes reference lines
    for sessions unchanged since its last part, and only that reader resolves them (verified
    by digest) into the records a restore would install. Read raw, a reference line would be
    taken for a record (it has no episode or state)."""
    exports: dict[str, dict[str, Any]] = {}
    storage = LocalStorage()
    for name in sorted(members):
        kind, instance = instances[name]
        _, records = storage.read_part(str(directory), kind, instance, lambda _record: True)
        states: dict[str, list[Any]] = {}
        for record in records:
            states.setdefault(record["episode_id"]["rollout_id"], []).append(record["state"])
        if states:
            exports[name] = {
                rollout: found[0] if len(found) == 1 else _canonical_order(found)
                for rollout, found in states.items()
            }
    return exports


def _canonical_order(states: list[Any]) -> list[Any]:
    """Several sessions of one rollout, in an order that does not depend on their ids (which
    are random per run)."""
    return sorted(states, key=lambda s: json.dumps(s, sort_keys=True))


async def model_misses(setup: CertifySetup, processes: FleetProcesses) -> list[tuple[str, str]]:
    """(rollout id, path) of every call the replaying policy model did not find recorded, once
    per call: from its `GET /recording/stats` and from the `not_in_recording` warnings in the
    logs of every process that served as the model (a model killed by the trial took its
    counts with it; its log kept them)."""
    model = setup.model_member
    member = next((m for m in setup.spec.members if m.name == model), None)
    if model is None or member is None:
        return []
    misses: dict[tuple[str, str], str] = {}
    url = http_url(member)
    if url is not None:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            async with httpx.AsyncClient(timeout=STATS_SECONDS, limits=client_limits()) as http:
                reply = await http.get(f"{url}/recording/stats")
                reply.raise_for_status()
                for miss in reply.json().get("misses", []):
                    key = (str(miss["rollout_id"]), str(miss["digest"]))
                    misses[key] = str(miss["path"])

    def logged() -> None:
        for path in processes.logs_of(model):
            if path.exists():
                for found in MISS_LOGGED.finditer(path.read_text(errors="replace")):
                    rollout_id = ast.literal_eval(found["rollout"])
                    misses.setdefault((rollout_id, found["digest"]), found["path"])

    await asyncio.to_thread(logged)
    return [(rollout_id, path) for (rollout_id, _), path in misses.items()]


async def untyped_failures(
    processes: FleetProcesses, controller_logs: Iterable[Path], exit_codes: Iterable[int]
) -> list[str]:
    """Failures without a reason of the contract: an exit code the CLI's table does not have,
    and every member (or controller) log line showing an INTERNAL status or a traceback that
    escaped the code that raised it (`member_logs.untyped_in_log`)."""
    known = {int(code) for code in ExitCode}
    found = [f"collect: exit code {code}" for code in exit_codes if code not in known]
    logs = [(name, path) for name in processes.members for path in processes.logs_of(name)]
    logs += [("collect", path) for path in controller_logs]

    def scan() -> list[str]:
        return [line for name, path in logs for line in untyped_in_log(name, path)]

    return found + await asyncio.to_thread(scan)


async def dispatched_attempts(checkpoint_dir: Path) -> dict[str, list[int]]:
    """Rollout id -> every attempt the collector's dispatch log says it sent, in order."""

    def read() -> dict[str, list[int]]:
        path = checkpoint_dir / DISPATCH_LOG
        attempts: dict[str, list[int]] = {}
        if not path.exists():
            return attempts
        for line in path.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and "rollout_id" in entry:
                attempts.setdefault(entry["rollout_id"], []).append(int(entry["attempt"]))
        return attempts

    return await asyncio.to_thread(read)


async def published_ids(root: PublicationRoot) -> list[str]:
    """The ids of the checkpoints published under `root`, oldest first."""
    return await store_call(time.time() + EXPORT_SECONDS, root.location, root.published)
