"""The baseline against its second pass (client/certify/determinism.py).

A server that answers or exports differently when the same tasks run again is named once,
with its first counter-example; the rollouts it touched are handed to the trials as
unreproduced, and the trials' checks then skip exactly those.
"""

from __future__ import annotations

from rollout_checkpoint.client.certify.determinism import compare_baselines
from rollout_checkpoint.client.certify.findings import Check
from rollout_checkpoint.client.certify.invariants import check_run

from .certify_runs import SERVERS, baseline, like, reply, set_reply


def test_two_passes_that_agree_find_nothing_and_skip_nothing() -> None:
    first = baseline()
    assert compare_baselines(first, like(first, "baseline-2"), servers=SERVERS) == ([], set())


def test_replies_that_differ_name_the_server_once_and_unreproduce_the_rollouts() -> None:
    first = baseline()
    second = like(first, "baseline-2")
    # A counter shared across sessions: the second pass's t2 and t3 see t1's increments.
    set_reply(second, "t2.0", reply(["4", "5", "6"]))
    set_reply(second, "t3.0", reply(["1", "2", "7"]))
    second.exports["counter"]["t2.0"]["count"] = 6
    findings, unreproduced = compare_baselines(first, second, servers=SERVERS)
    assert [(v.check, v.server, v.session) for v in findings] == [
        (Check.DETERMINISTIC, "counter", "t2.0")
    ]
    # The field that drifts before the reply that shows it; t2's and t3's replies counted.
    assert (findings[0].step, findings[0].path, findings[0].trial) == (3, "$.count", None)
    assert "(and 2 other sessions)" in findings[0].detail
    assert unreproduced == {("*", "t2.0"), ("*", "t3.0"), ("counter", "t2.0")}


def test_an_export_that_differs_alone_unreproduces_that_member_only() -> None:
    first = baseline()
    second = like(first, "baseline-2")
    second.exports["counter"]["t1.0"]["log"] = ["inc", "inc", "inc", "tick"]  # a wall-clock timer
    findings, unreproduced = compare_baselines(first, second, servers=SERVERS)
    assert len(findings) == 1
    finding = findings[0]
    assert (finding.server, finding.session, finding.step, finding.path) == (
        "counter",
        "t1.0",
        3,
        "$.log[3]",
    )
    assert "in the second baseline pass" in finding.detail
    assert unreproduced == {("counter", "t1.0")}


def test_a_model_call_the_second_pass_made_anew_is_a_finding() -> None:
    first = baseline()
    second = like(first, "baseline-2")
    second.model_misses = [("t3.0", "/rollouts/t3.0/v1/chat/completions")]
    findings, unreproduced = compare_baselines(first, second, servers=SERVERS)
    assert [(v.server, v.session) for v in findings] == [("policy_model", "t3.0")]
    assert unreproduced == {("*", "t3.0")}


def test_a_rollout_unfinished_in_one_pass_is_skipped_without_a_determinism_finding() -> None:
    first = baseline()
    second = like(first, "baseline-2")
    second.rows = [r for r in second.rows if r["rollout_id"] != "t1.0"]
    del second.exports["counter"]["t1.0"]
    findings, unreproduced = compare_baselines(first, second, servers=SERVERS)
    assert (findings, unreproduced) == ([], {("*", "t1.0")})
    # Its finished-once finding belongs to the second pass's own check.
    own = check_run(second, first, trial=None, servers=SERVERS)
    assert [v.check for v in own] == [Check.FINISHED_EXACTLY_ONCE]


def test_each_server_that_did_not_reproduce_is_one_finding_exports_first() -> None:
    first = baseline()
    first.exports["prompt_injection"] = {"t1.0": {"environment": {"mail": []}}}
    second = like(first, "baseline-2")
    second.exports["prompt_injection"]["t1.0"]["environment"]["mail"] = ["x"]
    set_reply(second, "t2.0", reply(["1", "2", "3"], final="bye"))
    findings, _ = compare_baselines(first, second, servers=SERVERS)
    assert [(v.server, v.session, v.path) for v in findings] == [
        ("prompt_injection", "t1.0", "$.environment.mail[0]"),
        ("agent", "t2.0", "$.messages[8].content"),
    ]


def test_the_trials_skip_exactly_what_the_baseline_did_not_reproduce() -> None:
    first = baseline()
    second = like(first, "baseline-2")
    set_reply(second, "t1.0", reply(["1", "2", "9"]))
    _, unreproduced = compare_baselines(first, second, servers=SERVERS)
    trial = like(first, "trial 1")
    set_reply(trial, "t1.0", reply(["1", "2", "8"]))  # unreproduced: not the fault's doing
    assert check_run(trial, first, trial=1, unreproduced=unreproduced, servers=SERVERS) == []
    set_reply(trial, "t2.0", reply(["1", "2", "8"]))  # reproduced: a finding
    found = check_run(trial, first, trial=1, unreproduced=unreproduced, servers=SERVERS)
    assert [(v.check, v.session) for v in found] == [(Check.TRAJECTORY_EQUALS_BASELINE, "t2.0")]
