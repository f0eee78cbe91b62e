"""certify's checks of one run against the baseline (client/certify/invariants.py).

Each check on hand-made observations: quiet on a run that went like the baseline, firing on
the counter-example it exists for with the server, session, step and path a user needs, its
first counter-example first and the others counted, and skipped where the baseline itself
did not reproduce.
"""

from __future__ import annotations

from collections.abc import Set

from rollout_checkpoint.client.certify.findings import Check, ServerFacts, Violation
from rollout_checkpoint.client.certify.invariants import check_run
from rollout_checkpoint.client.certify.observations import RunObservation

from .certify_runs import SERVERS, baseline, like, ok_line, reply, row_of, set_reply


def checks(
    run: RunObservation, base: RunObservation, unreproduced: Set[tuple[str, str]] = frozenset()
) -> list[Violation]:
    return check_run(run, base, trial=7, unreproduced=unreproduced, servers=SERVERS)


def only(found: list[Violation], check: Check) -> Violation:
    assert [v.check for v in found] == [check], found
    return found[0]


def test_a_run_like_the_baseline_holds_every_check() -> None:
    base = baseline()
    assert checks(like(base), base) == []
    # Another attempt (a continued rollout) and a rebuilt dict order are the same trajectory.
    run = like(base)
    row_of(run, "t1.0")["attempt"] = 1
    row_of(run, "t1.0")["reply"]["attempt"] = 1
    run.exports["counter"]["t1.0"] = {"log": ["inc", "inc", "inc"], "count": 3}
    assert checks(run, base) == []


def test_a_missing_a_duplicated_and_an_unexpected_rollout_each_break_finished_once() -> None:
    base = baseline()
    run = like(base)
    run.rows = [r for r in run.rows if r["rollout_id"] != "t2.0"]
    run.rows.append(ok_line("t3.0", reply(["1", "2", "3"]), attempt=1))
    run.rows.append(ok_line("t9.0", reply(["1"])))
    found = only(checks(run, base), Check.FINISHED_EXACTLY_ONCE)
    assert found.session == "t2.0"  # input order: t2 before t3, expected before unexpected
    assert found.trial == 7
    assert "did not finish" in found.detail and "(and 2 other rollouts)" in found.detail


def test_a_failed_line_is_not_a_finished_rollout() -> None:
    base = baseline()
    run = like(base)
    row_of(run, "t3.0")["status"] = "failed"
    found = only(checks(run, base), Check.FINISHED_EXACTLY_ONCE)
    assert (found.session, found.detail) == ("t3.0", "rollout 't3.0' did not finish")


def test_a_tool_output_that_differs_points_at_the_tasks_resources_server() -> None:
    base = baseline()
    run = like(base)
    set_reply(run, "t2.0", reply(["1", "3", "4"]))  # the second call was applied twice
    found = checks(run, base)
    assert [v.check for v in found] == [Check.TRAJECTORY_EQUALS_BASELINE]
    assert (found[0].server, found[0].session) == ("counter", "t2.0")
    assert (found[0].step, found[0].path) == (1, "$.messages[5].content")
    assert "other rollouts" not in found[0].detail


def test_a_message_the_agent_wrote_points_at_the_agent() -> None:
    base = baseline()
    run = like(base)
    set_reply(run, "t1.0", reply(["1", "2", "3"], final="something else"))
    set_reply(run, "t3.0", reply(["1", "2", "3"], final="other"))
    found = only(checks(run, base), Check.TRAJECTORY_EQUALS_BASELINE)
    assert (found.server, found.session, found.step) == ("agent", "t1.0", 3)
    assert found.path == "$.messages[8].content"
    assert found.detail.endswith("(and 1 other rollouts)")


def test_each_server_a_check_points_at_gets_a_finding_of_its_own() -> None:
    """Two resources servers both wrong in one run: the first one's finding must not hide
    the other's (its summary row would then say it held), and each counts only its own."""
    base = baseline()
    base.tasks["t3.0"]["resources_server"] = "prompt_injection"
    run = like(base)
    set_reply(run, "t1.0", reply(["1", "2", "3"], reward=0.0))
    set_reply(run, "t2.0", reply(["1", "2", "3"], reward=0.0))
    set_reply(run, "t3.0", reply(["1", "2", "3"], reward=0.0))
    found = checks(run, base)
    assert [(v.check, v.server, v.session) for v in found] == [
        (Check.TRAJECTORY_EQUALS_BASELINE, "counter", "t1.0"),
        (Check.TRAJECTORY_EQUALS_BASELINE, "prompt_injection", "t3.0"),
    ]
    assert found[0].detail.endswith("(and 1 other rollouts)")
    assert "other rollouts" not in found[1].detail


def test_a_reward_or_verification_that_differs_points_at_the_resources_server() -> None:
    base = baseline()
    run = like(base)
    set_reply(run, "t1.0", reply(["1", "2", "3"], reward=0.0))
    found = only(checks(run, base), Check.TRAJECTORY_EQUALS_BASELINE)
    assert (found.server, found.step, found.path) == ("counter", 3, "$.verify.reward")


def test_a_task_without_resources_server_points_at_the_only_resources_member() -> None:
    base = baseline()
    for task in base.tasks.values():
        del task["resources_server"]
    run = like(base)
    set_reply(run, "t1.0", reply(["1", "9", "3"]))
    servers = [s for s in SERVERS if s.name != "prompt_injection"]
    found = check_run(run, base, trial=1, servers=servers)
    assert only(found, Check.TRAJECTORY_EQUALS_BASELINE).server == "counter"
    # Two resources members and no name in the task: the finding cannot tell.
    found = check_run(run, base, trial=1, servers=SERVERS)
    assert only(found, Check.TRAJECTORY_EQUALS_BASELINE).server is None


def test_a_restarted_rollout_may_differ_when_the_product_said_why() -> None:
    base = baseline()
    run = like(base)
    set_reply(run, "t1.0", reply(["1", "2"]))
    run.exports["counter"]["t1.0"] = {"count": 2, "log": ["inc", "inc"]}
    run.restarted["t1.0"] = "its checkpointed session was lost with the counter"
    assert checks(run, base) == []
    run.restarted["t1.0"] = ""  # a restart without a reason is no excuse
    found = checks(run, base)
    assert [v.check for v in found] == [
        Check.TRAJECTORY_EQUALS_BASELINE,
        Check.EXPORTED_STATE_EQUALS_BASELINE,
    ]


def test_an_exported_state_that_differs_names_the_member_session_step_and_path() -> None:
    base = baseline()
    run = like(base)
    run.exports["counter"]["t3.0"] = {"count": 4, "log": ["inc", "inc", "inc", "inc"]}
    found = only(checks(run, base), Check.EXPORTED_STATE_EQUALS_BASELINE)
    assert (found.server, found.session, found.step, found.path) == (
        "counter",
        "t3.0",
        3,
        "$.count",
    )
    assert found.detail == "counter's exported state of session 't3.0' differs at $.count"


def test_a_session_exported_on_one_side_only_differs_at_the_root() -> None:
    base = baseline()
    run = like(base)
    del run.exports["counter"]["t1.0"]
    run.exports["prompt_injection"] = {"t2.0": {"environment": {}}}
    missing, extra = checks(run, base)
    assert {missing.check, extra.check} == {Check.EXPORTED_STATE_EQUALS_BASELINE}
    assert (missing.server, missing.session, missing.path) == ("counter", "t1.0", "$")
    assert missing.detail == "counter exported no state for session 't1.0'"
    assert (extra.server, extra.session, extra.path) == ("prompt_injection", "t2.0", "$")
    assert "a session 't2.0' the baseline did not have" in extra.detail


def test_a_session_that_ended_in_a_killed_member_is_not_missing_but_a_later_one_is() -> None:
    """A rollout that finished before its member was SIGKILLed took its ended session with the
    process (no checkpoint scope holds a finished rollout): not the server's fault. An attempt
    sent after the kill can only have lived in the replacement, which must export it."""
    base = baseline()
    run = like(base)
    del run.exports["counter"]["t1.0"]
    run.sent_before_kill = {"counter": [("t1.0", 0), ("t2.0", 0)]}
    assert checks(run, base) == []
    run.sent_before_kill = {"counter": [("t1.0", 1)], "prompt_injection": [("t1.0", 0)]}
    found = only(checks(run, base), Check.EXPORTED_STATE_EQUALS_BASELINE)
    assert (found.server, found.session) == ("counter", "t1.0")
    run.sent_before_kill = {"counter": [("t1.0", 0)]}
    run.exports["counter"]["t1.0"] = {"count": 99, "log": []}
    found = only(checks(run, base), Check.EXPORTED_STATE_EQUALS_BASELINE)
    assert (found.session, found.path) == ("t1.0", "$.count")


def test_a_rollout_that_did_not_finish_is_not_also_an_export_finding() -> None:
    base = baseline()
    run = like(base)
    run.rows = [r for r in run.rows if r["rollout_id"] != "t1.0"]
    del run.exports["counter"]["t1.0"]
    assert [v.check for v in checks(run, base)] == [Check.FINISHED_EXACTLY_ONCE]


def test_what_the_baseline_did_not_reproduce_is_skipped() -> None:
    base = baseline()
    run = like(base)
    set_reply(run, "t2.0", reply(["1", "5", "6"]))
    run.exports["counter"]["t2.0"] = {"count": 0, "log": []}
    run.model_misses.append(("t2.0", "/rollouts/t2.0/v1/chat/completions"))
    assert checks(run, base, unreproduced={("*", "t2.0")}) == []
    # Only the counter was unreproduced for t2.0: every finding pointing at it is skipped,
    # the model call its different answers made the agent ask included.
    assert checks(run, base, unreproduced={("counter", "t2.0")}) == []
    found = checks(run, base, unreproduced={("prompt_injection", "t2.0")})
    assert [v.check for v in found] == [
        Check.TRAJECTORY_EQUALS_BASELINE,
        Check.EXPORTED_STATE_EQUALS_BASELINE,
        Check.MODEL_CALLS_RECORDED,
    ]


def test_a_checkpoint_that_did_not_restore_is_named_in_publication_order() -> None:
    base = baseline()
    run = like(base)
    run.published = ["ckpt-2", "ckpt-1"]
    assert checks(run, base) == []
    run.restore_failures = {"ckpt-1": "a part's digest does not verify", "ckpt-2": "no LATEST"}
    found = only(checks(run, base), Check.CHECKPOINTS_RESTORE)
    assert (
        found.detail == "checkpoint 'ckpt-2' did not restore: no LATEST (and 1 other checkpoints)"
    )


def test_admission_must_reopen_within_the_deadline() -> None:
    base = baseline()
    run = like(base)
    run.reopen_deadline = 10.0
    run.reopen_seconds = 3.5
    assert checks(run, base) == []
    run.reopen_seconds = 12.0
    assert "reopened after 12.0 s" in only(checks(run, base), Check.ADMISSION_REOPENS).detail
    run.reopen_seconds = None
    assert "never reopened" in only(checks(run, base), Check.ADMISSION_REOPENS).detail
    run.reopen_deadline = 0.0  # a run without a fault measures nothing
    assert checks(run, base) == []


def test_a_result_still_held_after_a_completed_run_names_the_entry_member() -> None:
    base = baseline()
    run = like(base)
    run.controller_exit = 0
    run.held_after = {"environment": 2}
    found = only(checks(run, base), Check.RESULTS_ACKNOWLEDGED)
    assert found.server == "environment"
    assert "still holds 2 result(s)" in found.detail
    run.controller_exit = 5  # a run that stopped early may leave results held for its resume
    assert checks(run, base) == []


def test_an_untyped_refusal_names_the_member_it_came_from() -> None:
    base = baseline()
    run = like(base)
    run.untyped = ["counter: HTTP 500 without a reason", "collector: exit code 70"]
    found = checks(run, base)
    assert [(v.check, v.server, v.detail) for v in found] == [
        (Check.REFUSALS_TYPED, "counter", "untyped: counter: HTTP 500 without a reason"),
        (Check.REFUSALS_TYPED, None, "untyped: collector: exit code 70"),
    ]
    run.untyped = ["collector: exit code 70"]
    assert only(checks(run, base), Check.REFUSALS_TYPED).server is None


def test_a_model_call_the_baseline_never_made_points_at_the_rollouts_server() -> None:
    """The model only replays: a call it never recorded means a tool of the rollout's server
    answered differently before it, so the finding names that server, not the model."""
    base = baseline()
    run = like(base)
    run.model_misses = [("t3.0", "/rollouts/t3.0/v1/chat/completions")]
    found = only(checks(run, base), Check.MODEL_CALLS_RECORDED)
    assert (found.server, found.session, found.trial) == ("counter", "t3.0", 7)


def test_every_check_that_fails_is_one_violation_in_the_checks_order() -> None:
    base = baseline()
    run = like(base, "trial 3")
    run.rows.append(ok_line("t1.0", reply(["1", "2", "3"]), attempt=1))
    set_reply(run, "t3.0", reply(["1", "2", "4"]))
    run.exports["counter"]["t3.0"]["count"] = 4
    run.restore_failures = {"ckpt-1": "truncated"}
    run.reopen_deadline, run.reopen_seconds = 5.0, None
    run.untyped = ["agent: Traceback"]
    run.model_misses = [("t3.0", "/v1/chat/completions")]
    found = check_run(run, base, trial=3, servers=[ServerFacts("agent", "agent")])
    assert [v.check for v in found] == [
        Check.FINISHED_EXACTLY_ONCE,
        Check.TRAJECTORY_EQUALS_BASELINE,
        Check.EXPORTED_STATE_EQUALS_BASELINE,
        Check.CHECKPOINTS_RESTORE,
        Check.ADMISSION_REOPENS,
        Check.REFUSALS_TYPED,
        Check.MODEL_CALLS_RECORDED,
    ]
    assert {v.trial for v in found} == {3}
