"""Certify's engine on the example fleet: the fleet's members discovered, a baseline recorded
and replayed, and one trial of each fault kind, each reached at its phase and recovered by the
product with every rollout exactly once.

Real processes throughout: the example fleet file (`examples/fleet.toml`) moved to free ports
(`tests/certify_fleet.py`), each member started from its own command, the collector as
`python -m rollout_checkpoint.client.certify.controller`, pausing itself at the trial's step.
The checks here are the engine's: what the observations hold. Whether a finding is a violation
is `invariants`' business, tested on its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_checkpoint.client.certify.aftermath import RestoreBench, restarted_rollouts
from rollout_checkpoint.client.certify.baseline import run_baseline
from rollout_checkpoint.client.certify.controller import pause_point
from rollout_checkpoint.client.certify.determinism import compare_baselines
from rollout_checkpoint.client.certify.findings import Fault, Phase, ServerFacts, TrialPlan
from rollout_checkpoint.client.certify.fleet_processes import (
    LEASE_GRACE,
    LEASE_GRACE_VARIABLE,
    FleetProcesses,
    MemberNotStarted,
    discover,
    http_url,
)
from rollout_checkpoint.client.certify.invariants import check_run
from rollout_checkpoint.client.certify.observations import RunObservation
from rollout_checkpoint.client.certify.runs import collect_exports, published_ids
from rollout_checkpoint.client.certify.setup import CertifySetup
from rollout_checkpoint.client.certify.trial import async_fleet_file, pause_step, run_trial
from rollout_checkpoint.client.checkpointing.checkpoint import CheckpointEvent, checkpoint
from rollout_checkpoint.client.checkpointing.fanout import derive_scope
from rollout_checkpoint.client.checkpointing.publication import (
    PublicationRoot,
    open_checkpoint_root,
)
from rollout_checkpoint.client.collect.checkpoints import CheckpointTaker
from rollout_checkpoint.client.fleet import Fleet
from rollout_checkpoint.client.fleet.spec import FleetSpec, MemberSpec
from rollout_checkpoint.examples.demo.comparison import trajectory_of
from rollout_checkpoint.server.core.episodes import EpisodeId

from .certify_fleet import example_fleet, load, tasks_file
from .conftest import TOKEN
from .test_fleet_launch import write_fleet

REPEATS = 2
"""Twelve rollouts (six tasks, twice): enough for two checkpoints during a run."""
CHECKPOINT_TIMEOUT = 8.0
EXAMPLE_FACTS = [
    ServerFacts("environment", "environment"),
    ServerFacts("policy_model", "policy_model"),
    ServerFacts("agent", "agent"),
    ServerFacts("prompt_injection", "resources", "exported"),
    ServerFacts("counter", "resources", "exported"),
]


@dataclass
class Certified:
    """The example fleet set up for certify, and its recorded baseline."""

    setup: CertifySetup
    recording: Path
    baseline: RunObservation


@pytest.fixture(scope="module")
def certified(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Certified]:
    directory = tmp_path_factory.mktemp("certify")
    with pytest.MonkeyPatch.context() as patch:
        # The collector loads the fleet file itself: its token comes from the environment.
        patch.setenv("ROLLOUT_CHECKPOINT_TOKEN", TOKEN)
        path, entry = example_fleet(directory)
        spec = load(path)
        facts = asyncio.run(discover(spec, directory / "discover"))
        setup = CertifySetup(
            fleet_path=path,
            spec=spec,
            tasks=tasks_file(directory),
            entry_url=entry,
            work=directory / "work",
            facts=facts,
            num_repeats=REPEATS,
            checkpoint_timeout=CHECKPOINT_TIMEOUT,
        )
        recording = directory / "recording.jsonl"
        baseline = asyncio.run(
            run_baseline(setup, recording=recording, mode="record", concurrency=4, label="baseline")
        )
        yield Certified(setup, recording, baseline)


def by_rollout(observation: RunObservation) -> dict[str, dict[str, Any]]:
    return {row["rollout_id"]: row for row in observation.rows}


def assert_every_rollout_once_as_the_baseline(
    observation: RunObservation, baseline: RunObservation
) -> None:
    ids = [row["rollout_id"] for row in observation.rows]
    assert sorted(ids) == sorted(observation.expected), "every rollout exactly once"
    assert {row["status"] for row in observation.rows} == {"ok"}
    expected = by_rollout(baseline)
    differing = [
        rollout
        for rollout, row in by_rollout(observation).items()
        if trajectory_of(row["reply"]) != trajectory_of(expected[rollout]["reply"])
    ]
    assert differing == [], "trajectories differ from the baseline"


# -- discovery and the baselines -------------------------------------------------------------


def test_discovery_names_every_members_kind_and_a_resources_servers_mode(
    certified: Certified,
) -> None:
    assert certified.setup.facts == EXAMPLE_FACTS
    assert certified.setup.model_member == "policy_model"
    assert certified.setup.resources_members == ["prompt_injection", "counter"]


def test_a_command_that_does_not_start_is_named_with_its_stderr(tmp_path: Path) -> None:
    script = "import sys; sys.stderr.write('no such dataset\\n'); sys.exit(3)"
    fleet = write_fleet(
        tmp_path / "fleet.toml",
        [{"name": "broken", "address": "127.0.0.1:1", "command": [sys.executable, "-c", script]}],
    )
    with pytest.raises(MemberNotStarted, match=r"(?s)^broken: exited with 3.*no such dataset"):
        asyncio.run(discover(load(fleet), tmp_path / "logs"))


def test_a_members_http_url_is_its_url_else_its_commands_http_address() -> None:
    command = ("serve", "counter", "--http-address", "127.0.0.1:8102")
    assert http_url(MemberSpec("a", "x:1", command=command)) == "http://127.0.0.1:8102"
    equals = ("serve", "--http-address=10.0.0.2:80")
    assert http_url(MemberSpec("a", "x:1", command=equals)) == "http://10.0.0.2:80"
    assert http_url(MemberSpec("a", "x:1", command=command, url="https://m")) == "https://m"
    assert http_url(MemberSpec("a", "x:1")) is None


def test_the_baseline_replayed_at_another_concurrency_equals_the_recorded_one(
    certified: Certified,
) -> None:
    first = certified.baseline
    assert first.controller_exit == 0 and first.untyped == []
    second = asyncio.run(
        run_baseline(
            certified.setup,
            recording=certified.recording,
            mode="replay",
            concurrency=2,
            label="baseline-2",
        )
    )
    assert second.controller_exit == 0 and second.untyped == []
    assert second.model_misses == [], "every model call was in the recording"
    assert_every_rollout_once_as_the_baseline(second, first)
    assert second.exports == first.exports
    assert second.expected == first.expected and len(first.expected) == 6 * REPEATS
    # The seam with the analysis: the example fleet's baseline is deterministic.
    assert compare_baselines(first, second, servers=certified.setup.facts) == ([], set())


def test_a_replay_of_a_call_the_baseline_never_made_is_a_miss_not_a_failed_baseline(
    certified: Certified, tmp_path: Path
) -> None:
    """A recording without one rollout's calls: that rollout fails (its first model call is
    refused `not_in_recording`), the pass still returns, and the miss names the rollout."""
    lost = certified.baseline.expected[0]
    partial = tmp_path / "partial.jsonl"
    partial.write_text(
        "".join(
            line + "\n"
            for line in certified.recording.read_text().splitlines()
            if json.loads(line)["rollout_id"] != lost
        )
    )
    second = asyncio.run(
        run_baseline(
            certified.setup, recording=partial, mode="replay", concurrency=4, label="partial"
        )
    )
    assert second.controller_exit == 1
    assert {(r["rollout_id"], r["status"]) for r in second.rows if r["status"] != "ok"} == {
        (lost, "failed")
    }
    assert {rollout for rollout, _ in second.model_misses} == {lost}
    assert all(path == "/v1/chat/completions" for _, path in second.model_misses)


async def exported_counter_session(
    setup: CertifySetup, directory: Path, rollout_id: str, *, verified: bool, times: int = 1
) -> list[dict[str, Any]]:
    """Certify's export of the fleet, `times` times into one root, after a counter session of
    `rollout_id` counted to 3 (and, if `verified`, verified: the session ended): the fleet
    started as certify starts it."""
    processes = FleetProcesses(setup.spec, directory / "logs")
    try:
        await processes.start_all()
        counter = next(m for m in setup.spec.members if m.name == "counter")
        url = f"{http_url(counter)}/ng-rollout/{rollout_id}"
        async with httpx.AsyncClient(base_url=url) as http:
            seeded = await http.post("/seed_session", json={"initial_count": 1})
            assert seeded.status_code == 200
            added = await http.post("/increment_counter", json={"count": 2})
            assert added.status_code == 200
            if verified:
                checked = await http.post("/verify", json={"expected_count": 3})
                assert checked.json()["reward"] == 1.0
        finished = [{"rollout_id": rollout_id, "attempt": 0, "status": "ok"}]
        return [await collect_exports(setup, finished, directory / "exports") for _ in range(times)]
    finally:
        await processes.close()


def test_certify_exports_the_state_of_a_session_that_ended_at_its_verify(
    certified: Certified, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Certify starts every member with ROLLOUT_CHECKPOINT_EXPORT_ENDED_SESSIONS=true, so its
    scoped checkpoint after a run holds a finished rollout's final state: without it the
    counter stops tracking the session at its verify and the export is `{}`. (The example
    fleet's tasks never use the counter, and prompt_injection frees its state at verify, so
    the baselines' exports stay `{}`: this drives the counter directly.)"""
    monkeypatch.setenv("ROLLOUT_CHECKPOINT_TOKEN", TOKEN)
    (exports,) = asyncio.run(
        exported_counter_session(certified.setup, tmp_path, "ended.0", verified=True)
    )
    assert exports == {"counter": {"ended.0": {"count": 3}}}


def test_certify_reads_an_incremental_part_through_its_references(
    certified: Certified, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Certify's export twice into one root, the counter's session of `held.0` live and
    untouched between them: the incremental counter's second part references the first's
    record, and reads as the records a restore would install. Read raw, its reference line
    (no episode, no state) broke the export."""
    monkeypatch.setenv("ROLLOUT_CHECKPOINT_TOKEN", TOKEN)
    exports = asyncio.run(
        exported_counter_session(certified.setup, tmp_path, "held.0", verified=False, times=2)
    )
    assert exports == [{"counter": {"held.0": {"count": 3}}}] * 2
    manifests = [
        json.loads(path.read_text())
        for path in (tmp_path / "exports").glob("*/participants/resources/counter/manifest.json")
    ]
    assert any(m.get("referenced_records", 0) == 1 for m in manifests), manifests


# -- trials ----------------------------------------------------------------------------------


TRIALS = [
    TrialPlan(1, Fault.KILL_MEMBER, Phase.RESTORE, "prompt_injection", trigger="agent"),
    TrialPlan(2, Fault.KILL_FLEET, Phase.PREPARE, None, checkpoint=2),
    TrialPlan(3, Fault.KILL_CONTROLLER, Phase.PUBLICATION, None, moment=0.5),
    TrialPlan(4, Fault.STOP_MEMBER, Phase.AFTER_SNAPSHOT, "counter"),
    TrialPlan(5, Fault.STORAGE, Phase.BACKGROUND_WRITE, None),
]
"""One trial of each fault kind. The first runs by default; the others run with `-m slow`:
tests/test_certify.py already runs one trial of each kind through the verb, and each trial
here costs a fleet's start and a whole run (CI's budget)."""


@pytest.mark.parametrize(
    "plan",
    [
        pytest.param(p, id=f"{p.fault}-{p.phase}", marks=[pytest.mark.slow] if n else [])
        for n, p in enumerate(TRIALS)
    ],
)
def test_a_trial_strikes_at_its_phase_and_the_product_recovers_every_rollout_once(
    certified: Certified, plan: TrialPlan, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLOUT_CHECKPOINT_TOKEN", TOKEN)
    observation, reached, note = asyncio.run(run_trial(certified.setup, plan, certified.recording))
    assert reached, note
    assert observation.label == f"trial {plan.number}"
    assert observation.controller_exit == 0, observation.notes[-5:]
    assert_every_rollout_once_as_the_baseline(observation, certified.baseline)
    assert observation.published and observation.restore_failures == {}
    assert observation.untyped == [] and observation.model_misses == []
    assert observation.reopen_seconds is not None
    assert observation.reopen_seconds <= observation.reopen_deadline
    assert observation.exports == certified.baseline.exports
    # The seam with the analysis: every check holds on the example fleet.
    findings = check_run(
        observation, certified.baseline, trial=plan.number, servers=certified.setup.facts
    )
    assert findings == []
    if plan.phase is Phase.BACKGROUND_WRITE:
        assert "derived fleet file with async_commit = true" in note
        assert not (certified.setup.fleet_path.parent / ".fleet.certify-async.toml").exists()


def test_a_phase_whose_step_never_comes_is_not_reached(
    certified: Certified, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLOUT_CHECKPOINT_TOKEN", TOKEN)
    plan = TrialPlan(9, Fault.KILL_FLEET, Phase.PREPARE, None, checkpoint=1000)
    observation, reached, note = asyncio.run(run_trial(certified.setup, plan, certified.recording))
    assert not reached
    assert note == "not reached: the collector never reached preparing@1000 before the run ended"
    assert_every_rollout_once_as_the_baseline(observation, certified.baseline)


# -- the restore check's bench ---------------------------------------------------------------


def test_the_bench_restores_each_checkpoint_in_place_keeping_nothing_of_the_one_before(
    certified: Certified, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One bench fleet takes checkpoint A (the baseline's sessions, into fresh processes),
    then B, a checkpoint of two of A's restored episodes (in place): after B, the bench holds
    B's two episodes at their next attempt and nothing else of A. A restore in place that
    kept what the restore before installed would leave A's other episodes behind."""
    monkeypatch.setenv("ROLLOUT_CHECKPOINT_TOKEN", TOKEN)
    spec = certified.setup.spec

    async def scenario() -> tuple[dict[str, str], frozenset[EpisodeId], frozenset[EpisodeId]]:
        bench = RestoreBench(spec, tmp_path / "bench", {})
        try:
            root_a = open_checkpoint_root(certified.setup.work / "baseline" / "exports")
            assert await bench.failures(root_a, await published_ids(root_a)) == {}
            after_a = await held_by(spec)
            two = sorted(after_a)[:2]
            root_b = open_checkpoint_root(tmp_path / "b")
            await checkpoint_of(spec, root_b, two)
            failures = await bench.failures(root_b, await published_ids(root_b))
            assert bench.fleets == 1, "B went into the bench's fleet, in place"
            return failures, after_a, await held_by(spec)
        finally:
            await bench.close()

    failures, after_a, after_b = asyncio.run(scenario())
    assert failures == {}
    assert len(after_a) == len(certified.baseline.expected) > 2
    assert after_b == {e.next_attempt() for e in sorted(after_a)[:2]}


def test_a_checkpoint_that_fails_in_place_is_judged_in_fresh_processes(
    certified: Certified, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A damaged checkpoint fails on the bench's restored fleet: it is restored again into a
    fresh fleet, and that verdict is the finding; the next checkpoint goes into fresh
    processes again (what the failed restore left is in doubt)."""
    monkeypatch.setenv("ROLLOUT_CHECKPOINT_TOKEN", TOKEN)
    spec = certified.setup.spec
    damaged = tmp_path / "damaged"
    shutil.copytree(certified.setup.work / "baseline" / "exports", damaged)
    records = sorted(damaged.glob("*/participants/*/counter/records-*.jsonl"))
    assert records
    with records[0].open("ab") as file:
        file.write(b'{"not": "what the digest says"}\n')

    async def scenario() -> list[tuple[dict[str, str], int]]:
        bench = RestoreBench(spec, tmp_path / "bench", {})
        seen = []
        try:
            for folder in (certified.setup.work / "baseline" / "exports", damaged, damaged):
                root = open_checkpoint_root(folder)
                seen.append((await bench.failures(root, await published_ids(root)), bench.fleets))
        finally:
            await bench.close()
        return seen

    (good, fleets), (bad, fleets_bad), (bad_fresh, fleets_fresh) = asyncio.run(scenario())
    assert good == {} and fleets == 1
    (why,) = bad.values()
    assert why.startswith("restore into fresh processes failed"), why
    assert fleets_bad == 2, "confirmed in a fleet of fresh processes"
    assert bad_fresh.keys() == bad.keys() and fleets_fresh == 3


async def held_by(spec: FleetSpec) -> frozenset[EpisodeId]:
    """Every episode the fleet's members hold (ListEpisodes)."""
    fleet = await Fleet.discover(spec)
    try:
        return await derive_scope(fleet)
    finally:
        await fleet.close()


async def checkpoint_of(spec: FleetSpec, root: PublicationRoot, scope: list[EpisodeId]) -> None:
    """Publish a checkpoint of `scope` from the running fleet under `root`."""
    fleet = await Fleet.discover(spec)
    try:
        events = [e async for e in checkpoint(fleet, root, time.time() + 60, scope=scope, keep=1)]
    finally:
        await fleet.close()
    outcome = events[-1].outcome
    assert outcome is not None and outcome.published is not None, events[-1]


# -- the pieces, without processes -----------------------------------------------------------


def test_each_phase_pauses_the_collector_at_its_step() -> None:
    def step(phase: Phase, asynchronous: bool = False, moment: float = 0.5) -> str | None:
        plan = TrialPlan(1, Fault.STORAGE, phase, None, checkpoint=2, moment=moment)
        return pause_step(plan, asynchronous)

    assert step(Phase.MID_STEP) is None
    assert step(Phase.PREPARE) == "preparing@2"
    assert step(Phase.AFTER_SNAPSHOT) == "committed@2"
    assert step(Phase.AFTER_SNAPSHOT, asynchronous=True) == "snapshotted@2"
    assert step(Phase.BACKGROUND_WRITE) == "writing@2"
    assert {step(Phase.PUBLICATION, moment=m) for m in (0.2, 0.201, 0.202)} == {
        "after_verify@2",
        "after_fleet_manifest@2",
        "after_latest@2",
    }
    assert {step(Phase.RESTORE, moment=m) for m in (0.2, 0.201)} == {
        "recovery_cut_ended@1",
        "recovery_restored@1",
    }
    assert step(Phase.AFTER_RESUME) == "recovered@1"
    for text in (step(p, True) for p in Phase):
        if text is not None:
            assert pause_point(text)


def test_a_pause_point_names_a_step_and_a_number_from_1() -> None:
    assert pause_point("writing@3") == ("writing", 3)
    assert pause_point("recovered") == ("recovered", 1)
    for bad, message in (
        ("snapshot@1", "'snapshot' is not a step"),
        ("prepared@0", "numbered from 1"),
        ("prepared@x", "'x' is not a number"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            pause_point(bad)


def test_the_derived_fleet_file_sets_async_commit_and_keeps_the_rest(tmp_path: Path) -> None:
    toml = tmp_path / "fleet.toml"
    toml.write_text('token_env = "T"\nasync_commit = false\n[[participants]]\nname = "a"\n')
    assert async_fleet_file(toml).read_text() == (
        'token_env = "T"\nasync_commit = true\n[[participants]]\nname = "a"\n'
    )
    toml.write_text('keep = 3\n[[participants]]\nname = "a"\n')
    derived = async_fleet_file(toml)
    assert derived.parent == tmp_path and derived.name.startswith(".")
    assert derived.read_text().startswith("async_commit = true\nkeep = 3\n")
    yaml = tmp_path / "fleet.yaml"
    yaml.write_text("keep: 3\nasync_commit: false\nparticipants: []\n")
    assert "async_commit: true" in async_fleet_file(yaml).read_text()


def test_a_rollout_is_restarted_only_when_no_checkpoint_continued_its_attempt() -> None:
    rows = [
        {"rollout_id": "a.0", "attempt": 0, "status": "ok"},
        {"rollout_id": "b.0", "attempt": 1, "status": "ok"},
        {"rollout_id": "c.0", "attempt": 2, "status": "ok"},
        {"rollout_id": "d.0", "attempt": 1, "status": "failed"},
    ]
    dispatched = {"b.0": [0, 1], "c.0": [0, 1, 2]}
    restarted = restarted_rollouts(rows, dispatched, {EpisodeId("b.0", 0)})
    assert list(restarted) == ["c.0"]
    assert restarted["c.0"].startswith(
        "attempt 2 sent from its input (attempts dispatched: 0, 1, 2)"
    )


@pytest.mark.parametrize(
    ("phases", "steps"),
    [
        (
            ["PREPARE", "PREPARE", "SCOPE", "COMMIT", "PUBLISH", "RESUME", "DONE"],
            ["preparing", "prepared", "committed", "resumed"],
        ),
        (
            ["PREPARE", "SCOPE", "COMMIT", "RESUME+", "AWAIT_PARTS+", "PUBLISH", "DONE"],
            ["preparing", "prepared", "snapshotted", "resumed", "writing", "committed"],
        ),
        (  # an asynchronous checkpoint that keeps the fleet closed (a stop): no resume
            ["PREPARE", "SCOPE", "COMMIT+", "AWAIT_PARTS", "PUBLISH", "DONE"],
            ["preparing", "prepared", "snapshotted", "committed"],
        ),
    ],
    ids=["synchronous", "asynchronous", "asynchronous-kept-closed"],
)
def test_a_checkpoints_steps_are_named_in_the_order_a_run_meets_them(
    phases: list[str], steps: list[str]
) -> None:
    """The collector's checkpoint events as `CheckpointTaker` names them for the step hook
    (`+`: the event of an asynchronous checkpoint, AWAIT_PARTS+ after its resume)."""
    named: list[str] = []
    taker = object.__new__(CheckpointTaker)  # only its step naming is exercised
    taker.step = named.append
    taker._last_phase = None
    for phase in phases:
        name = phase.rstrip("+")
        plus = phase.endswith("+")
        detail = {"resumed": plus} if name == "AWAIT_PARTS" else {"asynchronous": plus}
        taker._name_steps(CheckpointEvent(name, detail=dict(detail)))
    assert named == steps


def test_members_get_a_short_lease_grace_unless_the_fleet_or_certify_sets_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop-past-the-lease trial waits out the lease: with the default grace (600 s) each
    would cost ten minutes, so certify's members get `LEASE_GRACE`, but a grace the fleet file
    or certify's own environment sets is the user's and stays."""
    monkeypatch.delenv(LEASE_GRACE_VARIABLE, raising=False)
    command = ["rollout-checkpoint", "serve", "counter"]
    fleet = write_fleet(
        tmp_path / "fleet.toml",
        [
            {"name": "a", "address": "127.0.0.1:1", "command": command},
            {
                "name": "b",
                "address": "127.0.0.1:2",
                "command": command,
                "env": {LEASE_GRACE_VARIABLE: "30"},
            },
        ],
    )
    members = FleetProcesses(load(fleet), tmp_path).members
    assert members["a"].env[LEASE_GRACE_VARIABLE] == LEASE_GRACE
    assert members["b"].env[LEASE_GRACE_VARIABLE] == "30"
    monkeypatch.setenv(LEASE_GRACE_VARIABLE, "45")
    assert LEASE_GRACE_VARIABLE not in FleetProcesses(load(fleet), tmp_path).members["a"].env
