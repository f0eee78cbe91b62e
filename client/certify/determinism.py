"""The baseline against its second pass: what the user's servers do not reproduce.

The baseline runs twice, the second time at another concurrency and replaying the first
pass's model calls. Whatever still differs came from a server, not from sampling: state
shared across sessions (a second rollout sees the first's writes), the wall clock, a hash
or set order. Each such server is reported once, with the session, the step and the first
differing path of its first counter-example, a difference of its exported state before one
of its replies (`$.count` names the field that drifts; `$.messages[3].content` only shows
that a reply changed); and every rollout it touched is handed to the
trials as unreproduced, because a trial compared with a value the baseline could not repeat
would blame the fault for the server's nondeterminism.

A rollout whose replies differ (or whose second pass asked the model something new) is
unreproduced as a whole (`"*"`): every later check of it reads that trajectory. A rollout
whose replies agree but whose exported state of one member differs is unreproduced for that
member only. A rollout that did not finish in one pass is unreproduced as a whole too; the
baseline's own `every_rollout_finishes_exactly_once` reports it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from rollout_checkpoint.client.certify.findings import Check, ServerFacts, Violation
from rollout_checkpoint.client.certify.invariants import EVERY_CHECK, export_detail, first_of
from rollout_checkpoint.client.certify.json_paths import first_difference
from rollout_checkpoint.client.certify.observations import RunObservation
from rollout_checkpoint.client.certify.trajectories import (
    Roles,
    ok_rows,
    reply_of,
    tool_calls_of,
    trajectory_difference,
)

Unreproduced = tuple[str, str]
"""(member or "*", rollout id)."""


def compare_baselines(
    first: RunObservation, second: RunObservation, *, servers: Sequence[ServerFacts] = ()
) -> tuple[list[Violation], set[Unreproduced]]:
    """DETERMINISTIC findings (one per server that did not reproduce, with its first
    counter-example: its exports', then its replies', each in input order) and the pairs
    the trials must skip. `servers` names
    the agent, the policy model and, for tasks that do not say, the resources member."""
    roles = Roles.of(servers)
    found = [
        *_exports(first, second),
        *_replies(first, second, roles),
        *_model_misses(second, roles),
    ]
    unreproduced = {pair for _, pair in found}
    unreproduced |= {(EVERY_CHECK, rollout_id) for rollout_id in _unfinished(first, second)}
    return _one_per_server([violation for violation, _ in found]), unreproduced


def _replies(
    first: RunObservation, second: RunObservation, roles: Roles
) -> Iterator[tuple[Violation, Unreproduced]]:
    first_rows, second_rows = ok_rows(first), ok_rows(second)
    for rollout_id in first.expected:
        if not first_rows.get(rollout_id) or not second_rows.get(rollout_id):
            continue
        task = first.tasks.get(rollout_id) or {}
        found = trajectory_difference(
            reply_of(first_rows[rollout_id][0]), reply_of(second_rows[rollout_id][0]), task, roles
        )
        if found is None:
            continue
        detail = (
            f"rollout {rollout_id!r} got another reply in the second baseline pass at"
            f" {found.path} (step {found.step})"
        )
        violation = Violation(
            Check.DETERMINISTIC, detail, found.server, rollout_id, found.step, found.path
        )
        yield violation, (EVERY_CHECK, rollout_id)


def _exports(
    first: RunObservation, second: RunObservation
) -> Iterator[tuple[Violation, Unreproduced]]:
    first_rows = ok_rows(first)
    members = [*first.exports, *(m for m in second.exports if m not in first.exports)]
    unfinished = set(_unfinished(first, second))
    for rollout_id in first.expected:
        if rollout_id in unfinished:
            continue  # a session cut short exports less, and is skipped as a whole anyway
        for member in members:
            expected = first.exports.get(member, {}).get(rollout_id)
            actual = second.exports.get(member, {}).get(rollout_id)
            path = first_difference(expected, actual)
            if path is None:
                continue
            violation = Violation(
                Check.DETERMINISTIC,
                export_detail(member, rollout_id, expected, actual, path)
                + " in the second baseline pass",
                member,
                rollout_id,
                tool_calls_of(first_rows[rollout_id][0]),
                path,
            )
            yield violation, (member, rollout_id)


def _model_misses(second: RunObservation, roles: Roles) -> Iterator[tuple[Violation, Unreproduced]]:
    for rollout_id, path in second.model_misses:
        detail = (
            f"rollout {rollout_id!r} asked the policy model something new in the second"
            f" baseline pass ({path}): a reply before it was not reproduced"
        )
        violation = Violation(Check.DETERMINISTIC, detail, roles.policy_model, rollout_id)
        yield violation, (EVERY_CHECK, rollout_id)


def _unfinished(first: RunObservation, second: RunObservation) -> list[str]:
    first_rows, second_rows = ok_rows(first), ok_rows(second)
    return [r for r in first.expected if not first_rows.get(r) or not second_rows.get(r)]


def _one_per_server(found: Sequence[Violation]) -> list[Violation]:
    """One finding per server (in the order the servers first show), its first
    counter-example with the count of the others."""
    return first_of(iter(found), "sessions")
