"""The named checks of one run against the baseline: one `Violation` per check that fails, and
per server it points at.

Each check walks the rollouts in input order and keeps, for each server, its FIRST
counter-example (the one a user opens first), counting that server's others in `detail`: a
hook that lost a field shows in every rollout, and one precise line is worth more than a
hundred. Per server, not per check: a fleet with two broken servers would otherwise see the
second's failures counted under the first's line, and its summary row say it held. Everything here is a pure
function of two `RunObservation`s, so every check can be shown to fire, and to stay quiet,
on hand-made observations.

What the baseline did not reproduce (`determinism.compare_baselines`) is skipped: a pair
(member, rollout id) skips the checks that would point at that member for that rollout,
("*", rollout id) every check of the rollout. Comparing a trial with a value the baseline
itself could not repeat would blame the fault for the server's nondeterminism.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence, Set
from dataclasses import dataclass, field, replace
from typing import Any

from rollout_checkpoint.client.certify.findings import Check, ServerFacts, Violation
from rollout_checkpoint.client.certify.json_paths import first_difference
from rollout_checkpoint.client.certify.observations import RunObservation
from rollout_checkpoint.client.certify.trajectories import (
    Roles,
    ok_rows,
    reply_of,
    tool_calls_of,
    trajectory_difference,
)

EVERY_CHECK = "*"
"""The server of an `unreproduced` pair that skips every check of its rollout."""


def check_run(
    run: RunObservation,
    baseline: RunObservation,
    *,
    trial: int | None,
    unreproduced: Set[tuple[str, str]] = frozenset(),
    servers: Sequence[ServerFacts] = (),
) -> list[Violation]:
    """Every check of `run` against `baseline`, in `Check`'s order; empty when all held.

    `servers` (the fleet's members as certify saw them) lets a finding name the agent, the
    policy model and a task's resources server when its task row does not say."""
    context = _Context(run, baseline, trial, unreproduced, Roles.of(servers))
    admission = _admission(context)
    return [
        *_finished_exactly_once(context),
        *_trajectories(context),
        *_exports(context),
        *_restores(context),
        *([admission] if admission is not None else []),
        *_refusals(context),
        *_model_calls(context),
        *_acknowledged(context),
    ]


@dataclass
class _Context:
    run: RunObservation
    baseline: RunObservation
    trial: int | None
    unreproduced: Set[tuple[str, str]]
    roles: Roles
    run_rows: dict[str, list[dict[str, Any]]] = field(init=False)
    baseline_rows: dict[str, list[dict[str, Any]]] = field(init=False)

    def __post_init__(self) -> None:
        self.run_rows = ok_rows(self.run)
        self.baseline_rows = ok_rows(self.baseline)

    def skipped(self, server: str | None, rollout_id: str) -> bool:
        if (EVERY_CHECK, rollout_id) in self.unreproduced:
            return True
        return server is not None and (server, rollout_id) in self.unreproduced

    def died_with(self, member: str, rollout_id: str) -> bool:
        """Whether the finished attempt of `rollout_id` was sent before `member` was
        SIGKILLed: its session ended in the killed process and no checkpoint holds it (a
        finished rollout is in no scope), so a missing export is the fault's doing."""
        sent = self.run.sent_before_kill.get(member, ())
        return any(
            (rollout_id, row.get("attempt")) in sent for row in self.run_rows.get(rollout_id, [])
        )

    def task(self, rollout_id: str) -> dict[str, Any]:
        return self.run.tasks.get(rollout_id) or self.baseline.tasks.get(rollout_id) or {}

    def differs_but_restarted(self, rollout_id: str) -> bool:
        """The product restarted the rollout from its input and said why: its trajectory is
        allowed to differ (the trial reports it restarted instead)."""
        return bool(self.run.restarted.get(rollout_id)) and self.trajectory_differs(rollout_id)

    def trajectory_differs(self, rollout_id: str) -> bool:
        expected = self.baseline_rows.get(rollout_id)
        if not expected:
            return False
        return any(
            trajectory_difference(
                reply_of(expected[0]), reply_of(row), self.task(rollout_id), self.roles
            )
            is not None
            for row in self.run_rows.get(rollout_id, [])
        )


def first_of(counter_examples: Iterator[Violation], what: str) -> list[Violation]:
    """Each server's first counter-example, in the order of those firsts, its detail saying
    how many other `what` there are of that server."""
    firsts: dict[str | None, Violation] = {}
    others: dict[str | None, int] = {}
    for example in counter_examples:
        if example.server in firsts:
            others[example.server] += 1
        else:
            firsts[example.server], others[example.server] = example, 0
    return [
        replace(first, detail=f"{first.detail} (and {others[server]} other {what})")
        if others[server]
        else first
        for server, first in firsts.items()
    ]


def _finished_exactly_once(context: _Context) -> list[Violation]:
    def problems() -> Iterator[Violation]:
        expected = set(context.run.expected)
        for rollout_id in context.run.expected:
            if context.skipped(None, rollout_id):
                continue
            count = len(context.run_rows.get(rollout_id, []))
            if count != 1:
                said = "did not finish" if count == 0 else f"finished {count} times"
                yield _violation(
                    context,
                    Check.FINISHED_EXACTLY_ONCE,
                    f"rollout {rollout_id!r} {said}",
                    session=rollout_id,
                )
        for rollout_id in context.run_rows:
            if rollout_id not in expected:
                yield _violation(
                    context,
                    Check.FINISHED_EXACTLY_ONCE,
                    f"rollout {rollout_id!r} finished but is not in the input",
                    session=rollout_id,
                )

    return first_of(problems(), "rollouts")


def _trajectories(context: _Context) -> list[Violation]:
    def problems() -> Iterator[Violation]:
        for rollout_id in context.run.expected:
            expected = context.baseline_rows.get(rollout_id)
            if not expected or context.run.restarted.get(rollout_id):
                continue
            for row in context.run_rows.get(rollout_id, []):
                found = trajectory_difference(
                    reply_of(expected[0]), reply_of(row), context.task(rollout_id), context.roles
                )
                if found is None or context.skipped(found.server, rollout_id):
                    continue
                yield _violation(
                    context,
                    Check.TRAJECTORY_EQUALS_BASELINE,
                    f"rollout {rollout_id!r} differs from the baseline at {found.path}"
                    f" (step {found.step}) and was not reported restarted",
                    server=found.server,
                    session=rollout_id,
                    step=found.step,
                    path=found.path,
                )
                break

    return first_of(problems(), "rollouts")


def _exports(context: _Context) -> list[Violation]:
    members = list(context.baseline.exports)
    members += [m for m in context.run.exports if m not in context.baseline.exports]

    def problems() -> Iterator[Violation]:
        for rollout_id in context.run.expected:
            finished = context.run_rows.get(rollout_id)
            expected_rows = context.baseline_rows.get(rollout_id)
            if not finished or not expected_rows or context.differs_but_restarted(rollout_id):
                continue
            for member in members:
                if context.skipped(member, rollout_id):
                    continue
                expected = context.baseline.exports.get(member, {}).get(rollout_id)
                actual = context.run.exports.get(member, {}).get(rollout_id)
                if actual is None and context.died_with(member, rollout_id):
                    continue
                path = first_difference(expected, actual)
                if path is None:
                    continue
                yield _violation(
                    context,
                    Check.EXPORTED_STATE_EQUALS_BASELINE,
                    export_detail(member, rollout_id, expected, actual, path),
                    server=member,
                    session=rollout_id,
                    step=tool_calls_of(expected_rows[0]),
                    path=path,
                )

    return first_of(problems(), "sessions")


def export_detail(member: str, rollout_id: str, expected: Any, actual: Any, path: str) -> str:
    """One line for a session whose exported state differs from the expected one at `path`."""
    if expected is None:
        return f"{member} exported a session {rollout_id!r} the baseline did not have"
    if actual is None:
        return f"{member} exported no state for session {rollout_id!r}"
    return f"{member}'s exported state of session {rollout_id!r} differs at {path}"


def _restores(context: _Context) -> list[Violation]:
    failures = context.run.restore_failures
    order = [c for c in context.run.published if c in failures]
    order += sorted(c for c in failures if c not in order)
    found = (
        _violation(
            context,
            Check.CHECKPOINTS_RESTORE,
            f"checkpoint {checkpoint!r} did not restore: {failures[checkpoint]}",
        )
        for checkpoint in order
    )
    return first_of(found, "checkpoints")


def _admission(context: _Context) -> Violation | None:
    deadline = context.run.reopen_deadline
    seconds = context.run.reopen_seconds
    if deadline <= 0 or (seconds is not None and seconds <= deadline):
        return None
    said = "never reopened" if seconds is None else f"reopened after {seconds:.1f} s"
    return _violation(
        context, Check.ADMISSION_REOPENS, f"the fleet {said}; the deadline is {deadline:.1f} s"
    )


def _refusals(context: _Context) -> list[Violation]:
    found = (
        _violation(
            context, Check.REFUSALS_TYPED, f"untyped: {line}", server=_member_named(context, line)
        )
        for line in context.run.untyped
    )
    return first_of(found, "untyped refusals")


def _member_named(context: _Context, line: str) -> str | None:
    """The member an untyped line names in its `where: ` prefix (None: not a member)."""
    members = {*context.roles.resources, context.roles.agent, context.roles.policy_model}
    members |= set(context.run.exports)
    where = line.split(":", 1)[0].strip()
    return where if where in members else None


def _model_calls(context: _Context) -> list[Violation]:
    """A replay miss points at the server the rollout's tools hit, not at the policy model:
    the model only replays; the agent asked something new because a tool answered
    differently before it (the policy model when the rollout's task names no server)."""

    def pointed(rollout_id: str) -> str | None:
        return context.roles.resources_of(context.task(rollout_id)) or context.roles.policy_model

    found = (
        _violation(
            context,
            Check.MODEL_CALLS_RECORDED,
            f"rollout {rollout_id!r} asked the policy model something the baseline never asked"
            f" ({path}): a server answered differently, so the agent's next request changed",
            server=pointed(rollout_id),
            session=rollout_id,
        )
        for rollout_id, path in context.run.model_misses
        if not context.skipped(pointed(rollout_id), rollout_id)
    )
    return first_of(found, "calls")


def _acknowledged(context: _Context) -> list[Violation]:
    """A completed run leaves nothing held: `collect` acknowledges every receipt once its
    line is durable, and takes back on `--resume` what a crash left held."""
    if context.run.controller_exit != 0:
        return []
    return [
        _violation(
            context,
            Check.RESULTS_ACKNOWLEDGED,
            f"{member} still holds {count} result(s) under receipts after the run completed",
            server=member,
        )
        for member, count in sorted(context.run.held_after.items())
    ]


def _violation(
    context: _Context,
    check: Check,
    detail: str,
    *,
    server: str | None = None,
    session: str | None = None,
    step: int | None = None,
    path: str | None = None,
) -> Violation:
    return Violation(check, detail, server, session, step, path, context.trial)
