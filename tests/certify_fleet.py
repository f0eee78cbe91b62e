"""The example fleet (`examples/fleet.toml`) for certify's tests: moved to free ports, with a
private checkpoint root, and a small tasks file.

The example fleet file's commands and addresses name fixed ports (81xx, 91xx); tests running
at the same time would fight for them. Every `127.0.0.1:<port>` the file names (addresses and
command arguments alike, so a command still serves its member's address and the agent still
finds the model) is rewritten to a port that was free a moment ago.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from rollout_checkpoint.client import FleetSpec, load_fleet_file

from .conftest import TOKEN
from .processes import REPO
from .s3_server import free_ports
from .test_fleet_launch import SCRIPTS, write_fleet

EXAMPLE_FLEET = REPO / "examples" / "fleet.toml"
EXAMPLE_TASKS = REPO / "examples" / "prompt_injection_tasks.jsonl"
LOOPBACK_PORT = re.compile(r"127\.0\.0\.1:(\d+)")


def example_fleet(directory: Path, *, async_commit: bool = False) -> tuple[Path, str]:
    """The example fleet file moved to free ports in `directory` (its checkpoint root there
    too), and the entry point's (the environment's) HTTP base URL."""
    example = load_fleet_file(EXAMPLE_FLEET, environ={"ROLLOUT_CHECKPOINT_TOKEN": TOKEN})
    named = sorted(
        {
            int(port)
            for member in example.members
            for text in (member.address, *member.command)
            for port in LOOPBACK_PORT.findall(text)
        }
    )
    moved = dict(zip(named, free_ports(len(named)), strict=True))

    def move(text: str) -> str:
        return LOOPBACK_PORT.sub(lambda m: f"127.0.0.1:{moved[int(m.group(1))]}", text)

    participants: list[dict[str, Any]] = [
        {
            "name": member.name,
            "address": move(member.address),
            "command": [move(argument) for argument in member.command],
            "env": dict(SCRIPTS),
        }
        for member in example.members
    ]
    path = write_fleet(
        directory / "fleet.toml",
        participants,
        checkpoint_root=str(directory / "checkpoints"),
        async_commit=async_commit,
    )
    environment = next(p for p in participants if p["name"] == "environment")
    http = environment["command"][environment["command"].index("--http-address") + 1]
    return path, f"http://{http}"


def load(path: Path) -> FleetSpec:
    return load_fleet_file(path, environ={"ROLLOUT_CHECKPOINT_TOKEN": TOKEN})


def tasks_file(directory: Path, count: int = 6) -> Path:
    """The first `count` of the example tasks the demo and the scripted model use."""
    rows = [json.loads(line) for line in EXAMPLE_TASKS.read_text().splitlines() if line.strip()]
    path = directory / "tasks.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows[:count]))
    return path
