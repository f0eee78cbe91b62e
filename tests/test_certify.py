"""`rollout-checkpoint certify` on the example fleet: every check holds, and the report says so.

The verb runs as the user runs it (a process, the example fleet file moved to free ports, a
tasks file of the shipped prompt-injection tasks): it discovers the fleet, runs the baseline
twice, then a seeded plan of trials whose five faults are the five kinds, each recovered by the
product's own paths. The report must say every check held, name every member with its kind,
fill the matrix cells its trials reached, and give each trial the command that reruns it; that
command (`--only N`) must rerun exactly that trial. A fleet certify cannot run is refused with
one line and exit 2 before any process starts.

The same run, SIGTERMed once its third trial is journaled (restore checks every two trials,
so two trials are decided then and one only ran) and resumed with `--resume`, must write the
report the uninterrupted run wrote, verdict for verdict, without running a decided trial
again; a resume of another run (other flags, fleet or tasks), or a run that would overwrite
an unfinished one, is refused in one line with exit 2, and nothing is overwritten.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rollout_checkpoint.client.certify.findings import REPORT_FORMAT, Fault
from rollout_checkpoint.client.certify.plan import plan_trials
from rollout_checkpoint.client.cli.console import ExitCode
from rollout_checkpoint.client.fleet.ports import ephemeral_range

from .certify_fleet import example_fleet, load, tasks_file
from .conftest import TOKEN
from .processes import REPO
from .test_fleet_launch import write_fleet

CLI = [sys.executable, "-m", "rollout_checkpoint.client.cli.main"]
ENV = dict(os.environ, ROLLOUT_CHECKPOINT_TOKEN=TOKEN, GRPC_VERBOSITY="ERROR")
RUN_SECONDS = 600
SEED = 63
TRIALS = 5
"""`--seed 63 --trials 5` on the example fleet's five members draws one trial of each fault
kind, at five different phases (`test_the_plan_covers_every_fault_kind` holds it to that)."""
MEMBERS = ["environment", "policy_model", "agent", "prompt_injection", "counter"]
RESUME_BATCH = 2
"""The interrupted run's restore checks go every two trials (`tests/certify_batches.py`)."""
INTERRUPT_AFTER = 3
"""The interrupted run is SIGTERMed once trial 3 is journaled: trials 1 and 2 are decided
(their batch restore-checked), trial 3 only ran (its batch's restore check is pending)."""
PLAN_FIELDS = ("number", "fault", "phase", "target", "trigger", "checkpoint", "moment")
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


def test_a_member_on_an_ephemeral_port_is_noted_before_the_run(tmp_path: Path) -> None:
    """Certify restarts members on their fleet-file addresses; one inside the kernel's
    ephemeral range may be taken by any outgoing connection while its member is down (a
    replacement that cannot listen ends the run). Noted, naming the member and address,
    before anything starts; the run itself goes on (here: to a member that cannot start)."""
    fleet, _ = example_fleet(tmp_path)
    members = load(fleet).members
    participants = [
        {"name": m.name, "address": m.address, "command": list(m.command)} for m in members
    ]
    risky = f"127.0.0.1:{ephemeral_range()[0] + 7}"
    participants[1]["address"] = risky
    participants[0]["command"] = [str(tmp_path / "no-such-server")]
    noted = write_fleet(tmp_path / "noted.toml", participants)
    tasks = tasks_file(tmp_path, 2)
    completed = certify("--fleet", str(noted), "--tasks", str(tasks), cwd=tmp_path)
    assert completed.returncode == ExitCode.UNREACHABLE, completed.stderr
    # (the live progress line, transient, leaves an empty line behind it)
    note, line = [text for text in completed.stderr.splitlines() if text.strip()]
    assert note.startswith("note: ") and participants[1]["name"] in note and risky in note
    assert "no-such-server" in line


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


# -- an interrupted run, resumed ------------------------------------------------------------


def run_arguments(fleet: Path, tasks: Path, report: Path, *more: str) -> list[str]:
    """The `certified` run's flags, for another fleet file and report directory."""
    args = ["--fleet", str(fleet), "--tasks", str(tasks), "--trials", str(TRIALS)]
    return [*args, "--seed", str(SEED), "--report", str(report), *more]


def journal_files(report: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((report / "journal").iterdir())}


def journaled(report: Path, number: int) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((report / "journal" / f"trial-{number}.json").read_text())
    return document


def run_identity(report: Path, number: int) -> tuple[int, int]:
    """(inode, mtime) of trial `number`'s first collector log: a trial run again gets a new
    folder (`baseline.run_directory`), and with it a new log."""
    status = (report / "work" / f"trial-{number}" / "collect.1.log").stat()
    return status.st_ino, status.st_mtime_ns


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The `certified` run on a fleet of its own, restore-checked every `RESUME_BATCH`
    trials, SIGTERMed once trial `INTERRUPT_AFTER` is journaled (what it left is read by
    the tests below; `resumed` then resumes it)."""
    work = tmp_path_factory.mktemp("certify-interrupted")
    fleet, _ = example_fleet(work)
    tasks = tasks_file(work)
    report = work / "report"
    command = [sys.executable, "-m", "tests.certify_batches", str(RESUME_BATCH), "certify"]
    process = subprocess.Popen(
        [*command, *run_arguments(fleet, tasks, report)],
        env=ENV,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    trigger = report / "journal" / f"trial-{INTERRUPT_AFTER}.json"
    deadline = time.monotonic() + RUN_SECONDS
    while not trigger.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=RUN_SECONDS)
    return {
        "returncode": process.returncode,
        "stdout": stdout,
        "stderr": stderr,
        "work": work,
        "fleet": fleet,
        "tasks": tasks,
        "report": report,
        "journal": journal_files(report),
        "runs": {n: run_identity(report, n) for n in range(1, INTERRUPT_AFTER + 1)},
    }


@pytest.fixture(scope="module")
def resumed(interrupted: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    args = run_arguments(interrupted["fleet"], interrupted["tasks"], interrupted["report"])
    return certify(*args, "--resume", "--json", cwd=interrupted["work"])


def test_a_stopped_run_keeps_what_it_decided_and_prints_the_resume_command(
    interrupted: dict[str, Any],
) -> None:
    assert interrupted["returncode"] == ExitCode.TERMINATED, interrupted["stderr"][-4000:]
    last = interrupted["stderr"].strip().splitlines()[-1]
    assert "interrupted by SIGTERM" in last, last
    assert f"2 of {TRIALS} trials decided" in last and "1 more ran" in last, last
    resume = last[last.index("resume: ") + len("resume: ") :]
    assert resume.startswith("rollout-checkpoint certify ") and resume.endswith(" --resume")
    assert f"--seed {SEED}" in resume and f"--report {interrupted['report']}" in resume
    assert not (interrupted["report"] / "report.json").exists()
    report = interrupted["report"]
    assert [journaled(report, n)["restore_checked"] for n in (1, 2, 3)] == [True, True, False]
    # A decided trial's checkpoint root may go; one whose restore check is pending stays.
    assert (report / "work" / "trial-3" / "checkpoints" / "LATEST").exists()


@pytest.mark.parametrize("change", ["seed", "trials", "fleet", "tasks"])
def test_a_resume_of_another_run_is_refused_and_overwrites_nothing(
    interrupted: dict[str, Any], tmp_path: Path, change: str
) -> None:
    report = tmp_path / "report"
    shutil.copytree(interrupted["report"] / "journal", report / "journal")
    fleet, tasks = interrupted["fleet"], interrupted["tasks"]
    if change == "fleet":
        fleet = tmp_path / "fleet.toml"
        fleet.write_text(interrupted["fleet"].read_text() + "# edited\n")
    if change == "tasks":
        tasks = tmp_path / "tasks.jsonl"
        tasks.write_text("".join(interrupted["tasks"].read_text().splitlines(True)[:-1]))
    args = run_arguments(fleet, tasks, report)
    if change in ("seed", "trials"):
        args[args.index(f"--{change}") + 1] = "7"
    completed = certify(*args, "--resume", cwd=tmp_path)
    assert completed.returncode == ExitCode.USAGE, completed.stderr[-4000:]
    (line,) = completed.stderr.strip().splitlines()
    said = {
        "seed": f"--seed {SEED} there, 7 here",
        "trials": f"--trials {TRIALS} there, 7 here",
        "fleet": "the fleet file changed",
        "tasks": "the tasks file changed",
    }[change]
    assert said in line and "another certification" in line, line
    assert journal_files(report) == interrupted["journal"]
    assert sorted(p.name for p in report.iterdir()) == ["journal"]


@pytest.mark.parametrize(
    "flags", [[], ["--only", "4"], ["--resume", "--only", "4"]], ids=["new", "only", "both"]
)
def test_a_run_that_would_overwrite_an_unfinished_one_is_refused(
    interrupted: dict[str, Any], tmp_path: Path, flags: list[str]
) -> None:
    report = tmp_path / "report"
    shutil.copytree(interrupted["report"] / "journal", report / "journal")
    args = run_arguments(interrupted["fleet"], interrupted["tasks"], report)
    completed = certify(*args, *flags, cwd=tmp_path)
    assert completed.returncode == ExitCode.USAGE, completed.stderr[-4000:]
    (line,) = completed.stderr.strip().splitlines()
    assert "--resume" in line, line
    assert journal_files(report) == interrupted["journal"]
    assert sorted(p.name for p in report.iterdir()) == ["journal"]


def test_a_resume_with_nothing_to_resume_is_refused(
    interrupted: dict[str, Any], tmp_path: Path
) -> None:
    report = tmp_path / "report"
    args = run_arguments(interrupted["fleet"], interrupted["tasks"], report)
    completed = certify(*args, "--resume", cwd=tmp_path)
    assert completed.returncode == ExitCode.USAGE, completed.stderr[-4000:]
    (line,) = completed.stderr.strip().splitlines()
    assert "nothing to resume" in line, line
    assert not report.exists()


def test_the_resumed_run_reports_what_the_uninterrupted_run_reported(
    certified: dict[str, Any],
    interrupted: dict[str, Any],
    resumed: subprocess.CompletedProcess[str],
) -> None:
    assert resumed.returncode == ExitCode.OK, resumed.stderr[-4000:]
    report = interrupted["report"]
    combined = json.loads((report / "report.json").read_text())
    uninterrupted = json.loads((certified["report"] / "report.json").read_text())
    assert combined["verdict"] == uninterrupted["verdict"] == "held", combined["findings"]
    assert combined["findings"] == uninterrupted["findings"] == []
    assert [{k: t[k] for k in PLAN_FIELDS} for t in combined["trials"]] == [
        {k: t[k] for k in PLAN_FIELDS} for t in uninterrupted["trials"]
    ]
    # Held or not reached (a moment that came too late on a loaded machine), never violated,
    # in both runs alike; the matrix and summary are drawn from the trials by one function.
    for ours, theirs in zip(combined["trials"], uninterrupted["trials"], strict=True):
        assert "violated" not in (ours["outcome"], theirs["outcome"])
        assert ours["command"] == f"{combined['command']} --only {ours['number']}"
    assert combined["baseline"]["rollouts"] == uninterrupted["baseline"]["rollouts"]
    assert combined["servers"] == uninterrupted["servers"]
    assert (report / "report.html").exists()
    # Trials 1 and 2 (decided) and 3 (ran, restore pending) were not run again.
    assert {n: run_identity(report, n) for n in (1, 2, 3)} == interrupted["runs"]
    assert all(journaled(report, n)["restore_checked"] for n in range(1, TRIALS + 1))
    assert list((report / "work").glob("trial-*/checkpoints")) == []
