"""A fleet member started from its fleet-file `command`, killed, and replaced started closed.

The parsing tests read fleet files; the others start real processes on free ports: the example
fleet's counter from its own command, a command that exits at once, one that never listens.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from grpc_health.v1 import health_pb2

from rollout_checkpoint.client import (
    CommandNotStarted,
    ExitedBeforeReady,
    FleetConfigError,
    FleetSpec,
    MemberSpec,
    NotReadyInTime,
    load_fleet_file,
    start_member,
)
from rollout_checkpoint.client.participant import LIVENESS_HEALTH, READINESS_HEALTH

from .conftest import TOKEN
from .doc_pages import section_blocks
from .processes import REPO
from .s3_server import free_ports

EXAMPLE_FLEET = REPO / "examples" / "fleet.toml"
CLI = [sys.executable, "-m", "rollout_checkpoint.client.cli.main"]
ENV = dict(os.environ, ROLLOUT_CHECKPOINT_TOKEN=TOKEN, GRPC_VERBOSITY="ERROR")
# `rollout-checkpoint` as the example fleet file spells it: the virtual environment's script.
SCRIPTS = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
SERVING, NOT_SERVING = "SERVING", "NOT_SERVING"


def write_fleet(path: Path, participants: list[dict[str, Any]], **top: Any) -> Path:
    """A TOML fleet file (JSON's strings and arrays are TOML's)."""
    lines = ['token_env = "ROLLOUT_CHECKPOINT_TOKEN"']
    lines += [f"{key} = {json.dumps(value)}" for key, value in top.items()]
    for participant in participants:
        lines.append("[[participants]]")
        for key, value in participant.items():
            if isinstance(value, dict):
                pairs = ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items())
                lines.append(f"{key} = {{ {pairs} }}")
            else:
                lines.append(f"{key} = {json.dumps(value)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def load(path: Path) -> FleetSpec:
    return load_fleet_file(path, environ={"ROLLOUT_CHECKPOINT_TOKEN": TOKEN})


# -- the fleet file ------------------------------------------------------------------------


def test_a_command_and_env_are_read_from_toml_and_yaml(tmp_path: Path) -> None:
    toml = write_fleet(
        tmp_path / "fleet.toml",
        [
            {
                "name": "a",
                "address": "127.0.0.1:1",
                "command": ["serve-it", "--flag", "two words"],
                "env": {"MODE": "fast", "LEVEL": "3"},
            },
            {"name": "b", "address": "127.0.0.1:2"},
        ],
    )
    a, b = load(toml).members
    assert a.command == ("serve-it", "--flag", "two words")
    assert a.env == {"MODE": "fast", "LEVEL": "3"}
    assert a.directory == str(tmp_path.resolve())
    assert b == MemberSpec("b", "127.0.0.1:2") and b.command == () and b.directory is None
    yaml = tmp_path / "fleet.yaml"
    yaml.write_text(
        "participants:\n"
        "  - name: a\n    address: '127.0.0.1:1'\n"
        "    command: [serve-it, --flag]\n    env: {MODE: fast}\n"
    )
    (member,) = load(yaml).members
    assert member.command == ("serve-it", "--flag") and member.env == {"MODE": "fast"}


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("command: rollout-checkpoint serve counter", "list of arguments.*not a string"),
        ("command: []", "names a program"),
        ("command: ['']", "names a program"),
        ("command: [serve, 8101]", "list of strings"),
        ("command: {program: serve}", "list of strings"),
        ("env: {LEVEL: 3}", "env is a table of variable names to strings"),
        ("env: [A=1]", "env is a table"),
        ("env: {'A=B': x}", "env is a table"),
    ],
)
def test_a_malformed_command_or_env_is_refused_naming_the_participant(
    tmp_path: Path, entry: str, message: str
) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"participants:\n  - name: a\n    address: x\n    {entry}\n")
    with pytest.raises(FleetConfigError, match=f"^participant a: .*{message}"):
        load(fleet)


def test_an_unknown_participant_key_is_still_refused(tmp_path: Path) -> None:
    """A misspelt `command` must not start a fleet whose members no controller can start."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("participants:\n  - {name: a, address: x, cmd: [serve]}\n")
    with pytest.raises(FleetConfigError, match="optionally a command and an env"):
        load(fleet)


def test_every_example_member_has_a_command_serving_its_address() -> None:
    """The example fleet's commands and addresses are written twice in one file: a command
    that serves another port than its member's address would start a member no controller
    finds."""
    for member in load(EXAMPLE_FLEET).members:
        assert member.command[:3] == ("rollout-checkpoint", "serve", member.name)
        flag = member.command.index("--grpc-address")
        assert member.command[flag + 1] == member.address, member.name


def test_the_fleet_file_the_controllers_page_shows_loads(tmp_path: Path) -> None:
    (shown,) = (
        block.body
        for block in section_blocks("docs/controllers.md", "The fleet file")
        if block.info == "toml"
    )
    (tmp_path / "fleet.toml").write_text(shown)
    (member,) = load(tmp_path / "fleet.toml").members
    assert member.command[:3] == ("rollout-checkpoint", "serve", "counter")
    assert member.env == {"ROLLOUT_CHECKPOINT_LEASE_GRACE_SECONDS": "60"}


# -- real processes ------------------------------------------------------------------------


def example_counter(tmp_path: Path) -> tuple[FleetSpec, str]:
    """The example fleet's counter, its command moved to free ports, in a fleet file of its
    own; and its HTTP base URL."""
    (counter,) = (m for m in load(EXAMPLE_FLEET).members if m.name == "counter")
    http, grpc_port = free_ports(2)
    moves = {"127.0.0.1:8102": f"127.0.0.1:{http}", counter.address: f"127.0.0.1:{grpc_port}"}
    command = [moves.get(argument, argument) for argument in counter.command]
    fleet = write_fleet(
        tmp_path / "fleet.toml",
        [
            {
                "name": "counter",
                "address": moves[counter.address],
                "command": command,
                "env": SCRIPTS,
            }
        ],
        checkpoint_root=str(tmp_path / "checkpoints"),
    )
    return load(fleet), f"http://127.0.0.1:{http}"


async def health(spec: FleetSpec, member: MemberSpec, service: str) -> str:
    """The sidecar's current status of `service` (the first answer of a Watch)."""
    async with spec.client(member, timeout=10, credentials=None) as client:
        async for status in client.watch_health(service):
            return str(health_pb2.HealthCheckResponse.ServingStatus.Name(status))
    raise AssertionError(f"{member.name}: the health stream ended without a status")


async def cli(*args: str) -> str:
    done = await asyncio.to_thread(
        subprocess.run, [*CLI, *args], env=ENV, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"{args}: exit {done.returncode}\n{done.stderr}"
    return done.stdout


async def test_the_example_counter_is_started_killed_and_replaced_closed(tmp_path: Path) -> None:
    """Started from its command it serves; a second start is refused while it answers; a
    SIGKILL of its group frees its ports; the replacement (the same command, started closed)
    is live but not ready until the fleet restores and resumes it, and the session is back."""
    spec, http = example_counter(tmp_path)
    (member,) = spec.members
    fleet_file = str(tmp_path / "fleet.toml")
    first = await start_member(spec, member, stderr=tmp_path / "first.log")
    replacement = None
    try:
        assert await health(spec, member, READINESS_HEALTH) == SERVING
        async with httpx.AsyncClient(base_url=http) as episode:
            seeded = await episode.post("/ng-rollout/r1/seed_session", json={"initial_count": 4})
            assert seeded.status_code == 200, seeded.text
            cookies = episode.cookies
        await cli("checkpoint", "--fleet", fleet_file, "ckpt-a")
        with pytest.raises(CommandNotStarted, match="already answers"):
            await start_member(spec, member)

        first.kill(signal.SIGKILL)
        assert await first.wait() == -signal.SIGKILL
        replacement = await start_member(
            spec, member, replacement=True, stderr=tmp_path / "replacement.log"
        )
        assert replacement.replacement and replacement.pid != first.pid
        assert await health(spec, member, LIVENESS_HEALTH) == SERVING
        assert await health(spec, member, READINESS_HEALTH) == NOT_SERVING
        await cli("restore", "--fleet", fleet_file, "restore-1")
        assert await health(spec, member, READINESS_HEALTH) == NOT_SERVING
        await cli("resume", "--fleet", fleet_file, "restore-1")
        assert await health(spec, member, READINESS_HEALTH) == SERVING
        async with httpx.AsyncClient(base_url=http, cookies=cookies) as episode:
            counted = await episode.post("/ng-rollout/r1-a1/get_counter_value", json={})
            assert counted.json() == {"count": 4}
    finally:
        for launched in (first, replacement):
            if launched is not None:
                launched.kill()
                await launched.wait()


def one_member(tmp_path: Path, command: list[str]) -> FleetSpec:
    (port,) = free_ports(1)
    participant = {"name": "m", "address": f"127.0.0.1:{port}", "command": command}
    return load(write_fleet(tmp_path / "fleet.toml", [participant]))


# Exits with 3 after a line on stderr, leaving a child of its own that holds the same stderr
# open: its error can be read to the end only once the whole group is killed.
EXITS_AT_ONCE = (
    "import subprocess, sys\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'])\n"
    "print('boom: no app named nothing:app', file=sys.stderr, flush=True)\n"
    "sys.exit(3)\n"
)


@pytest.mark.parametrize("stderr", ["file", "pipe"])
async def test_a_command_that_exits_at_once_fails_with_its_status_and_stderr(
    tmp_path: Path, stderr: str
) -> None:
    spec = one_member(tmp_path, [sys.executable, "-c", EXITS_AT_ONCE])
    output = tmp_path / "m.log" if stderr == "file" else subprocess.PIPE
    with pytest.raises(ExitedBeforeReady) as failed:
        await start_member(spec, spec.members[0], stderr=output, ready_seconds=120)
    assert failed.value.returncode == 3 and failed.value.member == "m"
    assert failed.value.stderr_tail.endswith("boom: no app named nothing:app")
    assert "exited with 3 before it was ready" in str(failed.value)


# Shows the environment and folder it runs in (on stderr, which the error carries) and exits.
SHOWS_ITS_ENVIRONMENT = (
    "import json, os, sys\n"
    "names = ['ROLLOUT_CHECKPOINT_TOKEN', 'ROLLOUT_CHECKPOINT_START_CLOSED', 'MODE', 'INHERITED']\n"
    "shown = {name: os.environ.get(name) for name in names}\n"
    "print(json.dumps({'cwd': os.getcwd(), **shown}), file=sys.stderr)\n"
)


@pytest.mark.parametrize("replacement", [False, True])
async def test_the_command_runs_beside_the_fleet_file_with_the_fleets_token_and_its_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replacement: bool
) -> None:
    """The controller's environment, the fleet's token (here from a token file), the member's
    `env`; started closed only as a replacement, even when the controller's own environment
    says otherwise."""
    monkeypatch.setenv("INHERITED", "yes")
    monkeypatch.setenv("ROLLOUT_CHECKPOINT_START_CLOSED", "true")
    (tmp_path / "token").write_text("from-the-file\n")
    (port,) = free_ports(1)
    member = {
        "name": "m",
        "address": f"127.0.0.1:{port}",
        "command": [sys.executable, "-c", SHOWS_ITS_ENVIRONMENT],
        "env": {"MODE": "fast"},
    }
    spec = load(write_fleet(tmp_path / "fleet.toml", [member], token_file="token"))
    with pytest.raises(ExitedBeforeReady) as shown:
        await start_member(spec, spec.members[0], replacement=replacement, stderr=subprocess.PIPE)
    assert json.loads(shown.value.stderr_tail) == {
        "cwd": str(tmp_path.resolve()),
        "ROLLOUT_CHECKPOINT_TOKEN": "from-the-file",
        "ROLLOUT_CHECKPOINT_START_CLOSED": "true" if replacement else None,
        "MODE": "fast",
        "INHERITED": "yes",
    }


async def test_a_command_that_cannot_run_is_refused(tmp_path: Path) -> None:
    spec = one_member(tmp_path, [str(tmp_path / "no-such-server")])
    with pytest.raises(CommandNotStarted, match="no-such-server"):
        await start_member(spec, spec.members[0])
    without = load(write_fleet(tmp_path / "bare.toml", [{"name": "m", "address": "x:1"}]))
    with pytest.raises(CommandNotStarted, match="no command"):
        await start_member(without, without.members[0])


async def test_a_command_that_never_listens_is_killed_at_the_deadline(tmp_path: Path) -> None:
    spec = one_member(
        tmp_path,
        [
            sys.executable,
            "-c",
            "import os, sys, time\n"
            "print(os.getpid(), file=sys.stderr, flush=True)\n"
            "time.sleep(3600)\n",
        ],
    )
    # Long enough for the interpreter to start and print its pid on a loaded machine.
    with pytest.raises(NotReadyInTime, match="did not answer participant-liveness") as failed:
        await start_member(spec, spec.members[0], stderr=tmp_path / "m.log", ready_seconds=10)
    pid = int(failed.value.stderr_tail)
    with pytest.raises(ProcessLookupError):  # killed and reaped before the error was raised
        os.kill(pid, 0)


def test_a_participants_url_is_read_and_a_bad_one_refused(tmp_path: Path) -> None:
    """`url` is optional and additive: an http(s) URL with a host (trailing slash dropped),
    else refused naming the participant before any member is called."""
    fleet = write_fleet(
        tmp_path / "fleet.toml",
        [
            {"name": "a", "address": "127.0.0.1:1", "url": "http://127.0.0.1:8102/"},
            {"name": "b", "address": "127.0.0.1:2"},
        ],
    )
    a, b = load(fleet).members
    assert (a.url, b.url) == ("http://127.0.0.1:8102", None)
    for bad in ("127.0.0.1:8102", "ftp://host", "http://", "8102"):
        write_fleet(fleet, [{"name": "a", "address": "x", "url": bad}])
        with pytest.raises(FleetConfigError, match=r"^participant a: url is an http"):
            load(fleet)
