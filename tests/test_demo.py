"""The demo, end to end, as a user runs it: real processes, SIGKILL, restore, continue."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def demo(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout_checkpoint.client.cli",
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
    return completed.returncode, json.loads(completed.stdout or "{}"), completed.stderr[-3000:]


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
    code, report, _ = demo(
        tmp_path,
        "--rollouts",
        "8",
        "--concurrency",
        "8",
        "--checkpoint-after",
        "1",
        "--skip-resources-restore",
    )
    assert code == 1 and not report["passed"]
    assert not report["checks"]["trajectories_equal_baseline"]
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
            "rollout_checkpoint.client.cli",
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
