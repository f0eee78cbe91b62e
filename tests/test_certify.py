"""`rollout-checkpoint certify` on the example fleet: every check holds, and the report says so.

The verb runs as the user runs it (a process, the example fleet file moved to free ports, a
tasks file of the shipped prompt-injection tasks): it discovers the fleet, runs the baseline
twice, then a seeded plan of trials whose five faults are the five kinds, each recovered by the
product's own paths. The report must say every check held, name every member with its kind,
fill the matrix cells its trials reached, and give each trial the command that reruns it; that
command (`--only N`) must rerun exactly that trial. A fleet certify cannot run is refused with
one line and exit 2 before any process starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollout_checkpoint.client.certify.findings import REPORT_FORMAT, Fault
from rollout_checkpoint.client.certify.plan import plan_trials
from rollout_checkpoint.client.cli.console import ExitCode

from .certify_fleet import example_fleet, load, tasks_file
from .conftest import TOKEN
from .test_fleet_launch import write_fleet

CLI = [sys.executable, "-m", "rollout_checkpoint.client.cli.main"]
ENV = dict(os.environ, ROLLOUT_CHECKPOINT_TOKEN=TOKEN, GRPC_VERBOSITY="ERROR")
RUN_SECONDS = 600
SEED = 63
TRIALS = 5
"""`--seed 63 --trials 5` on the example fleet's five members draws one trial of each fault
kind, at five different phases (`test_the_plan_covers_every_fault_kind` holds it to that)."""
MEMBERS = ["environment", "policy_model", "agent", "prompt_injection", "counter"]
KINDS = {
    "environment": "environment",
    "policy_model": "policy_model",
    "agent": "agent",
    "prompt_injection": "resources",
    "counter": "resources",
}


def certify(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "certify", *args],
        env=ENV,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=RUN_SECONDS,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def certified(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One certify run of the example fleet (the tests below read what it left)."""
    work = tmp_path_factory.mktemp("certify")
    fleet, _ = example_fleet(work)
    tasks = tasks_file(work)
    report = work / "report"
    args = ["--fleet", str(fleet), "--tasks", str(tasks), "--trials", str(TRIALS)]
    args += ["--seed", str(SEED), "--report", str(report), "--json"]
    completed = certify(*args, cwd=work)
    return {"completed": completed, "report": report, "work": work, "fleet": fleet}


def test_the_plan_covers_every_fault_kind() -> None:
    plans = plan_trials(SEED, TRIALS, MEMBERS)
    assert {plan.fault for plan in plans} == set(Fault)
    assert len({plan.phase for plan in plans}) == TRIALS


def test_every_check_holds_on_the_example_fleet(certified: dict[str, Any]) -> None:
    completed = certified["completed"]
    assert completed.returncode == ExitCode.OK, completed.stderr[-4000:]
    summary = json.loads(completed.stdout.strip().splitlines()[-1])
    assert summary["exit_code"] == 0
    report = json.loads(Path(summary["report"]).read_text())
    assert report["format"] == REPORT_FORMAT
    assert report["verdict"] == "held", report["findings"]
    assert report["findings"] == []
    assert {s["name"]: s["kind"] for s in report["servers"]} == KINDS
    assert report["baseline"]["rollouts"] == 6
    assert report["baseline"]["concurrencies"] == [4, 1]
    assert len(report["trials"]) == TRIALS
    held = [t for t in report["trials"] if t["outcome"] == "held"]
    assert len(held) >= TRIALS - 1, [(t["fault"], t["phase"], t["note"]) for t in report["trials"]]
    for trial in report["trials"]:
        assert report["matrix"][trial["fault"]][trial["phase"]] == trial["outcome"]
        assert trial["command"].endswith(f"--only {trial['number']}")
    assert report["trials_per_minute"] > 0
    html = (certified["report"] / "report.html").read_text()
    assert "held" in html and "://" not in html
    assert "every check held" in completed.stderr


def test_the_trials_checkpoints_are_restored_into_one_bench_fleet(
    certified: dict[str, Any],
) -> None:
    """Every trial's published checkpoints go into one start-closed fleet in turn, restored
    in place, not into a fleet started per trial: a fleet's start is most of a trial's cost."""
    work = certified["report"] / "work"
    report = json.loads((certified["report"] / "report.json").read_text())
    assert report["verdict"] == "held", report["findings"]
    assert sorted(p.name for p in (work / "restore-bench").iterdir()) == ["fleet-1"]
    assert list(work.glob("trial-*/logs/restore")) == []


@pytest.mark.slow  # a second certify run (baseline twice + a trial); `-m slow` runs it
def test_only_reruns_exactly_that_trial(certified: dict[str, Any]) -> None:
    report = json.loads((certified["report"] / "report.json").read_text())
    first = report["trials"][1]
    rerun = certified["work"] / "rerun"
    command = first["command"].split()
    assert command[:2] == ["rollout-checkpoint", "certify"]
    arguments = command[2:]
    arguments[arguments.index("--report") + 1] = str(rerun)
    completed = certify(*arguments, cwd=certified["work"])
    assert completed.returncode == ExitCode.OK, completed.stderr[-4000:]
    again = json.loads((rerun / "report.json").read_text())
    (trial,) = again["trials"]
    same = ("number", "fault", "phase", "target", "trigger", "checkpoint", "moment")
    assert {k: trial[k] for k in same} == {k: first[k] for k in same}


def test_a_member_without_a_command_is_refused_before_anything_starts(tmp_path: Path) -> None:
    fleet, _ = example_fleet(tmp_path)
    members = load(fleet).members
    participants = [
        {"name": m.name, "address": m.address, **({"command": list(m.command)} if i else {})}
        for i, m in enumerate(members)
    ]
    bare = write_fleet(tmp_path / "bare.toml", participants)
    tasks = tasks_file(tmp_path, 2)
    completed = certify("--fleet", str(bare), "--tasks", str(tasks), cwd=tmp_path)
    assert completed.returncode == ExitCode.USAGE
    (line,) = completed.stderr.strip().splitlines()
    assert "environment" in line and "command" in line
    assert not (tmp_path / "certify-report" / "work" / "discover").exists()


def test_a_missing_tasks_file_is_refused(tmp_path: Path) -> None:
    fleet, _ = example_fleet(tmp_path)
    completed = certify(
        "--fleet", str(fleet), "--tasks", str(tmp_path / "none.jsonl"), cwd=tmp_path
    )
    assert completed.returncode == ExitCode.USAGE
    (line,) = completed.stderr.strip().splitlines()
    assert "none.jsonl" in line


def test_a_member_that_cannot_start_ends_the_run_with_one_line_and_exit_5(tmp_path: Path) -> None:
    fleet, _ = example_fleet(tmp_path)
    members = load(fleet).members
    participants = [
        {"name": m.name, "address": m.address, "command": list(m.command)} for m in members
    ]
    participants[0]["command"] = [str(tmp_path / "no-such-server")]
    broken = write_fleet(tmp_path / "broken.toml", participants)
    tasks = tasks_file(tmp_path, 2)
    completed = certify("--fleet", str(broken), "--tasks", str(tasks), cwd=tmp_path)
    assert completed.returncode == ExitCode.UNREACHABLE, completed.stderr
    (line,) = completed.stderr.strip().splitlines()
    assert "environment" in line and "no-such-server" in line
    assert "Traceback" not in completed.stderr


def test_a_baseline_whose_rollouts_fail_is_refused_in_one_line(tmp_path: Path) -> None:
    """Every task names a resources server the agent does not know: each rollout fails
    without any fault, so there is no baseline to hold trials to. Refused with exit 2 and one
    line saying why, not certify's traceback."""
    fleet, _ = example_fleet(tmp_path)
    tasks = tasks_file(tmp_path, 2)
    rows = [json.loads(line) for line in tasks.read_text().splitlines()]
    tasks.write_text("".join(json.dumps({**r, "resources_server": "nowhere"}) + "\n" for r in rows))
    completed = certify("--fleet", str(fleet), "--tasks", str(tasks), "--trials", "1", cwd=tmp_path)
    assert completed.returncode == ExitCode.USAGE, completed.stderr[-4000:]
    assert "Traceback" not in completed.stderr
    last = completed.stderr.strip().splitlines()[-1]
    assert "baseline" in last and "unknown_server" in last and "fix the fleet" in last, last
