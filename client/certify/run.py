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
checkpoint is restored in turn once a batch of trials is over (it takes the fleet's
addresses, so it cannot run beside a trial), instead of a fleet started per trial for one
restore. Each trial is checked once its checkpoints were restored, and its seconds include
that restore.

A run of a thousand trials lasts hours, so every step is journaled in the report directory
as it is decided (`journal`): the baseline once it is complete, each trial once it ran and
again once its restore check is recorded. `--resume` goes on from there: the baseline and
every decided trial are read back, a trial that ran but was never restored has its restore
check, and only the trials never run are run. The restore checks go per batch
(`RESTORE_BATCH`), so a trial's checkpoint root waits on disk for at most a batch, and the
bench is started once a batch, not once a trial.
"""

from __future__ import annotations

import asyncio
import shlex
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from rollout_checkpoint.client.certify.aftermath import RestoreBench
from rollout_checkpoint.client.certify.baseline import run_baseline, run_folder
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
from rollout_checkpoint.client.certify.journal import (
    Journal,
    Prepared,
    RanTrial,
    ResumeRefused,
    RunIdentity,
    file_sha256,
)
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
from rollout_checkpoint.client.fleet.ports import ephemeral_range, in_ephemeral_range

PROBE_SECONDS = 120.0
"""The bound of one stateless server's probe (its fresh process and every replayed call)."""
RESTORE_BATCH = 25
"""Trials run between two rounds of restore checks: an interruption loses at most this many
restore checks (never a trial's run), and the bench's fleet starts once a batch; the trials
of a batch keep their checkpoint roots on disk until their restore check is recorded."""

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
    resume: bool = False
    """Go on with the run journaled in `report` (`journal`) rather than start one."""

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

    def identity(self) -> RunIdentity:
        """What decides this run's trials (the journal holds a resume to it). Blocking: the
        fleet file and the tasks are read to their digests."""
        return RunIdentity(
            fleet_sha256=file_sha256(self.fleet),
            tasks_sha256=file_sha256(self.tasks),
            seed=self.seed,
            trials=self.trials,
            concurrency=self.concurrency,
            num_repeats=self.num_repeats,
            entry_url=self.entry_url,
        )


def open_journal(options: CertifyOptions) -> Journal | None:
    """The run's journal, or None for `--only N` (one trial's rerun keeps nothing to resume,
    but must not overwrite an unfinished run's work area either). Refuses, before anything
    is touched, what `Journal.begin` refuses. Blocking."""
    identity = options.identity()
    if options.only is None:
        return Journal.begin(options.report, identity, resume=options.resume)
    if options.resume:
        raise ResumeRefused("--resume goes on with a whole run: it does not take --only")
    Journal(options.report, identity).refuse_to_lose_decided_trials(f"--only {options.only}")
    return None


class Certification:
    """Runs one certification (see the module docstring) to its `CertifyReport`, journaling
    what it decides (`journal`) so that an interrupted one resumes (`CertifyOptions.resume`)."""

    def __init__(self, options: CertifyOptions, spec: FleetSpec, progress: Progress) -> None:
        self.options = options
        self.spec = spec
        self.progress = progress
        self.started = time.monotonic()
        self.journal: Journal | None = None
        self.earlier_seconds = 0.0
        """The seconds earlier sessions of a resumed run spent (downtime left out)."""

    async def run(self) -> CertifyReport:
        options, spec = self.options, self.spec
        self.journal = await asyncio.to_thread(open_journal, options)
        work = options.report / "work"
        await asyncio.to_thread(work.mkdir, parents=True, exist_ok=True)
        plans = self._plans(spec)
        recording = work / "model-recording.jsonl"
        prepared = await self._prepared(work, recording, len(plans))
        setup = self._setup(work, prepared.facts, prepared.entry_url)
        bench = RestoreBench(spec, work / "restore-bench", model_args(setup, "replay", recording))
        try:
            trials = await self._trials(setup, plans, recording, bench, prepared)
        finally:
            await bench.close()
        judged = [
            check_trial(t, prepared.baseline, prepared.unreproduced, prepared.facts) for t in trials
        ]
        self.progress("done", len(plans), len(plans))
        trial_seconds = sum(t.seconds for t in judged)
        return CertifyReport(
            command=options.command(),
            seed=options.seed,
            fleet=str(options.fleet),
            tasks=str(options.tasks),
            servers=prepared.facts,
            baseline_rollouts=len(prepared.baseline.expected),
            concurrencies=options.concurrencies,
            baseline_findings=prepared.findings,
            trials=judged,
            seconds=self._elapsed(),
            trials_per_minute=(60.0 * len(trials) / trial_seconds) if trial_seconds else 0.0,
            exported_sessions={
                name: len(prepared.baseline.exports.get(name, {}))
                for name in setup.resources_members
            },
        )

    def stopped(self) -> str:
        """What an interrupted run kept (as its journal says), and the command that goes on
        from there. Blocking: called once the run's loop is gone."""
        if self.options.only is not None:
            return "a single trial's rerun keeps nothing to resume"
        if self.journal is None:
            return f"nothing was decided yet; run again: {self.options.command()}"
        ran, decided = self.journal.kept(self.options.trials)
        pending = f", {ran - decided} more ran (restore check pending)" if ran > decided else ""
        return (
            f"{decided} of {self.options.trials} trials decided{pending}, kept in "
            f"{self.journal.directory}; resume: {self.options.command()} --resume"
        )

    def _plans(self, spec: FleetSpec) -> list[TrialPlan]:
        names = [member.name for member in spec.members]
        if self.options.only is not None:
            return [plan_trial(self.options.seed, self.options.only, names)]
        return plan_trials(self.options.seed, self.options.trials, names)

    def _setup(self, work: Path, facts: list[ServerFacts], entry_url: str) -> CertifySetup:
        options = self.options
        return CertifySetup(
            fleet_path=options.fleet,
            spec=self.spec,
            tasks=options.tasks,
            entry_url=entry_url,
            work=work,
            num_repeats=options.num_repeats,
            concurrency=options.concurrency,
            facts=facts,
        )

    def _elapsed(self) -> float:
        return self.earlier_seconds + time.monotonic() - self.started

    async def _prepared(self, work: Path, recording: Path, planned: int) -> Prepared:
        """The journaled baseline of the run resumed, else a new one (journaled): discovery,
        the baseline twice, the stateless probe."""
        journal = self.journal
        if journal is not None and self.options.resume:
            prepared = await asyncio.to_thread(journal.prepared)
            if prepared is not None:
                await _require_recording(recording, prepared.recording_sha256)
                self.earlier_seconds = prepared.seconds
                return prepared
        prepared = await self._baselines(work, recording, planned)
        if journal is not None:
            await asyncio.to_thread(journal.record_prepared, prepared)
        return prepared

    async def _baselines(self, work: Path, recording: Path, planned: int) -> Prepared:
        options, spec = self.options, self.spec
        self.progress("discovering the fleet", 0, planned)
        facts = await discover(spec, work / "discover")
        setup = self._setup(work, facts, options.entry_url or _entry_url(spec, facts))
        await asyncio.to_thread(recording.unlink, missing_ok=True)
        first, second = options.concurrencies
        self.progress(f"baseline at concurrency {first} (recording the model)", 0, planned)
        baseline = await _baseline(
            setup, recording=recording, mode="record", concurrency=first, label="baseline"
        )
        _require_whole(baseline)
        self.progress(f"baseline again at concurrency {second} (replaying)", 0, planned)
        again = await _baseline(
            setup, recording=recording, mode="replay", concurrency=second, label="baseline-2"
        )
        findings, unreproduced = compare_baselines(baseline, again, servers=facts)
        findings += await self._probe(spec, facts, baseline)
        return Prepared(
            facts=facts,
            entry_url=setup.entry_url,
            baseline=baseline,
            findings=findings,
            unreproduced=unreproduced,
            recording_sha256=await asyncio.to_thread(file_sha256, recording),
            seconds=self._elapsed(),
        )

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
        prepared: Prepared,
    ) -> list[RanTrial]:
        """Every trial of `plans`: those the journal holds are not run again (those whose
        restore check was not recorded have it now, first), the others run in batches of
        `RESTORE_BATCH`, each batch restored into `bench` once it ran (the bench takes the
        fleet's addresses, so it runs while no trial does: `RestoreBench`). An interruption
        loses at most the restore checks of one batch, never a trial's run."""
        journaled = await self._journaled(plans)
        self.earlier_seconds = max([self.earlier_seconds, *(t.elapsed for t in journaled)])
        ran = {trial.plan.number: trial for trial in journaled}
        pending = [t for t in journaled if not t.restore_checked]
        await self._restore_batch(setup, bench, pending, prepared, len(ran), len(plans))
        batch: list[RanTrial] = []
        for plan in plans:
            if plan.number in ran:
                continue
            self.progress(_describe(plan), len(ran), len(plans))
            started = time.monotonic()
            observation, reached, note = await run_trial(setup, plan, recording, defer_restore=True)
            trial = RanTrial(plan, observation, reached, note, time.monotonic() - started)
            await self._record(trial)
            ran[plan.number] = trial
            batch.append(trial)
            if len(batch) == RESTORE_BATCH:
                await self._restore_batch(setup, bench, batch, prepared, len(ran), len(plans))
                batch = []
        await self._restore_batch(setup, bench, batch, prepared, len(ran), len(plans))
        return [ran[plan.number] for plan in plans]

    async def _journaled(self, plans: Sequence[TrialPlan]) -> list[RanTrial]:
        if self.journal is None:
            return []
        return await asyncio.to_thread(self.journal.trials, plans)

    async def _restore_batch(
        self,
        setup: CertifySetup,
        bench: RestoreBench,
        batch: Sequence[RanTrial],
        prepared: Prepared,
        done: int,
        planned: int,
    ) -> None:
        """Restore what each trial of `batch` published into `bench` (each trial's seconds
        include its restore), then decide it: journaled as restore-checked, its checkpoint
        root removed unless a check failed (the root is what to look at then). The bench
        is closed after, so the next trial's fleet can take the addresses."""
        for trial in batch:
            number = trial.plan.number
            self.progress(f"restoring trial {number}'s checkpoints", done, planned)
            started = time.monotonic()
            await restore_check(bench, setup, trial.observation)
            trial.seconds += time.monotonic() - started
            trial.restore_checked = True
            await self._record(trial)
            verdict = check_trial(trial, prepared.baseline, prepared.unreproduced, prepared.facts)
            if verdict.outcome is not Outcome.VIOLATED:
                root = run_folder(setup, trial.observation.label) / "checkpoints"
                await asyncio.to_thread(shutil.rmtree, root, ignore_errors=True)
        await bench.close()

    async def _record(self, trial: RanTrial) -> None:
        trial.elapsed = self._elapsed()
        if self.journal is not None:
            await asyncio.to_thread(self.journal.record_trial, trial)


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


def restart_port_notes(spec: FleetSpec) -> list[str]:
    """One line per member address inside the kernel's ephemeral range. Certify restarts a
    killed member on the addresses of its fleet file; while it is down, an outgoing
    connection of any process may get that port as its own, and the replacement then cannot
    listen (the trial ends as certify unable to run the fleet, not as a finding). Not refused:
    the range differs between machines and a port is taken only sometimes."""
    start, end = ephemeral_range()
    notes = []
    for member in spec.members:
        url = http_url(member)
        addresses = [member.address, *([urlsplit(url).netloc] if url else [])]
        for address in addresses:
            if in_ephemeral_range(address):
                notes.append(
                    f"{member.name} listens on {address}, inside this machine's ephemeral "
                    f"port range ({start}-{end}): a replacement may find it taken; ports "
                    f"below {start} are safer"
                )
    return notes


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


async def _require_recording(recording: Path, digest: str) -> None:
    """A resume replays the model recording its baseline made, byte for byte: a recording
    that is gone or changed would answer the trials differently from the trials already
    decided (`ResumeRefused`, before any trial runs)."""
    exists = await asyncio.to_thread(recording.exists)
    if not exists or await asyncio.to_thread(file_sha256, recording) != digest:
        raise ResumeRefused(
            f"{recording}, the model recording of the baseline this run's trials replay, is "
            f"{'changed' if exists else 'gone'}: the decided trials cannot be resumed; "
            "certify again with another --report"
        )


def _describe(plan: TrialPlan) -> str:
    struck = plan.target or {"kill_fleet": "every member", "kill_controller": "the collector"}.get(
        str(plan.fault), "the storage"
    )
    trigger = f" (after losing {plan.trigger})" if plan.trigger else ""
    return f"trial {plan.number}: {plan.fault} of {struck} at {plan.phase}{trigger}"
