"""The demo, end to end, as a user runs it: real processes, SIGKILL, restore, continue."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

LATENCY = "0.1"
"""Seconds per scripted model call. The cut comes once the first rollout finished; the
rollouts one model call longer (16 of the 24) finish about one call later, so the cut finds
them in flight only if the controller closes the fleet within about one call's time. That
stays a race with the machine's speed (the demo has no gate to hold them): at 0.05 s (the
demo's default) about 85 runs on a heavily loaded machine had 17-23 in flight at the cut;
twice the call time doubles that margin at no measurable cost in run time."""


def demo(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout_checkpoint.client.cli.main",
            "demo",
            *args,
            "--output-dir",
            str(tmp_path / "demo"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, GRPC_VERBOSITY="ERROR"),
    )
    # Without its JSON report the demo crashed: say how, instead of a KeyError later.
    assert completed.stdout, (
        f"the demo printed no report (exit {completed.returncode}):\n{completed.stderr[-6000:]}"
    )
    return completed.returncode, json.loads(completed.stdout), completed.stderr[-3000:]


def test_sixteen_episodes_continue_after_sigkill_and_again_after_a_second_crash(
    tmp_path: Path,
) -> None:
    code, report, stderr = demo(
        tmp_path,
        "--rollouts",
        "24",
        "--concurrency",
        "24",
        "--checkpoint-after",
        "1",
        "--latency",
        LATENCY,
        "--crash-twice",
    )
    assert code == 0, (report, stderr)
    assert report["passed"], report["problems"]
    numbers = report["numbers"]
    assert numbers["in_flight_at_checkpoint"] >= 16
    assert numbers["restarted"] == 0 and numbers["retired"] == 0
    assert (
        numbers["continued"] + numbers["finished_during_checkpoint"]
        == numbers["in_flight_at_checkpoint"]
    )
    assert numbers["mean_reward"] == numbers["baseline_mean_reward"]
    for check in (
        "trajectories_equal_baseline",
        "continued_from_checkpointed_calls",
        "second_checkpoint_matches_first",
        "exports_differ_only_where_state_changed",
        "no_traceback_in_server_logs",
    ):
        assert report["checks"][check], check
    trajectories = json.loads((tmp_path / "demo" / "trajectories.json").read_text())
    attempts = {t["continued"]["attempt"] for t in trajectories.values()}
    assert 2 in attempts  # continued after the second crash as attempt N+2
    logs = list((tmp_path / "demo" / "logs").glob("*.log"))
    assert len(logs) == 20  # four generations of five servers


def test_negative_control_without_the_resources_restore_fails(tmp_path: Path) -> None:
    # As many rollouts at once as above: the checkpoint must cut many of them mid-episode
    # (holding resources sessions) for the missing restore to break anything. With 8, all of
    # them often finished before the cut on a loaded machine, and the control then passed.
    code, report, stderr = demo(
        tmp_path,
        "--rollouts",
        "24",
        "--concurrency",
        "24",
        "--checkpoint-after",
        "1",
        "--latency",
        LATENCY,
        "--skip-resources-restore",
    )
    assert report["numbers"]["in_flight_at_checkpoint"] >= 16, report["numbers"]
    assert code == 1 and not report["passed"], (report, stderr)
    # The rollouts whose sessions were not restored fail (their resources server answers
    # `no_session`, which the agent and the environment pass on as a failure): no reply.
    assert not report["checks"]["every_rollout_finished"]
    assert not report["checks"]["second_checkpoint_matches_first"]


def test_the_cut_comes_after_checkpoint_after_rollouts_finished(tmp_path: Path) -> None:
    """`--checkpoint-after 4`: the cut begins once exactly 4 finished (plus at most the ones
    in flight that finished in the same moment), never after the first."""
    concurrency = 3
    code, report, stderr = demo(
        tmp_path, "--rollouts", "10", "--concurrency", str(concurrency), "--checkpoint-after", "4"
    )
    # Only the cut is checked here (the whole demo passing is the test above).
    assert code in (0, 1) and report["checks"].get("demo_completed", True), (report, stderr)
    numbers = report["numbers"]
    assert 4 <= numbers["finished_when_the_cut_began"] <= 4 + concurrency - 1, numbers
    # Rollouts in flight at the cut may still finish before the fleet is prepared.
    assert numbers["finished_when_the_cut_began"] <= numbers["finished_before_checkpoint"]
    assert numbers["finished_before_checkpoint"] <= 4 + concurrency, numbers


def test_the_narrative_agrees_with_the_report(tmp_path: Path) -> None:
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout_checkpoint.client.cli.main",
            "demo",
            "--rollouts",
            "12",
            "--concurrency",
            "12",
            "--checkpoint-after",
            "2",
            "--output-dir",
            str(tmp_path / "demo"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, GRPC_VERBOSITY="ERROR", COLUMNS="400"),
    )
    assert completed.returncode in (0, 1), completed.stderr[-3000:]
    numbers = json.loads((tmp_path / "demo" / "report.json").read_text())["numbers"]
    narrative = completed.stderr
    assert f"continuing {numbers['continued']} rollouts as attempt 1" in narrative, narrative
    if numbers["finished_during_checkpoint"]:
        assert f"({numbers['finished_during_checkpoint']} more finished" in narrative


def test_the_continuation_checks_pass_with_asynchronous_commits(tmp_path: Path) -> None:
    """`--async-commit`: every member answers at its snapshot and the parts are awaited
    before publishing; the second checkpoint resumes the restored fleet before its parts are
    durable, and they must still match the first byte for byte."""
    code, report, stderr = demo(
        tmp_path,
        "--rollouts",
        "24",
        "--concurrency",
        "24",
        "--checkpoint-after",
        "1",
        "--latency",
        LATENCY,
        "--async-commit",
    )
    assert code == 0, (report, stderr)
    assert report["passed"], report["problems"]
    numbers = report["numbers"]
    assert numbers["in_flight_at_checkpoint"] >= 16
    assert "durable_ms" in numbers
    assert numbers["mean_reward"] == numbers["baseline_mean_reward"]
    for check in (
        "trajectories_equal_baseline",
        "continued_from_checkpointed_calls",
        "second_checkpoint_matches_first",
        "no_traceback_in_server_logs",
    ):
        assert report["checks"][check], check
