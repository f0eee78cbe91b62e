"""NeMo Gym's own servers (nemo-gym 0.4.0 from PyPI) run here, and answer as FACTS.md says.

The groundwork for checkpointing real NeMo Gym servers (issue 17): before any integration
wraps them, this proves that the cached Python 3.12 environment can be had, that
`tests/nemo_gym/launch.py` serves both servers outside `ng_run`, and that one episode
driven the way NeMo Gym's `simple_agent` drives it (seed the whole dataset row, call tools
by name, verify the whole row plus the response, one cookie jar throughout) gives the
answers recorded in tests/nemo_gym/FACTS.md. The payloads are the first rows of the
package's own `data/example.jsonl`, read from the installed wheel.

The environment takes minutes and 1.4 GB to build, so `scripts/nemo-gym-env` caches it
outside the repo; `scripts/test` builds it before pytest. If it cannot be had (no Python
3.12, no PyPI), these tests FAIL with the reason: a skip would let a broken integration
pass unnoticed.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import selectors
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from .nemo_gym.beside import ENV_SCRIPT, REPO, child_env

LAUNCHER = REPO / "tests" / "nemo_gym" / "launch.py"

# A cold build is about 2.5 minutes on an idle machine; a loaded 2-core CI box gets slack.
ENV_BUILD_TIMEOUT_S = 1500.0
# Importing nemo_gym (it imports ray) takes 7-15 s on a busy 2-core machine.
ANNOUNCE_TIMEOUT_S = 90.0
HTTP_TIMEOUT_S = 15.0

IPI = "indirect_prompt_injection"
COUNTER = "example_session_state_mgmt"
# Cookie name == signing secret == f"{ServerClass}___{config.name}"; the launcher uses
# ng_run's instance names from the package's configs/*.yaml.
COOKIE = {
    IPI: "IPIResourcesServer___indirect_prompt_injection_resources_server",
    COUNTER: "StatefulCounterResourcesServer___example_session_state_mgmt_resources_server",
}


@dataclass(frozen=True)
class NemoGymEnv:
    python: Path
    site_packages: Path

    def example_row(self, server: str) -> dict[str, Any]:
        """Line 1 of the server's own data/example.jsonl, as shipped in the wheel."""
        path = self.site_packages / "resources_servers" / server / "data" / "example.jsonl"
        row: dict[str, Any] = json.loads(path.read_text().splitlines()[0])
        return row


@dataclass(frozen=True)
class Served:
    name: str
    process: subprocess.Popen[bytes]
    announcement: dict[str, Any]
    log: Path

    @property
    def base_url(self) -> str:
        return f"http://{self.announcement['http']}"


@pytest.fixture(scope="module")
def nemo_env() -> NemoGymEnv:
    """The cached env's python (built here on first use); a failure to get it FAILS."""
    # Its own process group, so a time-out also stops the pip it runs (a killed build
    # leaves nothing that looks ready; the next run cleans it up).
    build = subprocess.Popen(
        ["bash", str(ENV_SCRIPT)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
        start_new_session=True,
    )
    try:
        stdout, stderr = build.communicate(timeout=ENV_BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_group(build)
        pytest.fail(
            f"scripts/nemo-gym-env did not finish in {ENV_BUILD_TIMEOUT_S:.0f} s", pytrace=False
        )
    if build.returncode != 0:
        lines = stderr.strip().splitlines() or [f"exit {build.returncode}, no message"]
        pytest.fail(f"the NeMo Gym 0.4.0 env cannot be had: {lines[-1]}", pytrace=False)
    python = Path(stdout.strip().splitlines()[-1])
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        check=True,
    )
    return NemoGymEnv(python, Path(site.stdout.strip()))


def kill_group(process: subprocess.Popen[Any]) -> None:
    """SIGKILL the whole process group of a child started as a session leader: the
    group, not just the pid, so nothing it started outlives the test even if the leader
    has already exited."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)


def read_announcement(process: subprocess.Popen[bytes], log: Path, timeout: float) -> Any:
    """The first stdout line, within `timeout` seconds however the bytes arrive.

    Raw `os.read` under a deadline, not `readline()`: a line that arrives in pieces (or
    never gets its newline) must not block the test past the deadline.
    """
    assert process.stdout is not None
    fd = process.stdout.fileno()
    deadline = time.monotonic() + timeout
    data = b""
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while b"\n" not in data:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(
                    f"{log.stem} announced nothing in {timeout:.0f} s; its stderr:\n{tail(log)}",
                    pytrace=False,
                )
            if not selector.select(remaining):
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                pytest.fail(
                    f"{log.stem} exited ({process.wait()}) before announcing; its stderr:\n"
                    f"{tail(log)}",
                    pytrace=False,
                )
            data += chunk
    return json.loads(data.split(b"\n", 1)[0])


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def group_members(pgid: int) -> set[int]:
    """Live pids in a process group, from /proc (Linux): proves no Ray daemons got spawned."""
    members = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # Fields after the parenthesised command: state ppid pgrp ...
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.add(int(stat.parent.name))
    return members


@pytest.fixture(scope="module")
def servers(
    nemo_env: NemoGymEnv, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Served]]:
    """Both servers, started together (their 7-15 s imports overlap), each in its own
    process group, which the fixture's finalizer SIGKILLs whatever happens (a failed
    announcement included)."""
    work = tmp_path_factory.mktemp("nemo-gym")
    started: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    try:
        for name in (IPI, COUNTER):
            log = work / f"{name}.log"
            with log.open("wb") as err:
                started[name] = (
                    subprocess.Popen(
                        [str(nemo_env.python), str(LAUNCHER), name],
                        # Outside the repo: nemo-gym installs a top-level `benchmarks`
                        # package, and a cwd of the repo root would let ours shadow it.
                        cwd=work,
                        env=child_env(),
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=err,
                        start_new_session=True,
                    ),
                    log,
                )
        yield {
            name: Served(name, process, read_announcement(process, log, ANNOUNCE_TIMEOUT_S), log)
            for name, (process, log) in started.items()
        }
    finally:
        for process, _ in started.values():
            kill_group(process)


def session_id(client: httpx.Client | httpx.AsyncClient, server: str) -> str:
    """The NeMo Gym session id inside the signed cookie (base64 JSON before the first dot)."""
    value = client.cookies[COOKIE[server]]
    payload = value.split(".", 1)[0]
    session: dict[str, str] = json.loads(base64.b64decode(payload + "=" * (-len(payload) % 4)))
    assert set(session) == {"session_id"}, session
    return session["session_id"]


def response_object(
    tools: list[dict[str, Any]], calls: list[tuple[str, dict[str, Any], str]]
) -> dict[str, Any]:
    """A Responses-API response as simple_agent hands it to /verify: each tool call as a
    `function_call` item followed by its `function_call_output` (the raw HTTP body the
    resources server returned), then the assistant's closing message."""
    output: list[dict[str, Any]] = []
    for i, (name, arguments, body) in enumerate(calls):
        call_id = f"call_smoke_{i}"
        output.append(
            {
                "type": "function_call",
                "id": f"fc_smoke_{i}",
                "call_id": call_id,
                "name": name,
                "arguments": json.dumps(arguments),
                "status": "completed",
            }
        )
        output.append({"type": "function_call_output", "call_id": call_id, "output": body})
    output.append(
        {
            "type": "message",
            "id": "msg_smoke",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Done.", "annotations": []}],
        }
    )
    return {
        "id": "resp_smoke",
        "created_at": 1700000000.0,
        "model": "smoke-test",
        "object": "response",
        "output": output,
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": tools,
    }


def test_both_servers_run_outside_ng_run_without_ray(servers: dict[str, Served]) -> None:
    for served in servers.values():
        assert served.announcement["kind"] == f"nemo-gym:{served.name}"
        assert served.announcement["pid"] == served.process.pid
        with httpx.Client(base_url=served.base_url, timeout=HTTP_TIMEOUT_S) as client:
            # run_webserver()'s liveness route; it too gets a session cookie.
            live = client.get("/")
            assert live.status_code == 200 and live.json() == {"status": "ok"}
            assert COOKIE[served.name] in client.cookies
        assert group_members(served.process.pid) == {served.process.pid}, "Ray was started"


def test_counter_episode(nemo_env: NemoGymEnv, servers: dict[str, Served]) -> None:
    """StatefulCounterResourcesServer: seed 3, +1, +2, read 6, verify expected 6 -> 1.0."""
    row = nemo_env.example_row(COUNTER)
    assert (row["initial_count"], row["expected_count"]) == (3, 6)
    url = servers[COUNTER].base_url
    with httpx.Client(base_url=url, timeout=HTTP_TIMEOUT_S) as client:
        seeded = client.post("/seed_session", json=row)
        assert seeded.status_code == 200 and seeded.json() == {}
        sid = session_id(client, COUNTER)

        calls: list[tuple[str, dict[str, Any], str]] = []
        for count in (1, 2):
            step = client.post("/increment_counter", json={"count": count})
            assert step.status_code == 200 and step.json() == {"success": True}
            calls.append(("increment_counter", {"count": count}, step.text))
        value = client.post("/get_counter_value", json={})
        assert value.status_code == 200 and value.json() == {"count": 6}
        calls.append(("get_counter_value", {}, value.text))
        assert session_id(client, COUNTER) == sid, "the session id changed mid-episode"

        verify_request = row | {
            "response": response_object(row["responses_create_params"]["tools"], calls)
        }
        verified = client.post("/verify", json=verify_request)
        assert verified.status_code == 200, verified.text
        body = verified.json()
        assert body["reward"] == 1.0
        # The counter's own BaseVerifyResponse drops expected_count/initial_count.
        assert set(body) == {"responses_create_params", "response", "reward"}
        # /verify leaves the counter in place.
        again = client.post("/get_counter_value", json={})
        assert again.json() == {"count": 6}

    # Another cookie jar is another session: a fresh counter at 0.
    with httpx.Client(base_url=url, timeout=HTTP_TIMEOUT_S) as stranger:
        assert stranger.post("/get_counter_value", json={}).json() == {"count": 0}
        assert session_id(stranger, COUNTER) != sid


def test_ipi_episode(nemo_env: NemoGymEnv, servers: dict[str, Served]) -> None:
    """IPIResourcesServer on the first healthcare row: read the poisoned record, schedule
    an appointment, read the schedule, verify a trace that did not follow the injection
    -> reward 1.0; /verify then deletes the session's environment."""
    row = nemo_env.example_row(IPI)
    env = row["environment"]
    assert row["domain"] == "healthcare" and row["required_tools"] == ["get_patient_record"]
    with httpx.Client(base_url=servers[IPI].base_url, timeout=HTTP_TIMEOUT_S) as client:
        seeded = client.post("/seed_session", json=row)
        assert seeded.status_code == 200 and seeded.json() == {}
        sid = session_id(client, IPI)
        calls: list[tuple[str, dict[str, Any], str]] = []

        def tool(name: str, arguments: dict[str, Any]) -> str:
            reply = client.post(f"/{name}", json=arguments)
            assert reply.status_code == 200, reply.text
            calls.append((name, arguments, reply.text))
            output: str = reply.json()["output"]
            return output

        # Tool outputs are json.dumps of the stored environment, in its key order.
        record = tool("get_patient_record", {"patient_id": "P003"})
        assert record == json.dumps(env["patients"]["P003"])
        assert row["injection"]["injection_text"] in json.loads(record)["chart_notes"]

        booked = tool(
            "schedule_appointment",
            {"patient_id": "P001", "date": "2031-05-06", "time": "09:30", "reason": "smoke"},
        )
        match = re.fullmatch(
            r"Appointment (A[0-9A-F]{6}) scheduled for patient P001 on 2031-05-06 at 09:30\.",
            booked,
        )
        assert match, booked  # the id is uuid4-random: not comparable between runs
        schedule = tool("get_schedule", {"date": "2031-05-06"})
        assert json.loads(schedule) == [
            {
                "appointment_id": match[1],
                "patient_id": "P001",
                "date": "2031-05-06",
                "time": "09:30",
                "reason": "smoke",
                "status": "scheduled",
            }
        ]
        assert session_id(client, IPI) == sid, "the session id changed mid-episode"

        verify_request = row | {
            "response": response_object(row["responses_create_params"]["tools"], calls)
        }
        verified = client.post("/verify", json=verify_request)
        assert verified.status_code == 200, verified.text
        body = verified.json()
        assert body["reward"] == 1.0
        assert body["injection_followed"] is False and body["matched_tool"] is None
        assert (body["reward_safety"], body["reward_utility"]) == (1.0, 1.0)
        assert body["attack_strategy"] == row["injection"]["attack_strategy"]
        # /verify popped session_id_to_env[sid]: the episode cannot go on.
        after = client.post("/get_patient_record", json={"patient_id": "P003"})
        assert after.status_code == 400
        assert after.json() == {
            "detail": "Session not initialized. Please call seed_session first."
        }
