"""The faulty fleet of examples/faulty/, moved to free ports and a private folder for a test.

The fleet file names fixed loopback ports (820x/920x) and paths under /tmp: two runs at once
(or a run beside a developer's own fleet) would collide. `free_port_fleet` writes a copy whose
every `127.0.0.1:<port>` is a port that was free a moment ago (the same port everywhere it
appears, so the agent still reaches the member it names), whose /tmp paths (checkpoint root,
the side-effect ledger) are under the test's folder, with the tasks file beside it (the
members' commands run in the fleet file's folder and name it relatively).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from rollout_checkpoint.client.certify import fleet_processes
from rollout_checkpoint.client.fleet.launch import LaunchedMember, start_member
from rollout_checkpoint.client.fleet.spec import FleetSpec, MemberSpec, load_fleet_file

from .conftest import TOKEN
from .processes import REPO
from .s3_server import free_ports

FAULTY = REPO / "examples" / "faulty"
FLEET = FAULTY / "fleet.toml"
TASKS = FAULTY / "tasks.jsonl"
BUGS = (
    "dropped_field",
    "restore_not_idempotent",
    "background_mutation",
    "hidden_state",
    "side_effect_file",
)
"""Every planted bug: `examples/faulty/<bug>.py`, served by the fleet's member `<bug>`."""
HONEST = "honest"
"""The member serving the counter every faulty one starts from, without a bug: the control."""
OUTSIDE = "/tmp/rollout-checkpoint-faulty"
"""Where the fleet file keeps what lives outside the processes."""
LOOPBACK_PORT = re.compile(r"127\.0\.0\.1:(\d+)")
CLI = [sys.executable, "-m", "rollout_checkpoint.client.cli.main"]
SCRIPTS_PATH = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
"""PATH with this interpreter's scripts first: the fleet files run `rollout-checkpoint`."""


def free_port_fleet(directory: Path) -> Path:
    """`examples/faulty/fleet.toml` rewritten into `directory` (see the module)."""
    text = FLEET.read_text()
    ports = sorted(set(LOOPBACK_PORT.findall(text)))
    moved = dict(zip(ports, free_ports(len(ports)), strict=True))
    text = LOOPBACK_PORT.sub(lambda match: f"127.0.0.1:{moved[match.group(1)]}", text)
    text = text.replace(OUTSIDE, str(directory / "outside"))
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(TASKS, directory / TASKS.name)
    fleet = directory / FLEET.name
    fleet.write_text(text)
    return fleet


def load(fleet: Path) -> FleetSpec:
    return load_fleet_file(fleet, environ={"ROLLOUT_CHECKPOINT_TOKEN": TOKEN})


def member(spec: FleetSpec, name: str) -> MemberSpec:
    (found,) = (m for m in spec.members if m.name == name)
    return found


def http_url(member: MemberSpec) -> str:
    """The member's HTTP base URL, as certify finds it (every faulty member names one)."""
    url = fleet_processes.http_url(member)
    assert url is not None, member
    return url


async def start_fleet(spec: FleetSpec, logs: Path) -> list[LaunchedMember]:
    """Every member started from its command at once (each one's stderr in `logs`); if one
    fails to start, the others are stopped and its error raised."""
    logs.mkdir(parents=True, exist_ok=True)
    started = await asyncio.gather(
        *(start_member(spec, m, stderr=logs / f"{m.name}.log") for m in spec.members),
        return_exceptions=True,
    )
    launched = [s for s in started if isinstance(s, LaunchedMember)]
    failed = [s for s in started if isinstance(s, BaseException)]
    if failed:
        await stop(launched)
        raise failed[0]
    return launched


async def stop(launched: list[LaunchedMember]) -> None:
    """SIGKILL each member's process group and reap it."""
    for process in launched:
        process.kill()
        await process.wait()


def collect_args(fleet: Path, work: Path, *extra: str) -> list[str]:
    """`collect` of the fleet's tasks (the file beside it) at concurrency 6 (an episode of
    each resources member at once), its output and checkpoints in `work`, then `extra` flags."""
    spec = load(fleet)
    return [
        "collect",
        "--fleet",
        str(fleet),
        "--entry-url",
        http_url(member(spec, "environment")),
        "--input",
        str(fleet.parent / TASKS.name),
        "--output",
        str(work / "rollouts.jsonl"),
        "--checkpoint-dir",
        str(work / "checkpoints"),
        "--concurrency",
        "6",
        *extra,
    ]


def run(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """A command of the CLI (or `tests.collect_crash`) with the fleets' token, run from the
    repository, its output captured."""
    return subprocess.run(
        command,
        cwd=REPO,
        env=dict(os.environ, ROLLOUT_CHECKPOINT_TOKEN=TOKEN),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
