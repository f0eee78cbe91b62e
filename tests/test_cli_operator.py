"""The CLI as an operator meets it: one line and a documented code for every error, interrupts
that never leave a fleet closed, output that reads, and help that is enough.

Every test runs `rollout-checkpoint` as a process (the exit code and the lines a shell sees),
against real example-server processes where a fleet is needed.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from rollout_checkpoint.client.cli import main as cli_module
from rollout_checkpoint.client.cli.console import EXIT_CODE_MEANINGS, ExitCode
from rollout_checkpoint.examples import serve

from .test_fleet_cli import CLI, ENV, RealFleet, cli, real_fleet

SERVE = [sys.executable, "-m", "rollout_checkpoint.examples.serve"]


def one_error_line(completed: subprocess.CompletedProcess[str]) -> str:
    """The error's line: exactly one line on stderr, no traceback."""
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1, completed.stderr
    assert "Traceback" not in completed.stderr
    return lines[0]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], env=env or ENV, capture_output=True, text=True, timeout=120
    )


# -- the error table: one row, one test ------------------------------------------------------


def test_a_missing_fleet_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    completed = cli("status", "--fleet", str(tmp_path / "missing.toml"))
    assert completed.returncode == ExitCode.USAGE
    assert "missing.toml: no such fleet file" in one_error_line(completed)


def test_a_checkpoint_root_that_is_a_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    with real_fleet(tmp_path) as fleet:
        not_a_directory = tmp_path / "root-file"
        not_a_directory.write_text("")
        completed = cli(
            "checkpoint", "--fleet", str(fleet.fleet_file), "--root", str(not_a_directory)
        )
        assert completed.returncode == ExitCode.USAGE
        assert f"checkpoint root {not_a_directory}" in one_error_line(completed)


def test_serve_without_a_token_says_what_to_set_and_exits_2() -> None:
    env = {k: v for k, v in ENV.items() if k != "ROLLOUT_CHECKPOINT_TOKEN"}
    completed = run("serve", "counter", env=env)
    assert completed.returncode == ExitCode.USAGE
    assert "set ROLLOUT_CHECKPOINT_TOKEN or pass --token" in one_error_line(completed)


@pytest.mark.parametrize("which", ["--grpc-address", "--http-address"])
def test_serve_on_a_taken_port_is_one_line_and_exit_8(which: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        completed = run("serve", "counter", which, address)
    assert completed.returncode == ExitCode.ADDRESS_IN_USE
    assert f"{address}: in use" in one_error_line(completed)


def test_participant_verbs_use_the_fleet_codes(tmp_path: Path) -> None:
    with real_fleet(tmp_path) as fleet:
        address = fleet.servers["counter"].announced["grpc"]
        refused = cli("participant", "commit", "--address", address, "c1", "--dir", "/tmp/c1")
        assert refused.returncode == ExitCode.REFUSED
        assert "INVALID_PHASE" in one_error_line(refused)
        wrong_token = run(
            "participant",
            "status",
            "--address",
            address,
            env=dict(ENV, ROLLOUT_CHECKPOINT_TOKEN="x"),
        )
        assert wrong_token.returncode == ExitCode.REFUSED
        assert "TOKEN_INVALID" in one_error_line(wrong_token)
        no_token = run(
            "participant",
            "status",
            "--address",
            address,
            env={k: v for k, v in ENV.items() if k != "ROLLOUT_CHECKPOINT_TOKEN"},
        )
        assert no_token.returncode == ExitCode.USAGE
        assert "no token" in one_error_line(no_token)
        # participant status shows every field, false ones too
        status = json.loads(cli("participant", "status", "--address", address).stdout)
        assert status["admission_open"] is True and status["restored_pending"] == 0
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{closed.getsockname()[1]}"
    unreachable = cli("participant", "status", "--address", gone)
    assert unreachable.returncode == ExitCode.UNREACHABLE
    assert "PARTICIPANT_UNREACHABLE" in one_error_line(unreachable)


def test_inspect_says_what_a_directory_is(tmp_path: Path) -> None:
    missing = cli("inspect", str(tmp_path / "nowhere"))
    assert missing.returncode == ExitCode.USAGE
    assert "no such directory" in one_error_line(missing)
    with real_fleet(tmp_path) as fleet:
        taken = cli("checkpoint", "--fleet", str(fleet.fleet_file), "ckpt-i")
        assert taken.returncode == 0, taken.stderr
        address = fleet.servers["counter"].announced["grpc"]
        assert cli("participant", "prepare", "--address", address, "p1").returncode == 0
        commit_dir = tmp_path / "commit-only"
        assert (
            cli(
                "participant", "commit", "--address", address, "p1", "--dir", str(commit_dir)
            ).returncode
            == 0
        )
        assert cli("participant", "resume", "--address", address, "p1").returncode == 0
    root = cli("inspect", str(fleet.root))
    assert root.returncode == 0, root.stderr
    assert "LATEST names ckpt-i" in root.stdout and "checkpoint ckpt-i  (verified)" in root.stdout
    participant_only = cli("inspect", str(commit_dir))
    assert participant_only.returncode == ExitCode.USAGE
    assert "never published" in one_error_line(participant_only)
    assert "resources/counter" in participant_only.stderr


# -- interrupts ------------------------------------------------------------------------------


def hold_a_request(fleet: RealFleet) -> socket.socket:
    """A tool call of a live session whose body is withheld: Prepare waits for it."""
    with httpx.Client(base_url=fleet.http("counter")) as client:
        assert client.post("/ng-rollout/h-a1/seed_session", json={"initial_count": 1}).is_success
        cookie = "; ".join(f"{k}={v}" for k, v in client.cookies.items())
    host, port = fleet.servers["counter"].announced["http"].rsplit(":", 1)
    held = socket.create_connection((host, int(port)))
    held.sendall(
        (
            "POST /ng-rollout/h-a1/increment_counter HTTP/1.1\r\nHost: t\r\n"
            f"Cookie: {cookie}\r\nContent-Type: application/json\r\nContent-Length: 20\r\n\r\n"
        ).encode()
    )
    deadline = time.monotonic() + 30
    while (
        json.loads(cli("status", "--fleet", str(fleet.fleet_file), "--json").stdout)["members"][0][
            "counts"
        ].get("inflight", 0)
        < 1
    ):
        assert time.monotonic() < deadline, "the held request never arrived"
        time.sleep(0.05)
    return held


def members(fleet: RealFleet) -> list[dict[str, object]]:
    status = cli("status", "--fleet", str(fleet.fleet_file), "--json")
    assert status.returncode == 0, status.stdout + status.stderr
    listed: list[dict[str, object]] = json.loads(status.stdout)["members"]
    return listed


@pytest.mark.parametrize(
    ("signum", "code"),
    [(signal.SIGINT, ExitCode.INTERRUPTED), (signal.SIGTERM, ExitCode.TERMINATED)],
)
def test_a_signal_mid_prepare_aborts_the_checkpoint_and_every_member_is_open(
    tmp_path: Path, signum: int, code: int
) -> None:
    with real_fleet(tmp_path) as fleet:
        held = hold_a_request(fleet)
        with held:
            process = subprocess.Popen(
                [*CLI, "checkpoint", "--fleet", str(fleet.fleet_file), "--json", "ckpt-held"],
                env=ENV,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            assert process.stdout is not None
            # Wait until the counter is PREPARING, waiting on the held call.
            for line in process.stdout:
                update = json.loads(line)
                states = {m["name"]: m["state"] for m in update.get("members", [])}
                if states.get("counter") == "PREPARING":
                    break
            process.send_signal(signum)
            _, stderr = process.communicate(timeout=60)
            assert process.returncode == code, stderr
            assert "Traceback" not in stderr
            assert stderr.strip().splitlines() == [
                f"rollout-checkpoint: interrupted by {signal.Signals(signum).name}: aborted "
                "ckpt-held; all 2 members resumed (admission open)"
            ]
            after = members(fleet)
            assert all(m["state"] == "IDLE" and m["admission_open"] for m in after), after
            assert not (fleet.root / "ckpt-held" / "checkpoint.json").exists()


def test_the_conflict_refusal_names_the_active_checkpoint(tmp_path: Path) -> None:
    with real_fleet(tmp_path) as fleet:
        address = fleet.servers["counter"].announced["grpc"]
        assert cli("participant", "prepare", "--address", address, "someone-else").returncode == 0
        refused = cli("checkpoint", "--fleet", str(fleet.fleet_file), "mine")
        assert refused.returncode == ExitCode.REFUSED
        assert "CHECKPOINT_CONFLICT" in refused.stderr
        assert "active checkpoint: someone-else" in refused.stderr
        assert cli("resume", "--fleet", str(fleet.fleet_file), "someone-else").returncode == 0


# -- output ----------------------------------------------------------------------------------


def test_checkpoint_prints_one_summary_line_and_status_shows_an_unreachable_member(
    tmp_path: Path,
) -> None:
    with real_fleet(tmp_path) as fleet:
        httpx.post(fleet.http("counter") + "/ng-rollout/r1/seed_session", json={"initial_count": 1})
        taken = cli("checkpoint", "--fleet", str(fleet.fleet_file), "ckpt-s")
        assert taken.returncode == 0, taken.stderr
        (line,) = taken.stdout.strip().splitlines()
        assert line.startswith(
            f"published ckpt-s at {fleet.root / 'ckpt-s'}: 2 members, 1 episodes"
        )
        assert "prepare" in line and "total" in line
        resumed = cli("resume", "--fleet", str(fleet.fleet_file), "ckpt-s")
        assert resumed.stdout.strip() == "resumed ckpt-s: 2 of 2 members open"
        long_name = "a-member-whose-row-is-far-wider-than-eighty-columns"
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            gone = f"127.0.0.1:{closed.getsockname()[1]}"
        fleet.fleet_file.write_text(
            fleet.fleet_file.read_text()
            + f'[[participants]]\nname = "{long_name}"\naddress = "{gone}"\n'
        )
        status = cli("status", "--fleet", str(fleet.fleet_file))
        assert status.returncode == ExitCode.UNREACHABLE
        assert long_name in status.stdout  # off a terminal: never truncated
        assert "…" not in status.stdout
        rows = [row for row in status.stdout.splitlines() if row.startswith("│")]
        assert len(rows) == 3 and "unreachable" in rows[2]
        assert all("open" in row and "yes" in row for row in rows[:2])


def test_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    with real_fleet(tmp_path) as fleet:
        address = fleet.servers["counter"].announced["grpc"]
        with httpx.Client(base_url=fleet.http("counter")) as client:
            for index in range(300):
                client.cookies.clear()
                client.post(f"/ng-rollout/p{index}/seed_session", json={"initial_count": 1})
        piped = subprocess.run(
            f"{' '.join(CLI)} participant episodes --address {address} | head -1",
            shell=True,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert piped.stdout.count("\n") == 1
        assert piped.stderr == "", piped.stderr


# -- help ------------------------------------------------------------------------------------


def verbs() -> dict[str, object]:
    import argparse

    parser = cli_module._parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_verb_has_help_with_an_example_and_the_exit_codes() -> None:
    for verb in verbs():
        args = [verb, "--help"] if verb != "participant" else [verb, "commit", "--help"]
        completed = run(*args)
        assert completed.returncode == 0, verb
        assert "exit codes:" in completed.stdout, verb
        for code, meaning in EXIT_CODE_MEANINGS.items():
            assert f"{int(code):>3}  {meaning}" in completed.stdout, (verb, code)
        if verb not in ("demo", "serve"):
            assert "example:" in completed.stdout, verb
    restore = " ".join(run("restore", "--help").stdout.split())
    assert "this restore operation" in restore and "--episode: a rollout id" in restore
    assert "(default: 120.0)" in restore


def test_top_level_help_lists_every_served_kind_and_version() -> None:
    assert {name for name, _ in cli_module.SERVED_KINDS} == set(serve.KINDS)
    top = run("--help").stdout
    for name in serve.KINDS:
        assert name in top
    assert run("--version").stdout.startswith("rollout-checkpoint ")


def test_serve_imports_nothing_from_the_working_directory(tmp_path: Path) -> None:
    """`serve` runs from any directory, even one holding a folder named like a package it
    imports (here uvicorn; run from our checkout, `benchmarks/` would hide nemo-gym's)."""
    shadow = tmp_path / "uvicorn"
    shadow.mkdir()
    (shadow / "__init__.py").write_text('raise ImportError("the uvicorn of the working directory")')
    completed = subprocess.run(
        [*CLI, "serve", "--help"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    assert "nemo-gym:indirect_prompt_injection" in completed.stdout


def test_the_health_verb_answers_without_a_token(tmp_path: Path) -> None:
    with real_fleet(tmp_path, start_closed=True) as fleet:
        address = fleet.servers["counter"].announced["grpc"]
        env = {k: v for k, v in ENV.items() if k != "ROLLOUT_CHECKPOINT_TOKEN"}
        closed = run("health", "--address", address, env=env)
        assert closed.returncode == ExitCode.REFUSED
        assert "participant-readiness: NOT_SERVING" in closed.stdout
        assert cli("resume", "--fleet", str(fleet.fleet_file), "open-1").returncode == 0
        opened = run("health", "--address", address, "--json", env=env)
        assert opened.returncode == 0
        assert set(json.loads(opened.stdout)["services"].values()) == {"SERVING"}
        rows = members(fleet)
        assert all(m["ready"] and m["readiness_health"] == "SERVING" for m in rows)
