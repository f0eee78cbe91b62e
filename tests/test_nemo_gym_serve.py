"""`rollout-checkpoint serve nemo-gym:<server>`: NeMo Gym's own servers from the CLI (issue 17).

Where nemo-gym is not installed (this suite's own venv) the verb ends with one line naming
what is missing and exit 2, like every missing extra. Where it is (the env beside nemo-gym,
`tests/nemo_gym/beside.py`), `--no-checkpoint` serves exactly what NeMo Gym serves without us:
the same requests to the CLI's server and to `tests/nemo_gym/launch.py` in nemo-gym's own
env (nothing of ours installed) give the same statuses, bodies and headers. Checkpointing
through the verb is tests/test_nemo_gym_checkpoint.py.
"""

from __future__ import annotations

import importlib.util
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_checkpoint.client.cli.console import ExitCode

from .test_fleet_cli import CLI, ENV
from .test_nemo_gym_checkpoint import serve_command
from .test_nemo_gym_install import beside_nemo_gym as beside_nemo_gym  # the shared fixtures
from .test_nemo_gym_smoke import (
    ANNOUNCE_TIMEOUT_S,
    COUNTER,
    HTTP_TIMEOUT_S,
    IPI,
    LAUNCHER,
    NemoGymEnv,
    child_env,
    kill_group,
    read_announcement,
)
from .test_nemo_gym_smoke import nemo_env as nemo_env

SERVERS = (IPI, COUNTER)


def one_error_line(completed: subprocess.CompletedProcess[str]) -> str:
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1, completed.stderr
    assert "Traceback" not in completed.stderr
    return lines[0]


def serve_here(*args: str) -> subprocess.CompletedProcess[str]:
    """`rollout-checkpoint serve ...` in this suite's venv."""
    return subprocess.run(
        [*CLI, "serve", *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("server", SERVERS)
def test_without_nemo_gym_the_verb_says_what_is_missing_and_exits_2(server: str) -> None:
    assert importlib.util.find_spec("nemo_gym") is None, "this check needs a venv without nemo-gym"
    completed = serve_here(f"nemo-gym:{server}", "--http-address", "127.0.0.1:0")
    assert completed.returncode == ExitCode.USAGE, completed.stderr
    assert completed.stdout == ""
    assert one_error_line(completed) == (
        f"rollout-checkpoint serve: nemo-gym:{server} needs nemo-gym==0.4.0 "
        "(nemo-gym is not installed): install nemo-gym==0.4.0 in this environment "
        "(it needs Python >= 3.12)"
    )


@pytest.mark.parametrize(
    ("flag", "value"), [("--mcp", None), ("--session-secret", "s3cret-s3cret-s3cret")]
)
def test_flags_a_nemo_gym_server_cannot_honour_are_refused(flag: str, value: str | None) -> None:
    """Its cookie secret is NeMo Gym's own and it has no MCP endpoint of ours: refused, not
    dropped (before nemo-gym is even looked for)."""
    args = [flag] if value is None else [flag, value]
    completed = serve_here(f"nemo-gym:{COUNTER}", *args)
    assert completed.returncode == ExitCode.USAGE, completed.stderr
    assert one_error_line(completed) == (
        f"rollout-checkpoint serve: {flag} does not apply to nemo-gym:{COUNTER}"
    )


# -- checkpointing off: what NeMo Gym serves without us ---------------------------------------

RESPONSE = {
    "id": "r",
    "created_at": 0,
    "model": "m",
    "object": "response",
    "output": [],
    "parallel_tool_calls": False,
    "tool_choice": "auto",
    "tools": [],
}
# (method, path, JSON body or None): liveness, a 404, a 422, an episode, the stateless route.
REQUESTS: dict[str, list[tuple[str, str, Any]]] = {
    COUNTER: [
        ("GET", "/", None),
        ("GET", "/no-such-route", None),
        ("POST", "/seed_session", {"initial_count": "three"}),
        ("POST", "/seed_session", {"initial_count": 3}),
        ("POST", "/increment_counter", {"count": 2}),
        ("POST", "/get_counter_value", {}),
        (
            "POST",
            "/verify",
            {"responses_create_params": {"input": []}, "response": RESPONSE, "expected_count": 5},
        ),
        ("POST", "/aggregate_metrics", {"verify_responses": []}),
    ],
    IPI: [
        ("GET", "/", None),
        ("POST", "/get_patient_record", {"patient_id": "P001"}),  # 400: not seeded
        ("POST", "/seed_session", {}),  # 422: no environment
        ("POST", "/seed_session", {"environment": {"patients": {"P001": {"name": "Ann"}}}}),
        ("POST", "/get_patient_record", {"patient_id": "P001"}),
        ("POST", "/get_patient_record", {}),  # a handler error: 200 with its output
        ("POST", "/no_such_tool", {}),
        ("POST", "/update_patient_chart", {"patient_id": "P001", "notes": "ok"}),
        ("POST", "/get_patient_record", {"patient_id": "P001"}),
    ],
}


def exchange(base_url: str, requests: list[tuple[str, str, Any]]) -> list[dict[str, Any]]:
    """Each reply as what a client can compare: status, body, header names (values that
    differ by run, like `date`, are left out), and the cookie's name and attributes."""
    replies = []
    with httpx.Client(base_url=base_url, timeout=HTTP_TIMEOUT_S) as client:
        for method, path, body in requests:
            reply = client.request(method, path, json=body)
            cookie = reply.headers.get("set-cookie", "")
            name, _, rest = cookie.partition("=")
            replies.append(
                {
                    "request": (method, path),
                    "status": reply.status_code,
                    "body": reply.text,
                    "headers": sorted(reply.headers.keys()),
                    "content-type": reply.headers.get("content-type"),
                    "vary": reply.headers.get("vary"),
                    "cookie": (name, rest.partition(";")[2].strip()),
                }
            )
    return replies


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    processes: list[subprocess.Popen[bytes]] = []
    try:
        yield processes
    finally:
        for process in processes:
            kill_group(process)


def start(
    command: list[str], work: Path, name: str, started: list[subprocess.Popen[bytes]]
) -> dict[str, Any]:
    log = work / f"{name}.log"
    with log.open("wb") as err:
        process = subprocess.Popen(
            command,
            cwd=work,  # outside the repo: our `benchmarks` would shadow nemo-gym's
            env=child_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            start_new_session=True,
        )
    started.append(process)
    announcement: dict[str, Any] = read_announcement(process, log, ANNOUNCE_TIMEOUT_S)
    return announcement


@pytest.mark.parametrize("server", SERVERS)
def test_checkpointing_off_serves_exactly_what_nemo_gym_serves_without_us(
    server: str,
    nemo_env: NemoGymEnv,
    beside_nemo_gym: Path,
    tmp_path: Path,
    started: list[subprocess.Popen[bytes]],
) -> None:
    without_us = start([str(nemo_env.python), str(LAUNCHER), server], tmp_path, "bare", started)
    ours = start(
        serve_command(beside_nemo_gym, server, "--no-checkpoint"), tmp_path, "cli", started
    )
    assert ours["grpc"] is None and ours["kind"] == "resources"
    assert ours["instance"] == without_us["instance"]

    expected = exchange(f"http://{without_us['http']}", REQUESTS[server])
    served = exchange(f"http://{ours['http']}", REQUESTS[server])
    assert served == expected
    # The requests reach what they were meant to (else equal replies would prove little).
    statuses = [reply["status"] for reply in expected]
    assert statuses == (
        [200, 404, 422, 200, 200, 200, 200, 200]
        if server == COUNTER
        else [200, 400, 422, 200, 200, 200, 200, 200, 200]
    ), statuses
    assert all(reply["cookie"][0] for reply in expected), "every reply sets NeMo Gym's cookie"
