"""`collect --checkpoint-dir s3://…` through a SIGKILL of the collector and its whole fleet.

Real processes throughout: the example fleet (five servers) writes its parts to SeaweedFS,
`rollout-checkpoint collect` publishes checkpoints there, and both get their credentials only
from the standard AWS variables. The collector and every fleet process are SIGKILLed mid-run
with a published checkpoint that cut rollouts mid-episode; `--resume` on a fresh fleet
(started closed, as replacements are) restores it from the store and finishes: every rollout
exactly once, the cut ones continued from their checkpointed step. The dispatch log, which an
object store cannot append to, lies next to `--output`. Waiting is bounded polling of what
the collector writes (`test_collect.wait_until`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import secrets
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import obstore
import pytest

from rollout_checkpoint.examples.demo import FleetProcesses, Options, start_fleet
from rollout_checkpoint.server.core.errors import CheckpointError
from rollout_checkpoint.server.core.object_parts import ObjectPartStorage

from .s3_server import S3Connection, SeaweedS3
from .test_collect import (
    CLI,
    CONCURRENCY,
    LATENCY,
    REPEATS,
    REPO,
    TASKS,
    TOKEN,
    output_lines,
    wait_until,
)
from .test_s3_server import store_for


class Store:
    """Reads what the collector published below `prefix` (the test's own client)."""

    def __init__(self, connection: S3Connection, prefix: str) -> None:
        self.connection = connection
        self.store = store_for(connection)
        self.prefix = prefix

    def read(self, name: str) -> bytes | None:
        try:
            return bytes(obstore.get(self.store, f"{self.prefix}/{name}").bytes())
        except FileNotFoundError:
            return None

    def latest(self) -> dict[str, Any] | None:
        pointer = self.read("LATEST")
        if pointer is None:
            return None
        raw = self.read(f"{pointer.decode().strip()}/checkpoint.json")
        if raw is None:
            return None  # retention removed it while we read: a newer one is out
        manifest: dict[str, Any] = json.loads(raw)
        manifest["state"] = json.loads(base64.b64decode(manifest["controller_state"]))
        return manifest

    def mid_episode(self, manifest: dict[str, Any]) -> dict[str, int]:
        """Rollouts the checkpoint cut mid-episode: rollout id -> the agent's step. Read
        with the runtime's reader (the agent checkpoints incrementally: reference lines),
        with the store's credentials in this process's environment, as the product reads."""
        checkpoint = self.connection.url(f"{self.prefix}/{manifest['checkpoint_id']}")
        with pytest.MonkeyPatch.context() as env:
            for name, value in self.connection.environment().items():
                env.setenv(name, value)
            try:
                _, records = ObjectPartStorage().read_part(
                    checkpoint, "agent", "agent", lambda _record: True
                )
            except CheckpointError:
                return {}  # retention removed it while we read: a newer one is out
        steps: dict[str, int] = {}
        for record in records:
            boundary = record["boundary"]
            if isinstance(boundary, dict) and "step" in boundary:
                steps[record["episode_id"]["rollout_id"]] = boundary["step"]
        return steps


def boot(work: Path, label: str, *, closed: bool) -> FleetProcesses:
    processes = asyncio.run(
        start_fleet(label, work / "logs", TOKEN, Options(latency=LATENCY), start_closed=closed)
    )
    lines = ['token_env = "COLLECT_TOKEN"']
    for server in processes.servers.values():
        lines += ["[[participants]]", f'name = "{server.name}"', f'address = "{server.grpc}"']
    (work / f"{label}.toml").write_text("\n".join(lines) + "\n")
    return processes


@pytest.fixture
def s3_fleets(
    tmp_path: Path, s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[FleetProcesses, FleetProcesses]]:
    """A fleet and a fresh one started closed, both with the store's variables (and only
    those: nothing else tells them where or how to write)."""
    for name, value in s3_server.connection.environment().items():
        monkeypatch.setenv(name, value)
    (tmp_path / "logs").mkdir()
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [
            pool.submit(boot, tmp_path, "first", closed=False),
            pool.submit(boot, tmp_path, "fresh", closed=True),
        ]
    fleets = [f.result() for f in futures if f.exception() is None]
    try:
        assert len(fleets) == 2, [f.exception() for f in futures]
        yield fleets[0], fleets[1]
    finally:
        for fleet in fleets:
            with contextlib.suppress(Exception):
                fleet.kill()


def collect(
    work: Path, fleet_file: Path, entry: str, url: str, *extra: str
) -> subprocess.Popen[bytes]:
    number = len(list(work.glob("collect-*.log")))
    with (work / f"collect-{number}.log").open("wb") as stderr:
        return subprocess.Popen(
            [
                *CLI,
                "collect",
                "--fleet",
                str(fleet_file),
                "--entry-url",
                entry,
                "--input",
                str(TASKS),
                "--output",
                str(work / "rollouts.jsonl"),
                "--checkpoint-dir",
                url,
                "--num-repeats",
                str(REPEATS),
                "--concurrency",
                str(CONCURRENCY),
                "--checkpoint-timeout",
                "60",
                *extra,
            ],
            cwd=REPO,
            env=dict(os.environ, COLLECT_TOKEN=TOKEN, GRPC_VERBOSITY="ERROR"),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )


def test_collect_to_s3_survives_a_sigkill_of_everything_and_resumes_from_the_store(
    tmp_path: Path, s3_server: SeaweedS3, s3_fleets: tuple[FleetProcesses, FleetProcesses]
) -> None:
    work = tmp_path
    first, fresh = s3_fleets
    prefix = f"collect/{secrets.token_hex(6)}"
    url = s3_server.connection.url(prefix)
    store = Store(s3_server.connection, prefix)

    def mid_run_with_a_checkpoint() -> bool:
        manifest = store.latest()
        if manifest is None:
            return False
        finished = {line["rollout_id"] for line in output_lines(work)}
        return len(finished) >= 3 and bool(set(store.mid_episode(manifest)) - finished)

    process = collect(
        work, work / "first.toml", first.url("environment"), url, "--checkpoint-every", "0.5"
    )
    try:
        # Frozen (SIGSTOP) at a moment checked twice, so the SIGKILL lands mid-run.
        while True:
            wait_until(mid_run_with_a_checkpoint, "a checkpoint mid-run on s3", process, 90)
            os.killpg(process.pid, signal.SIGSTOP)
            if mid_run_with_a_checkpoint():
                break
            os.killpg(process.pid, signal.SIGCONT)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        first.kill()
        manifest = store.latest()
        assert manifest is not None
        steps = store.mid_episode(manifest)
        finished_before = {line["rollout_id"] for line in output_lines(work)}
        # Nothing of the run lies in a local checkpoint directory; the log is next to --output.
        assert (work / "rollouts.jsonl.dispatched.jsonl").stat().st_size > 0
        resumed = collect(work, work / "fresh.toml", fresh.url("environment"), url, "--resume")
        assert resumed.wait(timeout=120) == 0, (work / "collect-1.log").read_text()
    finally:
        for started in (process, locals().get("resumed")):
            if isinstance(started, subprocess.Popen) and started.poll() is None:
                os.killpg(started.pid, signal.SIGKILL)
                started.wait(timeout=10)
    log = (work / "collect-1.log").read_text()
    assert f"restored {manifest['checkpoint_id']}" in log
    lines = output_lines(work)
    ids = [line["rollout_id"] for line in lines]
    tasks = len(TASKS.read_text().splitlines())
    assert len(ids) == len(set(ids)) == tasks * REPEATS, "each rollout exactly once"
    assert all(line["status"] == "ok" for line in lines)
    by_id = {line["rollout_id"]: line for line in lines}
    went_on = 0
    for episode in manifest["continued"]:
        rollout_id = episode["rollout_id"]
        if rollout_id in finished_before:
            continue
        assert by_id[rollout_id]["attempt"] == episode["attempt"] + 1, rollout_id
        if rollout_id in steps:
            assert by_id[rollout_id]["reply"]["continued_from_step"] == steps[rollout_id]
            went_on += 1
    assert went_on >= 1
