"""What `certify` found: the named checks, one counter-example each, and the trials' verdicts.

Everything a report shows is derived from these values, so the terminal table, `report.json`
and `report.html` can never disagree: the matrix and the per-server summary are computed here,
once, from the trials. A `Violation` always names the check and, as far as the check can tell,
the server, the session (the rollout id), the step and the first differing JSON path: a user
must be able to open their own hook at the line that lost the field, not read a diff.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

REPORT_FORMAT = "rollout-checkpoint-certify/1"
"""`report.json`'s `format`: a reader refuses another."""


class Fault(enum.StrEnum):
    """What a trial does to the fleet."""

    KILL_MEMBER = "kill_member"
    """SIGKILL of one member's process group; its replacement starts closed on its address."""
    KILL_FLEET = "kill_fleet"
    """SIGKILL of every member; every replacement starts closed."""
    KILL_CONTROLLER = "kill_controller"
    """SIGKILL of the collector; `collect --resume` continues the run."""
    STOP_MEMBER = "stop_member"
    """SIGSTOP of one member until its lease has expired, then SIGCONT."""
    STORAGE = "storage"
    """The checkpoint storage fails for one checkpoint: the checkpoint root is moved aside and
    a plain file takes its place (every write under it fails, as on a full or read-only
    disk, even for root, whom permissions do not stop), then it is put back."""


class Phase(enum.StrEnum):
    """When, in the life of a run, a trial's fault strikes (in the order a run meets them)."""

    MID_STEP = "mid_step"
    """Rollouts in flight between two steps, no checkpoint under way."""
    PREPARE = "prepare"
    """A checkpoint's Prepare was sent; the fleet is closing."""
    AFTER_SNAPSHOT = "after_snapshot"
    """Every member exported its part; nothing is published."""
    BACKGROUND_WRITE = "background_write"
    """An asynchronous checkpoint resumed the fleet; its parts are being written."""
    PUBLICATION = "publication"
    """The fleet manifest and `LATEST` are being published."""
    RESTORE = "restore"
    """A recovery (after a first, triggering member kill) is restoring the fleet."""
    AFTER_RESUME = "after_resume"
    """A recovery just resumed the restored fleet; continued attempts are being sent."""


class Check(enum.StrEnum):
    """The invariants, each checked on every trial (the first three also on the baseline)."""

    FINISHED_EXACTLY_ONCE = "every_rollout_finishes_exactly_once"
    """One `ok` output line for every (task, repeat): none missing, none twice."""
    TRAJECTORY_EQUALS_BASELINE = "trajectory_and_reward_equal_baseline"
    """Messages, tool calls, verification and reward equal the baseline's (what the baseline
    reproduced), or the rollout is reported restarted with the reason the product gave."""
    EXPORTED_STATE_EQUALS_BASELINE = "no_tool_call_applied_twice"
    """Each resources server's exported state of each session after the run equals the
    baseline's: a tool call replayed, lost or applied twice by a restore shows here."""
    CHECKPOINTS_RESTORE = "every_published_checkpoint_restores"
    """Every checkpoint the run published reads back whole, and the latest restores (into a
    fleet started closed; a failure on a restored one is confirmed in fresh processes)."""
    ADMISSION_REOPENS = "admission_reopens_within_deadline"
    """After the fault, every member is ready (admission open) again within the deadline."""
    REFUSALS_TYPED = "every_refusal_is_typed"
    """Every refusal the run met carries a reason of the contract; no server failed untyped."""
    MODEL_CALLS_RECORDED = "model_calls_were_in_the_baseline"
    """Every policy-model call was one the baseline made (a miss in the replay: the server
    under test made the agent ask something new)."""
    RESULTS_ACKNOWLEDGED = "every_result_acknowledged"
    """After a run that completed, the entry members hold no result under a receipt: every
    result reached the output and its receipt was acknowledged."""
    DETERMINISTIC = "baseline_is_deterministic"
    """The baseline run twice (at two concurrencies) gives the same replies and exports."""
    STATELESS_HAS_NO_STATE = "stateless_replies_depend_only_on_the_request"
    """A server declared `stateless` answers a request replayed on a fresh process as it
    answered it in the baseline."""


class Outcome(enum.StrEnum):
    """A trial's verdict, and a cell of the capability matrix."""

    HELD = "held"
    VIOLATED = "violated"
    NOT_REACHED = "not_reached"
    """The run ended before the fault's moment came (or the fleet cannot have it, e.g. a
    background write in a fleet without asynchronous commits): nothing was proven."""


@dataclass(frozen=True)
class Violation:
    """One check that did not hold, with its first counter-example."""

    check: Check
    detail: str
    """One line a user can act on."""
    server: str | None = None
    """The fleet member the counter-example points at (its fleet-file name)."""
    session: str | None = None
    """The rollout id whose session shows it."""
    step: int | None = None
    """The step of the episode (tool call index from 0) where it first shows."""
    path: str | None = None
    """The first differing JSON path (`$.state.count`, `$.messages[3].content`)."""
    trial: int | None = None
    """The trial that found it (None: the baseline)."""

    def to_json(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, enum.Enum) else v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class TrialPlan:
    """One trial, fully decided by the seed: rerunning it with `--only number` repeats it."""

    number: int
    fault: Fault
    phase: Phase
    target: str | None
    """The member the fault strikes (None: every member, the controller, or the storage)."""
    trigger: str | None = None
    """RESTORE and AFTER_RESUME trials: the member killed first, whose loss makes the
    recovery during which the fault strikes."""
    checkpoint: int = 1
    """The checkpoint (from 1) at whose phase the fault strikes."""
    moment: float = 0.5
    """MID_STEP trials: the fraction of the rollouts finished when the fault strikes."""


@dataclass
class TrialResult:
    """What one trial did and found."""

    plan: TrialPlan
    outcome: Outcome
    violations: list[Violation] = field(default_factory=list)
    restarted: dict[str, str] = field(default_factory=dict)
    """Rollout id -> the reason the product gave for restarting it from its input."""
    seconds: float = 0.0
    note: str = ""
    """Why a trial was not reached, or what the recovery did (one line)."""

    def to_json(self, command: str) -> dict[str, Any]:
        return {
            "number": self.plan.number,
            "fault": str(self.plan.fault),
            "phase": str(self.plan.phase),
            "target": self.plan.target,
            "trigger": self.plan.trigger,
            "checkpoint": self.plan.checkpoint,
            "moment": self.plan.moment,
            "outcome": str(self.outcome),
            "violations": [v.to_json() for v in self.violations],
            "restarted": dict(sorted(self.restarted.items())),
            "seconds": round(self.seconds, 3),
            "note": self.note,
            "command": f"{command} --only {self.plan.number}",
        }


@dataclass(frozen=True)
class ServerFacts:
    """A fleet member as certify saw it (GetParticipant)."""

    name: str
    kind: str
    """`environment`, `policy_model`, `agent` or `resources`."""
    mode: str | None = None
    """A resources server's checkpoint mode (`exported`, `stateless`, `restart_only`)."""


def matrix(trials: Iterable[TrialResult]) -> dict[str, dict[str, Outcome]]:
    """fault -> phase -> the worst outcome of the trials in that cell (violated over held
    over not reached; a cell no trial chose is absent). One violation makes a cell violated:
    a fault survived 99 times and lost state once is not survived."""
    rank = {Outcome.NOT_REACHED: 0, Outcome.HELD: 1, Outcome.VIOLATED: 2}
    cells: dict[str, dict[str, Outcome]] = {}
    for trial in trials:
        row = cells.setdefault(str(trial.plan.fault), {})
        phase = str(trial.plan.phase)
        if phase not in row or rank[trial.outcome] > rank[row[phase]]:
            row[phase] = trial.outcome
    return cells


@dataclass(frozen=True)
class ServerSummary:
    """One row of the per-server table."""

    server: str
    kind: str
    trials: int
    """Trials whose fault struck this member (a fleet-wide fault strikes every member)."""
    faults_survived: int
    """Of those, trials that reached their fault and found nothing pointing at this member."""
    violations: int
    """Violations, of every trial and of the baseline, that point at this member."""


def summaries(
    servers: Sequence[ServerFacts], trials: Sequence[TrialResult], baseline: Sequence[Violation]
) -> list[ServerSummary]:
    """The per-server table, in the fleet file's order."""
    rows = []
    for server in servers:
        struck = [t for t in trials if _strikes(t.plan, server.name)]
        pointed = [v for t in trials for v in t.violations if v.server == server.name]
        pointed += [v for v in baseline if v.server == server.name]
        rows.append(
            ServerSummary(
                server=server.name,
                kind=server.kind,
                trials=len(struck),
                faults_survived=sum(1 for t in struck if _survived(t, server.name)),
                violations=len(pointed),
            )
        )
    return rows


def _survived(trial: TrialResult, member: str) -> bool:
    """A trial that struck `member` found nothing pointing at it (another server's bug in the
    same trial is that server's, not this one's failure to survive), and was reached."""
    if trial.outcome == Outcome.NOT_REACHED:
        return False
    return not any(v.server == member for v in trial.violations)


def _strikes(plan: TrialPlan, member: str) -> bool:
    if plan.fault in (Fault.KILL_FLEET, Fault.STORAGE):
        return True
    return member in (plan.target, plan.trigger)


def all_violations(trials: Iterable[TrialResult], baseline: Iterable[Violation]) -> list[Violation]:
    """The baseline's findings, then every trial's, in trial order."""
    return [*baseline, *(v for t in trials for v in t.violations)]
