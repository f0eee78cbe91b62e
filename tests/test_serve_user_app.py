"""`rollout-checkpoint serve MODULE:ATTRIBUTE`: a user's own server, with no launcher of its own.

Real processes: the user's module is a file in the test's directory, imported from the working
directory the CLI runs in (nothing else puts it on `sys.path`); servers listen on free ports, are
checkpointed through their sidecar, SIGKILLed as a process group, and replaced by a process
started closed that restores. Every refusal is checked as a shell sees it: one line on stderr,
no traceback, nothing announced, exit 2.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_checkpoint.client.cli.console import ExitCode
from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.v1 import types_pb2

from .conftest import TOKEN
from .doc_pages import commands
from .doc_steps import differences, steps
from .processes import kill_group, started
from .test_fleet_cli import CLI, ENV

DOC_SECTIONS = [("docs/your-server.md", "Serving it without a launcher of your own")]
PAGE_SECONDS = 240
WAIT = 60.0
COOKIE = "rollout_session"
PREPARED = types_pb2.PARTICIPANT_STATE_PREPARED

NOTES = """
from typing import Any

from pydantic import BaseModel

from rollout_checkpoint.server.resources import CheckpointMode, ResourcesServer, tool


class Word(BaseModel):
    word: str


class NotesServer(ResourcesServer):
    checkpoint_mode = CheckpointMode.EXPORTED

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.notes: dict[str, list[str]] = {}

    async def seed_session(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        self.notes.setdefault(session_id, list(body.get("words", [])))
        return {}

    @tool("Append a word to the session's notes.")
    async def add_word(self, session_id: str, args: Word) -> dict[str, Any]:
        self.notes[session_id].append(args.word)
        return {"words": self.notes[session_id]}

    async def verify(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        return {"reward": float(self.notes.get(session_id) == body.get("expected"))}

    async def export_session_states(self, session_ids: list[str]) -> dict[str, Any]:
        return {s: {"words": list(self.notes[s])} for s in session_ids if s in self.notes}

    async def restore_session_states(self, states: dict[str, Any]) -> None:
        for session_id, state in states.items():
            self.notes[session_id] = list(state["words"])

    async def retire_session_state(self, session_id: str) -> None:
        self.notes.pop(session_id, None)
"""
"""The user's module: a small `exported` resources server with one tool and the three hooks."""

FACTORIES = """
from starlette.applications import Starlette

from rollout_checkpoint.examples.policy_model import PolicyModelConfig, PolicyModelServer
from rollout_checkpoint.server.resources import CheckpointMode, ResourcesServer, ResourcesServerConfig
from rollout_checkpoint.server.runtime.settings import CheckpointSettings

from notes import NotesServer

COUNT = 3


class Helper:
    pass


class MissingHooks(ResourcesServer):
    checkpoint_mode = CheckpointMode.EXPORTED


app = NotesServer(ResourcesServerConfig()).build_app()
server = NotesServer(ResourcesServerConfig())


def make_model(settings):
    return PolicyModelServer(PolicyModelConfig(instance="model", checkpoint=settings)).build_app()


async def async_factory(settings):
    return app


def two_arguments(settings, other):
    return app


def returns_none(settings):
    return None


def without_checkpointing(settings):
    return Starlette()


def own_settings(settings):
    mine = CheckpointSettings(enabled=True, token="another-token")
    return NotesServer(ResourcesServerConfig(checkpoint=mine)).build_app()


def raising(settings):
    raise ValueError("no database\\nconfigured")
"""
"""App factories, right and wrong, and other things ATTRIBUTE may wrongly name."""


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    """The working directory `serve` runs in, holding the user's modules."""
    directory = tmp_path / "work"
    directory.mkdir()
    (directory / "notes.py").write_text(NOTES)
    (directory / "factories.py").write_text(FACTORIES)
    # Prints to stdout as it is imported: serve keeps stdout for its one announcement line.
    (directory / "chatty.py").write_text('print("imported")\nfrom factories import make_model\n')
    (directory / "broken.py").write_text('raise RuntimeError("no config file")\n')
    (directory / "needs_dependency.py").write_text("import not_installed_anywhere\n")
    return directory


@pytest.fixture
def serve(user_dir: Path, tmp_path: Path) -> Iterator[Any]:
    """Starts `rollout-checkpoint serve ARGS` in `user_dir`; every process group is SIGKILLed
    at the end."""
    processes: list[subprocess.Popen[str]] = []

    def start(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
        log = tmp_path / f"serve-{len(processes)}.log"
        process, announced = started(
            [*CLI, "serve", *args, "--http-address", "127.0.0.1:0"],
            env=env or ENV,
            log=log,
            cwd=user_dir,
        )
        processes.append(process)
        announced["process"] = process
        return announced

    try:
        yield start
    finally:
        for process in processes:
            kill_group(process)


def deadline() -> float:
    return time.time() + WAIT


async def call(base_url: str, path: str, body: dict[str, Any], cookies: dict[str, str]) -> Any:
    """One request on a connection of its own, carrying one session's cookie only."""
    async with httpx.AsyncClient(base_url=base_url, cookies=cookies, timeout=WAIT) as http:
        reply = await http.post(path, json=body)
    assert reply.status_code == 200, reply.text
    return reply


@pytest.mark.parametrize(("workers", "closed_by"), [(1, "environment"), (2, "flag")])
async def test_a_users_server_is_checkpointed_killed_and_restored_into_a_closed_replacement(
    serve: Any, tmp_path: Path, workers: int, closed_by: str
) -> None:
    """`serve notes:NotesServer` as the examples are served: announced, checkpointed through
    its sidecar mid-session, SIGKILLed, replaced by a process started closed (by the documented
    ROLLOUT_CHECKPOINT_START_CLOSED setting, or the flag) that restores every session and goes
    on from the very words it had; with two workers, each worker imports the module itself."""
    checkpoint_dir = str(tmp_path / "ckpt")
    command = ["notes:NotesServer", "--workers", str(workers)]
    first = serve(*command, "--health-address", "127.0.0.1:0")
    assert first["kind"] == "resources" and first["instance"] == "notes.NotesServer"
    announced_keys = {"grpc", "health", "http", "instance", "kind", "pid", "process"}
    if workers > 1:
        assert first["workers"] == workers
        announced_keys |= {"workers", "worker_pids"}
    assert set(first) == announced_keys  # an example's line: scripts read it the same way
    sessions: dict[str, dict[str, str]] = {}
    base_url = f"http://{first['http']}"
    for rollout in ("r0", "r1", "r2"):
        seeded = await call(
            base_url, f"/ng-rollout/{rollout}/seed_session", {"words": [rollout]}, {}
        )
        sessions[rollout] = {COOKIE: seeded.cookies[COOKIE]}
        await call(base_url, f"/ng-rollout/{rollout}/add_word", {"word": "a"}, sessions[rollout])
    client = ParticipantClient(first["grpc"], TOKEN)
    final = await client.prepare_until_final("ckpt-1", deadline())
    assert final.state == PREPARED
    assert final.readiness.counts["sessions"] == len(sessions)
    scope = [EpisodeId(rollout, 0) for rollout in sessions]
    committed = await client.commit("ckpt-1", deadline(), checkpoint_dir, scope=scope)
    assert sorted(committed.exported) == sorted(sessions)
    await client.close()
    kill_group(first["process"])

    closed = ["--start-closed"] if closed_by == "flag" else []
    env = dict(ENV, ROLLOUT_CHECKPOINT_START_CLOSED="true") if closed_by != "flag" else ENV
    replacement = serve(*command, *closed, env=env)
    client = ParticipantClient(replacement["grpc"], TOKEN)
    assert (await client.get_status()).admission_open is False  # nothing runs before Restore
    restored = await client.restore("restore-1", deadline(), checkpoint_dir, scope=scope)
    assert sorted(restored.restored) == sorted(f"{rollout}-a1" for rollout in sessions)
    await client.resume("restore-1", deadline())
    await client.close()
    base_url = f"http://{replacement['http']}"
    for rollout, cookies in sessions.items():
        words = [rollout, "a", "b"]
        reply = await call(base_url, f"/ng-rollout/{rollout}-a1/add_word", {"word": "b"}, cookies)
        assert reply.json() == {"words": words}  # the restored words, the new one applied once
        verified = await call(
            base_url, f"/ng-rollout/{rollout}-a1/verify", {"expected": words}, cookies
        )
        assert verified.json()["reward"] == 1.0


async def test_a_factory_announces_its_participants_kind_and_is_driven_like_any_member(
    serve: Any,
) -> None:
    """A function returning the app it installed checkpointing on, with the settings `serve`
    made from its flags: the announced kind is its participant's (here the policy model's),
    the instance `--instance`'s, its sidecar takes a Prepare and a Resume, and SIGTERM stops
    it gracefully; what its module prints at import goes to stderr, never before the
    announcement."""
    announced = serve("chatty:make_model", "--instance", "my-model")
    assert announced["kind"] == "model" and announced["instance"] == "my-model"
    client = ParticipantClient(announced["grpc"], TOKEN)
    assert (await client.prepare_until_final("ckpt-1", deadline())).state == PREPARED
    await client.resume("ckpt-1", deadline())
    await client.close()
    announced["process"].send_signal(signal.SIGTERM)
    assert announced["process"].wait(timeout=WAIT) == 0  # a graceful stop, as an example's
    unchecked = serve("factories:make_model", "--no-checkpoint")
    assert unchecked["grpc"] is None and unchecked["kind"] is None  # no participant installed


REFUSALS = [
    (["absent:App"], "no module named absent in {cwd} or the environment"),
    (["broken:App"], "importing broken raised RuntimeError: no config file ({cwd}/broken.py:1)"),
    (
        ["needs_dependency:App"],
        "importing needs_dependency raised ModuleNotFoundError: No module named "
        "'not_installed_anywhere' ({cwd}/needs_dependency.py:1)",
    ),
    (["notes:Missing"], "notes:Missing: module notes ({cwd}/notes.py) has no attribute Missing"),
    (["factories:COUNT"], "factories:COUNT is of type int; serve runs a ResourcesServer subclass"),
    (["factories:Helper"], "factories:Helper is the class Helper, not a ResourcesServer subclass"),
    (["factories:app"], "factories:app is a FastAPI built at import, with checkpoint settings"),
    (["factories:server"], "factories:server is a NotesServer built at import"),
    (["factories:async_factory"], "factories:async_factory is an async function"),
    (["factories:two_arguments"], "cannot be called with one argument, the CheckpointSettings"),
    (["factories:returns_none"], "returned NoneType, not a Starlette or FastAPI app"),
    (["factories:without_checkpointing"], "returned an app without checkpointing: call"),
    (["factories:own_settings"], "installed checkpointing with settings of its own"),
    (
        ["factories:raising"],
        "factories:raising raised ValueError: no database configured ({cwd}/factories.py:",
    ),
    (["factories:MissingHooks"], "factories:MissingHooks raised TypeError: "),
    (["factories:make_model", "--workers", "2"], "--workers applies to a ResourcesServer subclass"),
    (["factories:make_model", "--mcp"], "--mcp does not apply to factories:make_model"),
    (["no_such_server"], "unknown server 'no_such_server': one of agent, counter,"),
    (["nemo-gym:no_such_server"], "unknown server 'nemo-gym:no_such_server'"),
]


@pytest.mark.parametrize(("args", "said"), REFUSALS, ids=[" ".join(a) for a, _ in REFUSALS])
def test_what_serve_cannot_run_is_one_line_and_exit_2(
    user_dir: Path, args: list[str], said: str
) -> None:
    completed = subprocess.run(
        [*CLI, "serve", *args, "--http-address", "127.0.0.1:0"],
        cwd=user_dir,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == ExitCode.USAGE, completed.stderr
    assert completed.stdout == ""  # nothing announced: nothing listened
    assert "Traceback" not in completed.stderr
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1, completed.stderr
    assert lines[0].startswith("rollout-checkpoint serve: "), lines[0]
    assert said.format(cwd=user_dir) in lines[0]


def test_serve_help_says_what_module_attribute_may_name() -> None:
    shown = subprocess.run(
        [*CLI, "serve", "--help"], env=ENV, capture_output=True, text=True, timeout=120
    )
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    assert "MODULE:ATTRIBUTE: your own server, MODULE imported with the working directory" in text
    assert "ResourcesServer subclass" in text and "install_checkpointing" in text
    top = subprocess.run([*CLI, "--help"], env=ENV, capture_output=True, text=True, timeout=120)
    assert "or your own server as MODULE:ATTRIBUTE" in " ".join(top.stdout.split())


def test_the_pages_block_serves_checkpoints_and_restores_a_users_server(tmp_path: Path) -> None:
    """docs/your-server.md's example, as a reader pastes it: the module written in the working
    directory, served by name, checkpointed, SIGKILLed, replaced closed, restored, continued."""
    page_steps = steps(commands(*DOC_SECTIONS[0]))
    assert any("serve tally_server:TallyServer" in step.command for step in page_steps)
    wrong, stderr = differences(page_steps, tmp_path, PAGE_SECONDS)
    assert wrong == [], "\n\n".join(wrong) + f"\n\nstderr:\n{stderr[-3000:]}"
