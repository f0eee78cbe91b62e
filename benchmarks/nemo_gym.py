"""Benchmark 8: prepare, commit and restore on NeMo Gym's own IPI server (nemo-gym from PyPI).

`rollout-checkpoint serve nemo-gym:indirect_prompt_injection` runs from an env that sees the
cached nemo-gym env (`scripts/nemo-gym-env`) with this tree installed beside it
(`tests/nemo_gym/beside.py`, a few seconds). It holds N sessions mid-episode, each seeded over
HTTP with the first row of the package's own `data/example.jsonl` (the healthcare environment)
and then two tool calls with its cookie (a record read, a chart update that changes the
environment), as a NeMo Gym agent makes them. Measured at the controller
(`ParticipantClient`), per N:

* prepare: the Prepare call -> its final PREPARED message (nothing in flight);
* commit: the Commit call -> its reply (export through the shipped `EnvironmentStates` hook,
  serialize, write, fsync, hash, publish the part's manifest), then an untimed Resume;
* restore: into a fresh replacement started closed (`--start-closed`), as after a crash: the
  Restore call -> its reply (read, verify, parse, validate every state, install into
  `session_id_to_env`).

Without the cached nemo-gym env this benchmark measures nothing and says why (it never builds
the env: minutes and 1.4 GB). The sessions grow on one server from one N to the next; each
restore gets its own fresh process.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.server.core.episodes import EpisodeId
from tests.nemo_gym.beside import BesideError, install_beside, purelib, ready_env

from .common import BenchResult, Server, deadline_in, ms, now
from .fleetutil import seed_sessions
from .httpraw import Connection, json_body

TIMEOUT = 120.0
SERVER = "nemo-gym:indirect_prompt_injection"
EXAMPLES = "resources_servers/indirect_prompt_injection/data/example.jsonl"
# Two calls of an agent mid-episode: a read, and a write that changes the environment.
PATIENT = "P001"


def rollout(index: int) -> str:
    return f"ng{index:05d}"


def example_environment(nemo_python: Path) -> dict[str, Any]:
    """The environment of the first row of the package's own example data."""
    row = json.loads((purelib(nemo_python) / EXAMPLES).read_text().splitlines()[0])
    environment: dict[str, Any] = row["environment"]
    return environment


async def mid_episode(address: str, cookies: dict[int, str], indices: range) -> None:
    """Each session's two tool calls with its own cookie, `16` connections at a time."""
    queue = list(reversed(indices))

    async def work() -> None:
        connection = await Connection.open(address)
        try:
            while queue:
                index = queue.pop()
                prefix = f"/ng-rollout/{rollout(index)}-a1"
                for tool, arguments in (
                    ("get_patient_record", {"patient_id": PATIENT}),
                    ("update_patient_chart", {"patient_id": PATIENT, "notes": f"visit {index}"}),
                ):
                    reply = await connection.request(
                        "POST", f"{prefix}/{tool}", json_body(arguments), cookie=cookies[index]
                    )
                    output = reply.json().get("output", "") if reply.status == 200 else ""
                    if reply.status != 200 or output.startswith("Error"):
                        raise RuntimeError(f"{tool} of session {index}: {reply.body[:200]!r}")
        finally:
            await connection.close()

    await asyncio.gather(*(work() for _ in range(min(16, len(indices)) or 1)))


async def run(ctx: Any) -> BenchResult:
    params = ctx.params
    processes = ctx.processes
    sizes: list[int] = sorted(params.nemo_gym_sessions)
    repeats: int = params.nemo_gym_repeats
    result = BenchResult(
        "nemo_gym",
        "8. NeMo Gym's own IPI server: prepare, commit, restore",
        "`rollout-checkpoint serve nemo-gym:indirect_prompt_injection` (nemo-gym 0.4.0 from PyPI, "
        "Python 3.12) holding N sessions mid-episode (seeded with the package's first example "
        "row, then a record read and a chart update each). Prepare: Prepare call -> PREPARED. "
        "Commit: Commit call -> reply (export through the shipped hook, write, fsync, "
        "manifest). Restore: into a fresh replacement started closed, Restore call -> reply "
        "(read, verify, validate, install).",
        params={"sessions": sizes, "repeats": repeats},
    )
    try:
        nemo_python = await asyncio.to_thread(ready_env)
    except BesideError as error:
        result.skipped = f"no nemo-gym env here ({error})"
        ctx.say(f"nemo_gym: skipped: {result.skipped}")
        return result
    # Fresh directories even in a reused --workdir. The servers' cwd is outside the repo:
    # our `benchmarks` package would shadow the one nemo-gym installs.
    root = Path(tempfile.mkdtemp(prefix="beside-nemo-gym-", dir=ctx.workdir))
    work = Path(tempfile.mkdtemp(prefix="nemo-gym-", dir=ctx.workdir))
    checkpoints = work / "checkpoints"
    checkpoints.mkdir()
    ctx.say("nemo_gym: installing this tree beside nemo-gym")
    python = await asyncio.to_thread(install_beside, nemo_python, root)
    seed = json_body({"environment": await asyncio.to_thread(example_environment, nemo_python)})

    def serve(name: str, *args: str) -> Server:
        return processes.launch(
            name,
            [
                "-m",
                "rollout_checkpoint.client.cli.main",
                "serve",
                SERVER,
                f"--token={processes.token}",
                *args,
            ],
            python=python,
            cwd=work,
        )

    first = await asyncio.to_thread(serve, "ng-ipi")
    client = ParticipantClient(first.grpc or "", processes.token, timeout=TIMEOUT)
    sources: dict[int, str] = {}
    try:
        await client.get_participant()  # connected before any clock starts
        seeded = 0
        for size in sizes:
            ctx.say(f"nemo_gym: {size} sessions mid-episode, {repeats} prepares and commits")
            cookies = await seed_sessions(first.http, range(seeded, size), rollout, lambda _: seed)
            await mid_episode(first.http, cookies, range(seeded, size))
            seeded = size
            prepares: list[float] = []
            commits: list[float] = []
            record_bytes = 0
            for repeat in range(repeats):
                checkpoint_id = f"ng-{size}-{repeat}"
                directory = checkpoints / checkpoint_id
                started = now()
                final = await client.prepare_until_final(checkpoint_id, deadline_in(TIMEOUT))
                prepares.append(now() - started)
                if not final.readiness.ready:
                    raise RuntimeError("the IPI server did not get prepared")
                started = now()
                reply = await client.commit(checkpoint_id, deadline_in(TIMEOUT), str(directory))
                commits.append(now() - started)
                await client.resume(checkpoint_id, deadline_in(TIMEOUT))
                if reply.manifest.record_count != size:
                    raise RuntimeError(f"committed {reply.manifest.record_count} of {size}")
                record_bytes = reply.manifest.bytes
                if repeat == 0:
                    sources[size] = str(directory)
            note = f"{record_bytes / size / 1000:.1f} KB per session"
            result.figure(
                f"{size} sessions: prepare", "Prepare -> PREPARED", "ms", map(ms, prepares)
            )
            result.figure(
                f"{size} sessions: commit", "Commit call -> reply", "ms", map(ms, commits), note
            )
    finally:
        await client.close()
        processes.stop_servers([first])

    for size in sizes:
        ctx.say(f"nemo_gym: {size} sessions, {repeats} restores into fresh replacements")
        scope = [EpisodeId(rollout(i), 1) for i in range(size)]
        replacements = await asyncio.gather(
            *(
                asyncio.to_thread(serve, f"ng-ipi-{size}-{r}", "--start-closed")
                for r in range(repeats)
            )
        )
        restores: list[float] = []
        try:
            for repeat, replacement in enumerate(replacements):
                async with ParticipantClient(
                    replacement.grpc or "", processes.token, timeout=TIMEOUT
                ) as fresh:
                    await fresh.get_participant()  # connected before the clock starts
                    started = now()
                    reply = await fresh.restore(
                        f"ng-restore-{size}-{repeat}", deadline_in(TIMEOUT), sources[size], scope
                    )
                    restores.append(now() - started)
                if len(reply.restored) != size:
                    raise RuntimeError(f"restored {len(reply.restored)} of {size}")
        finally:
            processes.stop_servers(replacements)
        result.figure(
            f"{size} sessions: restore (fresh process)",
            "Restore call -> reply",
            "ms",
            map(ms, restores),
        )
    await asyncio.to_thread(shutil.rmtree, checkpoints, True)
    return result
