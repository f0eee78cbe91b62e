"""The mutation test of `certify`: each planted bug of examples/faulty/ must be reported.

A certify run that finds nothing on a fleet with a planted checkpointing bug is a failing test.
ONE run of the faulty fleet (moved to free ports) holds every bug at once, each served by a
resources member named after it, beside `honest`, the counter they all start from: it must
exit 9 (violations found), its report.json must name, for each bug, its member, the check that
catches that bug and the first differing JSON path, and no finding may name `honest`: in the
same fleet, under the same faults and tasks, the control holds, so each finding is its bug.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rollout_checkpoint.client.certify.findings import REPORT_FORMAT, Check, Fault, Phase, TrialPlan
from rollout_checkpoint.client.certify.plan import plan_trials
from rollout_checkpoint.client.cli.console import ExitCode

from .conftest import TOKEN
from .faulty_fleets import (
    BUGS,
    FLEET,
    HONEST,
    LOOPBACK_PORT,
    SCRIPTS_PATH,
    TASKS,
    free_port_fleet,
    http_url,
    load,
    member,
)
from .processes import REPO

CLI = [sys.executable, "-m", "rollout_checkpoint.client.cli.main"]
RUN_SECONDS = 900
FAULTY_MODULES = "rollout_checkpoint.examples.faulty"

SEED = 508660
TRIALS = 3
"""`--seed 508660 --trials 3`: on this fleet (members environment, policy_model, agent, then
the six resources members) the plan is three SIGKILLs during the second checkpoint of a
member whose loss leaves every faulty counter running: the policy model once every member
snapshotted, `honest` during publication, the policy model during Prepare. The collector's
in-place recovery then restores `LATEST` (the first checkpoint) into the whole fleet, the
faulty counters rejoining as survivors, and continues the episodes it caught from the
agent's boundary, re-issuing the tool calls made since: what the three trial-found bugs need
(a replacement of the faulty counter itself would hide `restore_not_idempotent`, which only
shows in a process that held the session). Three such trials, not one, so a trial that
restarts the caught episodes from their inputs instead (the product's choice, with its
reason) still leaves others that find the bugs; a mid-step kill (which restarted them in the
measurements) is not among them. `test_the_seed_strikes_where_the_planted_bugs_live` holds
the plan to that."""
CONCURRENCY = 6
"""Rollouts in flight: half the 12 tasks, in the file's order one of each resources member,
so each of the two waves has an episode of every member in flight when a checkpoint cuts it
(episodes of 8 increments, the replayed model answering each call after its latency)."""


@dataclass(frozen=True)
class Expected:
    """What certify must report for one planted bug: one of `found` (check -> the first
    differing paths it may name), by a trial or by the baseline."""

    found: dict[Check, frozenset[str]]
    by_trial: bool
    """Found by a trial (True) or by the baseline (its second pass, the stateless probe)."""


EXPECTED = {
    # The restore forgets `history`: the exported state of a continued rollout's session lost
    # the entries from before the checkpoint, and its first remaining one differs from the
    # baseline's first (every entry is a distinct, growing count). Its verify reply, which
    # reports the state, differs there too (the trajectory check).
    "dropped_field": Expected(
        {
            Check.EXPORTED_STATE_EQUALS_BASELINE: frozenset({"$.history[0]"}),
            Check.TRAJECTORY_EQUALS_BASELINE: frozenset({"$.verify.history[0]"}),
        },
        by_trial=True,
    ),
    # The survivor's rejoin adds the checkpoint's count to the one it kept (and the verify
    # reply reports it).
    "restore_not_idempotent": Expected(
        {
            Check.EXPORTED_STATE_EQUALS_BASELINE: frozenset({"$.count"}),
            Check.TRAJECTORY_EQUALS_BASELINE: frozenset({"$.verify.count"}),
        },
        by_trial=True,
    ),
    # Idle ticks depend on the wall clock: the baseline's two passes export different ones
    # (a server's exported-state difference is the determinism check's first counter-example).
    "background_mutation": Expected(
        {Check.DETERMINISTIC: frozenset({"$.idle_ticks", "$.verify.idle_ticks"})},
        by_trial=False,
    ),
    # Each increment answers the process-wide count: the probe's first replay differs there.
    "hidden_state": Expected(
        {Check.STATELESS_HAS_NO_STATE: frozenset({"$.count"})}, by_trial=False
    ),
    # A replayed increment is in the ledger twice: the verification (which reads the ledger)
    # differs; the tool replies and the exported, in-memory state do not.
    "side_effect_file": Expected(
        {Check.TRAJECTORY_EQUALS_BASELINE: frozenset({"$.verify.count"})}, by_trial=True
    ),
}


CHECKPOINT_PHASES = frozenset({Phase.PREPARE, Phase.AFTER_SNAPSHOT, Phase.PUBLICATION})


def reaches_a_restore_into_the_running_faulty_counters(plan: TrialPlan) -> bool:
    """A SIGKILL, during the second checkpoint (the first is `LATEST` then), of a member that
    is neither a faulty counter nor the environment: the in-place recovery restores `LATEST`
    into the fleet with every faulty counter a survivor and continues episodes from it."""
    return (
        plan.fault is Fault.KILL_MEMBER
        and plan.phase in CHECKPOINT_PHASES
        and plan.checkpoint == 2
        and plan.target not in (*BUGS, "environment")
    )


def members() -> list[str]:
    """The fleet's member names, in its file's order (the order the plan draws from)."""
    return [member.name for member in load(FLEET).members]


def test_the_seed_strikes_where_the_planted_bugs_live() -> None:
    plans = plan_trials(SEED, TRIALS, members())
    assert all(reaches_a_restore_into_the_running_faulty_counters(plan) for plan in plans), plans
    assert set(EXPECTED) == set(BUGS)


def certify(fleet: Path, report: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *CLI,
            "certify",
            "--fleet",
            str(fleet),
            "--tasks",
            str(fleet.parent / TASKS.name),
            "--trials",
            str(TRIALS),
            "--seed",
            str(SEED),
            "--concurrency",
            str(CONCURRENCY),
            "--report",
            str(report),
        ],
        env=dict(os.environ, PATH=SCRIPTS_PATH, ROLLOUT_CHECKPOINT_TOKEN=TOKEN),
        capture_output=True,
        text=True,
        timeout=RUN_SECONDS,
    )


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The one certify run of the faulty fleet: its report.json (it must exit 9)."""
    work = tmp_path_factory.mktemp("certify-faulty")
    run = certify(free_port_fleet(work / "fleet"), work / "report")
    assert run.returncode == ExitCode.VIOLATIONS_FOUND, run.stderr
    found: dict[str, Any] = json.loads((work / "report" / "report.json").read_text())
    assert found["format"] == REPORT_FORMAT and found["verdict"] == "violated"
    return found


@pytest.mark.timeout(RUN_SECONDS + 60)
@pytest.mark.parametrize("bug", BUGS)
def test_certify_reports_the_planted_bug(report: dict[str, Any], bug: str) -> None:
    expected = EXPECTED[bug]
    named = [
        finding
        for finding in report["findings"]
        if finding["server"] == bug and finding["check"] in expected.found
    ]
    assert named, f"no {sorted(expected.found)} finding on {bug}: {report['findings']}"
    assert any(finding["path"] in expected.found[finding["check"]] for finding in named), named
    if expected.by_trial:
        assert any(finding["trial"] in range(1, TRIALS + 1) for finding in named), named
    else:
        assert all(finding in report["baseline"]["findings"] for finding in named), named
        assert all(finding["trial"] is None for finding in named), named
    (row,) = (row for row in report["summary"] if row["server"] == bug)
    assert row["violations"] >= 1


@pytest.mark.timeout(RUN_SECONDS + 60)
def test_certify_finds_nothing_on_the_honest_counter_in_the_same_run(
    report: dict[str, Any],
) -> None:
    """The control: `honest` served the same tasks under the same faults (one trial even
    killed it), and no check failed on it, so each finding above is its planted bug."""
    assert [f for f in report["findings"] if f["server"] == HONEST] == []
    (row,) = (row for row in report["summary"] if row["server"] == HONEST)
    struck = [plan for plan in plan_trials(SEED, TRIALS, members()) if plan.target == HONEST]
    assert row["violations"] == 0 and row["trials"] == len(struck) >= 1


def test_the_faulty_fleet_serves_each_bug_under_its_own_name() -> None:
    """The example fleet's environment, model and agent, then one resources member per
    faulty module and `honest`, each served as a user's app under the name of its module;
    the agent reaches each under that name, each task names one of them, every member has
    tasks, the scripted model follows the tasks beside the file; on ports of its own, so
    the fleet can run beside the example fleet."""
    spec = load(FLEET)
    resources = [*BUGS, HONEST]
    assert [m.name for m in spec.members] == ["environment", "policy_model", "agent", *resources]
    agent = list(member(spec, "agent").command)
    for name in resources:
        served = member(spec, name)
        assert served.command[:2] == ("rollout-checkpoint", "serve")
        module, _, attribute = served.command[2].partition(":")
        assert module == f"{FAULTY_MODULES}.{name}" and attribute.endswith("Counter")
        assert f"{name}={http_url(served)}" in agent
    tasks = [json.loads(line) for line in TASKS.read_text().splitlines()]
    assert sorted({task["resources_server"] for task in tasks}) == sorted(resources)
    model = list(member(spec, "policy_model").command)
    assert (FLEET.parent / model[model.index("--tasks") + 1]) == TASKS
    example = set(LOOPBACK_PORT.findall((REPO / "examples" / "fleet.toml").read_text()))
    assert not set(LOOPBACK_PORT.findall(FLEET.read_text())) & example
