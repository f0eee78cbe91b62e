"""The mutation test of `certify`: each planted bug of examples/faulty/ must be reported.

A certify run that finds nothing on a fleet with a planted checkpointing bug is a failing test:
for each faulty fleet (moved to free ports), `rollout-checkpoint certify` must exit 9
(violations found) and its report.json must name the counter member, the check that catches
that bug and the first differing JSON path. The same run with the honest counter in its place
must hold: what certify reports is the planted bug, not the fleet or the tasks.

Written against the CLI's contract (the verb, its flags, its exit codes and report.json); the
runs are skipped while the verb is not there. The trial plan they rely on is checked now.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollout_checkpoint.client.certify.findings import REPORT_FORMAT, Check, Fault, Phase, TrialPlan
from rollout_checkpoint.client.certify.plan import plan_trials
from rollout_checkpoint.client.cli.console import ExitCode

from .conftest import TOKEN
from .faulty_fleets import (
    BUGS,
    FAULTY,
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

SEED = 59874
TRIALS = 3
"""`--seed 59874 --trials 3`: on these fleets (members environment, policy_model, agent,
prompt_injection, counter, in that order) the plan is three SIGKILLs of a member that is
neither the counter nor the environment: the policy model mid-step, prompt_injection once
every member snapshotted the second checkpoint, the policy model during the second
checkpoint's Prepare. The collector's in-place recovery then restores `LATEST` into the whole
fleet, the counter rejoining as a survivor, and continues the episodes it caught from the
agent's boundary, re-issuing the tool calls made since: what the three trial-found bugs need
(a replacement of the counter itself would hide `restore_not_idempotent`, which only shows in
a process that held the session). Measured with this engine (driving `run_trial` before the
verb existed): trials 2 and 3 continued episodes and found each bug; trial 1, like a mid-step
kill of the environment, restarted the caught episodes from their inputs (the product's
choice, with its reason) and proved nothing; a kill of the collector mid-step was "not
reached". Three such trials, not one, so a trial that restarts instead still leaves one that
finds the bug. `test_the_seed_strikes_where_the_planted_bugs_live` holds the plan to that."""
CONCURRENCY = 4
"""Rollouts in flight: half the 8 tasks, so the run goes in two waves of four episodes of 12
increments each, and a mid-step fault finds several episodes that a checkpoint caught
mid-way and that went on past it. Measured with the product's own path alone (a real `collect
--checkpoint-every 0.3` of the side_effect_file fleet SIGKILLed right after its first
checkpoint, then `collect --resume`): three runs out of three continued at least one episode
whose replayed increments doubled the ledger; at concurrency 2 (with 4 or 8 increments a
task), one run of two continued none."""

CERTIFY_VERB = importlib.util.find_spec("rollout_checkpoint.client.certify.cli") is not None
needs_certify_verb = pytest.mark.skipif(
    not CERTIFY_VERB,
    reason="rollout_checkpoint.client.certify.cli (the certify verb) is not built yet",
)


@dataclass(frozen=True)
class Expected:
    """What certify must report for one planted bug."""

    check: Check
    paths: frozenset[str]
    """The first differing path it must name."""
    by_trial: bool
    """Found by a trial (True) or by the baseline (its second pass, the stateless probe)."""


EXPECTED = {
    # The restore forgets `history`: the exported state of a continued rollout's session lost
    # the entries from before the checkpoint, and its first remaining one differs from the
    # baseline's first (every entry is a distinct, growing count). Its verify reply, which
    # reports the state, differs too (`$.verify.history[0]`, the trajectory check).
    "dropped_field": Expected(
        Check.EXPORTED_STATE_EQUALS_BASELINE, frozenset({"$.history[0]"}), by_trial=True
    ),
    # The survivor's rejoin adds the checkpoint's count to the one it kept (and the verify
    # reply reports it: `$.verify.count`).
    "restore_not_idempotent": Expected(
        Check.EXPORTED_STATE_EQUALS_BASELINE, frozenset({"$.count"}), by_trial=True
    ),
    # Idle ticks depend on the wall clock: the baseline's two passes export different ones
    # (a server's exported-state difference is the determinism check's first counter-example).
    "background_mutation": Expected(
        Check.DETERMINISTIC, frozenset({"$.idle_ticks"}), by_trial=False
    ),
    # Each increment answers the process-wide count: the probe's first replay differs there.
    "hidden_state": Expected(Check.STATELESS_HAS_NO_STATE, frozenset({"$.count"}), by_trial=False),
    # A replayed increment is in the ledger twice: the verification (which reads the ledger)
    # differs; the tool replies and the exported, in-memory state do not.
    "side_effect_file": Expected(
        Check.TRAJECTORY_EQUALS_BASELINE, frozenset({"$.verify.count"}), by_trial=True
    ),
}


CHECKPOINT_PHASES = frozenset({Phase.PREPARE, Phase.AFTER_SNAPSHOT, Phase.PUBLICATION})


def reaches_a_restore_into_the_running_counter(plan: TrialPlan) -> bool:
    """A SIGKILL of a member that is neither the counter nor the environment, mid-step or
    during the second checkpoint (the first is `LATEST` then): the in-place recovery restores
    `LATEST` into the fleet with the counter a survivor and continues episodes from it."""
    when = plan.phase is Phase.MID_STEP or (
        plan.phase in CHECKPOINT_PHASES and plan.checkpoint == 2
    )
    return (
        when and plan.fault is Fault.KILL_MEMBER and plan.target not in ("counter", "environment")
    )


@pytest.mark.parametrize("bug", BUGS)
def test_the_seed_strikes_where_the_planted_bugs_live(bug: str) -> None:
    members = [member.name for member in load(FAULTY / f"{bug}.toml").members]
    plans = plan_trials(SEED, TRIALS, members)
    assert all(reaches_a_restore_into_the_running_counter(plan) for plan in plans), plans
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


@needs_certify_verb
@pytest.mark.timeout(RUN_SECONDS + 60)
@pytest.mark.parametrize("bug", BUGS)
def test_certify_reports_the_planted_bug(tmp_path: Path, bug: str) -> None:
    expected = EXPECTED[bug]
    run = certify(free_port_fleet(bug, tmp_path / "fleet"), tmp_path / "report")
    assert run.returncode == ExitCode.VIOLATIONS_FOUND, run.stderr
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["format"] == REPORT_FORMAT and report["verdict"] == "violated"
    named = [
        finding
        for finding in report["findings"]
        if finding["server"] == "counter" and finding["check"] == expected.check
    ]
    assert named, f"no {expected.check} finding on counter: {report['findings']}"
    assert named[0]["path"] in expected.paths, named
    if expected.by_trial:
        assert named[0]["trial"] in range(1, TRIALS + 1), named
    else:
        assert named[0]["trial"] is None and named[0] in report["baseline"]["findings"]
    (counter,) = (row for row in report["summary"] if row["server"] == "counter")
    assert counter["violations"] >= 1


@needs_certify_verb
@pytest.mark.timeout(RUN_SECONDS + 60)
def test_certify_holds_on_the_honest_counter_in_the_same_fleet(tmp_path: Path) -> None:
    """The control: the same fleet, tasks, seed and trials with the counter the faulty ones
    start from. Every check holds, so each finding above is its planted bug."""
    fleet = free_port_fleet("side_effect_file", tmp_path / "fleet", honest=True)
    run = certify(fleet, tmp_path / "report")
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert run.returncode == ExitCode.OK, report["findings"]
    assert report["verdict"] == "held" and report["findings"] == []


def ports_of(fleet: Path) -> set[str]:
    return set(LOOPBACK_PORT.findall(fleet.read_text()))


@pytest.mark.parametrize("bug", BUGS)
def test_each_faulty_fleet_is_the_example_fleet_with_its_counter_replaced(bug: str) -> None:
    """The example fleet's members and commands, but the counter serves the faulty module
    (as a user's app), the agent reaches it under the name `counter`, the environment sends
    every task there, the scripted model follows the tasks beside the file; on ports of its
    own, so two of these fleets, or one beside the example fleet, can run at once."""
    fleet = FAULTY / f"{bug}.toml"
    spec = load(fleet)
    example = load(REPO / "examples" / "fleet.toml")
    assert [m.name for m in spec.members] == [m.name for m in example.members]
    counter = member(spec, "counter")
    assert counter.command[:2] == ("rollout-checkpoint", "serve")
    module, _, attribute = counter.command[2].partition(":")
    assert module == f"{FAULTY_MODULES}.{bug}" and attribute.endswith("Counter")
    agent = list(member(spec, "agent").command)
    assert f"counter={http_url(counter)}" in agent
    environment = list(member(spec, "environment").command)
    assert environment[environment.index("--resources-server") + 1] == "counter"
    model = list(member(spec, "policy_model").command)
    assert (fleet.parent / model[model.index("--tasks") + 1]) == TASKS
    others = [FAULTY / f"{other}.toml" for other in BUGS if other != bug]
    for other in [REPO / "examples" / "fleet.toml", *others]:
        assert not ports_of(fleet) & ports_of(other), other
