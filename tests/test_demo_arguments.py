"""The demo's fleet processes: command lines that survive any token (a random token may start
with '-'), and a kill order that leaves no caller to outlive its callee."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rollout_checkpoint.examples import demo
from rollout_checkpoint.examples.demo import FleetProcesses, Server, serve_options
from rollout_checkpoint.examples.demo import fleet as demo_fleet
from rollout_checkpoint.examples.serve import parse_args


@pytest.mark.parametrize("token", ["-leading-dash", "--double", "plain"])
@pytest.mark.parametrize("start_closed", [False, True])
def test_every_token_reaches_the_server_unchanged(token: str, start_closed: bool) -> None:
    args = parse_args(["counter", *serve_options(token, start_closed=start_closed)])
    assert args.token == token and args.start_closed is start_closed


def test_a_killed_fleet_dies_callers_first(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A caller that outlived its callee would log a traceback no real crash shows."""
    fleet = FleetProcesses("t")
    for name in ("prompt_injection", "policy_model", "agent", "environment"):
        process = subprocess.Popen(["sleep", "60"], start_new_session=True, text=True)
        fleet.servers[name] = Server(name, "k", process, "", "", tmp_path / name)
    order: list[str] = []
    signal_group = demo_fleet.signal_group

    def recording(process: subprocess.Popen[str], signum: int) -> None:
        order.append(next(n for n, s in fleet.servers.items() if s.process is process))
        assert all(fleet.servers[n].process.poll() is not None for n in order[:-1])
        signal_group(process, signum)

    monkeypatch.setattr(demo_fleet, "signal_group", recording)
    fleet.kill()
    assert order == ["environment", "agent", "policy_model", "prompt_injection"]


async def test_workers_reach_the_resources_agent_and_environment_servers_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`demo --workers N`: each resources, agent and environment server gets `--workers N`,
    the policy model (which cannot have several) none."""
    started: dict[str, list[str]] = {}

    def launch(label: str, logs: Path, name: str, kind: str, args: list[str]) -> Server:
        started[name] = args
        process = subprocess.Popen(["true"], text=True)
        process.wait()
        return Server(name, kind, process, "127.0.0.1:1", "127.0.0.1:2", logs / name, args)

    monkeypatch.setattr(demo_fleet, "launch_server", launch)
    options = demo.parse_args(["--workers", "3"])
    assert options.workers == 3
    await demo.start_fleet("first", tmp_path, "token", options, start_closed=False)
    for name in ("prompt_injection", "counter", "agent", "environment"):
        assert parse_args(started[name]).workers == 3, name
    assert parse_args(started["policy_model"]).workers == 1
