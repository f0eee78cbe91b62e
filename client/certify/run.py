"""One certification from start to verdict: discover, baseline twice, probe, trials, report.

The order is the argument. The fleet is discovered first (every command starts, every kind
is known) so a fleet that cannot even start is refused before minutes of baseline. The
baseline records the model, and its second pass replays it at another concurrency: what
the two passes disagree on is the user's nondeterminism, reported as such and left out of
every later comparison (a trial can only be held to what the baseline reproduced). The
stateless probe runs while no fleet is up, since it starts the member on its own address.
The trials come last, one fresh fleet each, so no trial inherits another's damage: a member
that served a trial is never reused, since what a user's server keeps outside every session
(a process-wide counter, a cache, a background task's state) is exactly the bug class certify
hunts, no export shows it, and a reused process would carry it into the next trial (and make
`--only N` disagree with the run it repeats). What is shared is the restore check's bench
(`aftermath.RestoreBench`): one start-closed fleet into which every trial's published
checkpoint is restored in turn once the trials are over (it takes the fleet's addresses, so
it cannot run beside a trial), instead of a fleet started per trial for one restore. Each
trial is checked once its checkpoints were restored, and its seconds include that restore.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rollout_checkpoint.client.certify.aftermath import RestoreBench
from rollout_checkpoint.client.certify.baseline import run_baseline
from rollout_checkpoint.client.certify.determinism import compare_baselines
from rollout_checkpoint.client.certify.findings import (
    Outcome,
    ServerFacts,
    TrialPlan,
    TrialResult,
    Violation,
)
from rollout_checkpoint.client.certify.fleet_processes import discover, http_url
from rollout_checkpoint.client.certify.invariants import check_run
from rollout_checkpoint.client.certify.observations import RunObservation
from rollout_checkpoint.client.certify.plan import plan_trial, plan_trials
from rollout_checkpoint.client.certify.report import CertifyReport
from rollout_checkpoint.client.certify.runs import Mode, RunFailed, model_args
from rollout_checkpoint.client.certify.setup import CertifySetup
from rollout_checkpoint.client.certify.stateless_probe import probe_stateless
from rollout_checkpoint.client.certify.trial import restore_check, run_trial
from rollout_checkpoint.client.collect.errors import UsageError
from rollout_checkpoint.client.collect.inputs import load_input
from rollout_checkpoint.client.fleet import FleetSpec, load_fleet_file

PROBE_SECONDS = 120.0
"""The bound of one stateless server's probe (its fresh process and every replayed call)."""

Progress = Callable[[str, int, int], None]
"""Called with (what is running, trials done, trials planned) as the run goes."""


@dataclass(frozen=True)
class CertifyOptions:
    """One certification's settings (the verb's flags of the same names)."""

    fleet: Path
    tasks: Path
    report: Path
    trials: int = 50
    seed: int = 1
    only: int | None = None
    entry_url: str | None = None
    concurrency: int = 4
    num_repeats: int = 1

    def command(self) -> str:
        """The command line that runs this certification again (trials add `--only N`)."""
        words = ["rollout-checkpoint", "certify", "--fleet", str(self.fleet)]
        words += ["--tasks", str(self.tasks), "--trials", str(self.trials)]
        words += ["--seed", str(self.seed), "--report", str(self.report)]
        if self.entry_url is not None:
            words += ["--entry-url", self.entry_url]
        words += ["--concurrency", str(self.concurrency), "--num-repeats", str(self.num_repeats)]
        return shlex.join(words)

    @property
    def concurrencies(self) -> tuple[int, int]:
        """The baseline's two passes: the asked concurrency, then another (1, or 2 when 1
        was asked): state shared across sessions shows as a difference between them."""
        return self.concurrency, (1 if self.concurrency > 1 else 2)


class Certification:
    """Runs one certification (see the module docstring) to its `CertifyReport`."""

    def __init__(self, options: CertifyOptions, spec: FleetSpec, progress: Progress) -> None:
        self.options = options
        self.spec = spec
        self.progress = progress
        self.started = time.monotonic()

    async def run(self) -> CertifyReport:
        options, spec = self.options, self.spec
        work = options.report / "work"
        work.mkdir(parents=True, exist_ok=True)
        plans = self._plans(spec)
        self.progress("discovering the fleet", 0, len(plans))
        facts = await discover(spec, work / "discover")
        setup = CertifySetup(
            fleet_path=options.fleet,
            spec=spec,
            tasks=options.tasks,
            entry_url=options.entry_url or _entry_url(spec, facts),
            work=work,
            num_repeats=options.num_repeats,
            concurrency=options.concurrency,
            facts=facts,
        )
        recording = work / "model-recording.jsonl"
        recording.unlink(missing_ok=True)
        first, second = options.concurrencies
        self.progress(f"baseline at concurrency {first} (recording the model)", 0, len(plans))
        baseline = await _baseline(
            setup, recording=recording, mode="record", concurrency=first, label="baseline"
        )
        _require_whole(baseline)
        self.progress(f"baseline again at concurrency {second} (replaying)", 0, len(plans))
        again = await _baseline(
            setup, recording=recording, mode="replay", concurrency=second, label="baseline-2"
        )
        findings, unreproduced = compare_baselines(baseline, again, servers=facts)
        findings += await self._probe(spec, facts, baseline)
        bench = RestoreBench(spec, work / "restore-bench", model_args(setup, "replay", recording))
        try:
            trials = await self._trials(setup, plans, recording, bench)
        finally:
            await bench.close()
        judged = [check_trial(t, baseline, unreproduced, facts) for t in trials]
        self.progress("done", len(plans), len(plans))
        seconds = time.monotonic() - self.started
        trial_seconds = sum(t.seconds for t in judged)
        return CertifyReport(
            command=options.command(),
            seed=options.seed,
            fleet=str(options.fleet),
            tasks=str(options.tasks),
            servers=facts,
            baseline_rollouts=len(baseline.expected),
            concurrencies=options.concurrencies,
            baseline_findings=findings,
            trials=judged,
            seconds=seconds,
            trials_per_minute=(60.0 * len(trials) / trial_seconds) if trial_seconds else 0.0,
            exported_sessions={
                name: len(baseline.exports.get(name, {})) for name in setup.resources_members
            },
        )

    def _plans(self, spec: FleetSpec) -> list[TrialPlan]:
        names = [member.name for member in spec.members]
        if self.options.only is not None:
            return [plan_trial(self.options.seed, self.options.only, names)]
        return plan_trials(self.options.seed, self.options.trials, names)

    async def _probe(
        self, spec: FleetSpec, facts: Sequence[ServerFacts], baseline: RunObservation
    ) -> list[Violation]:
        """Every server declared `stateless`, its baseline requests replayed on a fresh
        process of its own (no fleet is up now: it takes the member's own address)."""
        found: list[Violation] = []
        stateless = {f.name for f in facts if f.kind == "resources" and f.mode == "stateless"}
        for member in spec.members:
            url = http_url(member)
            if member.name not in stateless or url is None:
                continue
            self.progress(f"probing stateless server {member.name}", 0, 0)
            found += await probe_stateless(
                spec, member, url, baseline, deadline=time.time() + PROBE_SECONDS
            )
        return found

    async def _trials(
        self,
        setup: CertifySetup,
        plans: Sequence[TrialPlan],
        recording: Path,
        bench: RestoreBench,
    ) -> list[RanTrial]:
        """Run every trial, then restore what each published into `bench`: the bench takes
        the fleet's addresses, so it runs once no trial does (see `RestoreBench`), and each
        trial's seconds include its restore."""
        ran = []
        for done, plan in enumerate(plans):
            self.progress(_describe(plan), done, len(plans))
            started = time.monotonic()
            observation, reached, note = await run_trial(setup, plan, recording, defer_restore=True)
            ran.append(RanTrial(plan, observation, reached, note, time.monotonic() - started))
        for trial in ran:
            what = f"restoring trial {trial.plan.number}'s checkpoints"
            self.progress(what, len(plans), len(plans))
            started = time.monotonic()
            await restore_check(bench, setup, trial.observation)
            trial.seconds += time.monotonic() - started
        return ran


@dataclass
class RanTrial:
    """A trial that ran, before its checks: `run_trial`'s result and the seconds it took."""

    plan: TrialPlan
    observation: RunObservation
    reached: bool
    note: str
    seconds: float


def check_trial(
    trial: RanTrial,
    baseline: RunObservation,
    unreproduced: set[tuple[str, str]],
    facts: Sequence[ServerFacts],
) -> TrialResult:
    """The trial's verdict: every check of `check_run` against the baseline."""
    started = time.monotonic()
    violations = check_run(
        trial.observation,
        baseline,
        trial=trial.plan.number,
        unreproduced=unreproduced,
        servers=facts,
    )
    if violations:
        outcome = Outcome.VIOLATED
    else:
        outcome = Outcome.HELD if trial.reached else Outcome.NOT_REACHED
    return TrialResult(
        plan=trial.plan,
        outcome=outcome,
        violations=violations,
        restarted=dict(trial.observation.restarted),
        seconds=trial.seconds + time.monotonic() - started,
        note=trial.note,
    )


def certifiable(options: CertifyOptions) -> FleetSpec:
    """The fleet, once it is known that certify can run it (read before any process starts,
    so a fleet it cannot run is one line, not a half-started fleet to clean up): every member
    has its `command` (certify starts, kills and replaces each), and the tasks read."""
    spec = load_fleet_file(options.fleet)
    load_input(options.tasks, options.num_repeats)
    missing = [member.name for member in spec.members if not member.command]
    if missing:
        raise UsageError(
            f"certify starts every member itself: give {', '.join(missing)} a `command` in "
            "the fleet file (the argv that starts it)"
        )
    return spec


def _entry_url(spec: FleetSpec, facts: Sequence[ServerFacts]) -> str:
    """The environment's HTTP address (else the agent's): where `collect` sends `/run`."""
    by_name = {member.name: member for member in spec.members}
    for kind in ("environment", "agent"):
        for fact in facts:
            url = http_url(by_name[fact.name]) if fact.kind == kind else None
            if url is not None:
                return url
    raise UsageError(
        "no entry point: give the environment (or agent) member a `url` in the fleet file, "
        "an --http-address in its command, or pass --entry-url"
    )


async def _baseline(
    setup: CertifySetup, *, recording: Path, mode: Mode, concurrency: int, label: str
) -> RunObservation:
    """`run_baseline`, whose failure (the collector failed rollouts or hung, without any
    fault) is `BaselineFailed`: the fleet is what to fix, said in one line with exit 2, not a
    traceback of certify's."""
    try:
        return await run_baseline(
            setup, recording=recording, mode=mode, concurrency=concurrency, label=label
        )
    except RunFailed as failed:
        raise BaselineFailed(f"{failed}; fix the fleet before certifying it") from None


def _require_whole(baseline: RunObservation) -> None:
    """A baseline that did not finish every rollout uninterrupted cannot be compared with:
    the fleet fails without any fault, and that is the first thing to fix."""
    finished = {row.get("rollout_id") for row in baseline.rows if row.get("status") == "ok"}
    missing = [rollout_id for rollout_id in baseline.expected if rollout_id not in finished]
    if missing or baseline.controller_exit != 0:
        raise BaselineFailed(
            f"the baseline (no fault) did not finish {len(missing)} of "
            f"{len(baseline.expected)} rollouts (collect exited {baseline.controller_exit}; "
            f"first: {missing[:3]}); fix the fleet before certifying it"
        )


class BaselineFailed(Exception):
    """The fleet could not run its tasks once without any fault."""


def _describe(plan: TrialPlan) -> str:
    struck = plan.target or {"kill_fleet": "every member", "kill_controller": "the collector"}.get(
        str(plan.fault), "the storage"
    )
    trigger = f" (after losing {plan.trigger})" if plan.trigger else ""
    return f"trial {plan.number}: {plan.fault} of {struck} at {plan.phase}{trigger}"
