"""The demo's verdict: the continued run against the uninterrupted baseline, and the first
checkpoint's parts against what the rollouts did.

A function of files and replies only (the published checkpoint's records, the replies),
never of a live fleet: what is compared is what a user would find on disk.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from rollout_checkpoint.server.core.part_storage import LocalStorage

from .report import Report
from .rollouts import Rollout

STATE_CHANGES = {
    "update_patient_chart": {"patients"},
    "send_message": {"messages"},
    "prescribe_medication": {"prescriptions"},
    "schedule_appointment": {"appointments"},
    "cancel_appointment": {"appointments"},
    "change_candidate_status": {"candidates"},
    "send_offer": {"offers", "candidates"},
}
"""Which top-level parts of an environment each state-changing tool may touch (plus the id
counters kept in the environment)."""


ID_COUNTERS = "_id_counters"


def finished_during_the_cut(first: dict[str, Any], in_scope: set[str]) -> int:
    """Rollouts in scope that the agent's boundary records as done: they finished while the
    fleet was being cut, so they are answered from the checkpoint, not continued."""
    agent_records = records_by_rollout(Path(first["directory"]), "agent", "agent")
    return sum(
        1
        for rollout_id in in_scope
        if "done" in (json.loads(agent_records.get(rollout_id, "{}")).get("boundary") or {})
    )


def records_by_rollout(directory: Path, kind: str, instance: str) -> dict[str, str]:
    """rollout id -> the record without its episode id, as canonical text (order kept), of
    one member's part of the checkpoint in `directory`. Read with the runtime's own reader
    (`LocalStorage.read_part`), which resolves the reference lines an incremental member
    writes for sessions unchanged since its last part: read raw, those lines hold no record.
    No part there (no checkpoint was taken): no records."""
    if not (directory / "participants" / kind / instance).is_dir():
        return {}
    _, found = LocalStorage().read_part(str(directory), kind, instance, lambda _record: True)
    records: dict[str, str] = {}
    for record in found:
        episode = record.pop("episode_id")
        records[episode["rollout_id"]] = json.dumps(record, ensure_ascii=False)
    return records


def check_trajectories(
    report: Report, rollouts: list[Rollout], baseline: dict[str, Rollout]
) -> None:
    """Every rollout got a reply, and each reply's trajectory equals the baseline's."""
    failed = [r.rollout_id for r in rollouts if r.reply is None]
    report.check("every_rollout_finished", not failed, f"no reply for {failed}")
    differing = [
        r.rollout_id
        for r in rollouts
        if r.reply is not None
        and trajectory_of(r.reply) != trajectory_of(baseline[r.rollout_id].reply or {})
    ]
    report.check(
        "trajectories_equal_baseline", not differing, f"differ from the baseline: {differing}"
    )


def trajectory_of(reply: dict[str, Any]) -> Any:
    """What must equal the baseline: every message (tool calls, arguments, outputs) and the
    verification, without the fields that name the attempt."""
    verify = {k: v for k, v in (reply.get("verify") or {}).items()}
    return {
        "messages": reply.get("messages"),
        "function_calls": reply.get("function_calls"),
        "verify": verify,
        "reward": reply.get("reward"),
    }


def _order_kept(seeded: Any, exported: Any) -> bool:
    if isinstance(seeded, dict) and isinstance(exported, dict):
        common = [k for k in exported if k in seeded]
        if common != [k for k in seeded if k in exported]:
            return False
        return all(_order_kept(seeded[k], exported[k]) for k in common)
    if isinstance(seeded, list) and isinstance(exported, list):
        return all(_order_kept(a, b) for a, b in zip(seeded, exported, strict=False))
    return True


def compare_with_baseline(
    report: Report,
    first: dict[str, Any],
    rollouts: list[Rollout],
    baseline: dict[str, Rollout],
    in_scope: set[str],
    attempt: int,
) -> None:
    check_trajectories(report, rollouts, baseline)
    rewards = [float(r.reply.get("reward") or 0.0) for r in rollouts if r.reply is not None]
    base_rewards = [float((b.reply or {}).get("reward") or 0.0) for b in baseline.values()]
    report.numbers["mean_reward"] = round(statistics.fmean(rewards), 6) if rewards else None
    report.numbers["baseline_mean_reward"] = (
        round(statistics.fmean(base_rewards), 6) if base_rewards else None
    )
    report.check(
        "mean_reward_equals_baseline",
        bool(rewards) and report.numbers["mean_reward"] == report.numbers["baseline_mean_reward"],
        "mean rewards differ",
    )
    agent_records = records_by_rollout(Path(first["directory"]), "agent", "agent")
    prefix_problems = []
    restarted = []
    finished_during = 0
    for rollout in rollouts:
        if rollout.rollout_id not in in_scope or rollout.reply is None:
            continue
        boundary = json.loads(agent_records.get(rollout.rollout_id, "{}")).get("boundary")
        if boundary is None:
            restarted.append(rollout.rollout_id)
            continue
        if "done" in boundary:  # finished while the fleet was being cut: its reply was carried
            finished_during += 1
            relayed = {
                k: v for k, v in rollout.reply.items() if k not in ("environment", "task_digest")
            }
            if relayed != boundary["done"]:
                prefix_problems.append(f"{rollout.rollout_id}(carried reply differs)")
            continue
        checkpointed = boundary["messages"]
        if rollout.reply.get("messages", [])[: len(checkpointed)] != checkpointed:
            prefix_problems.append(rollout.rollout_id)
        if (
            rollout.reply.get("attempt") != attempt
            or rollout.reply.get("continued_from_step") != boundary["step"]
        ):
            prefix_problems.append(f"{rollout.rollout_id}(not continued)")
    report.numbers["finished_during_checkpoint"] = finished_during
    report.numbers["continued"] = len(in_scope) - len(restarted) - finished_during
    report.numbers["restarted"] = len(restarted)
    report.numbers["retired"] = 0
    report.check("continued_from_checkpointed_calls", not prefix_problems, f"{prefix_problems}")
    report.check("no_restarts", not restarted, f"restarted from input: {restarted}")
    check_exports(report, first, rollouts, agent_records)


def check_exports(
    report: Report, first: dict[str, Any], rollouts: list[Rollout], agent_records: dict[str, str]
) -> None:
    """Each exported environment differs from its seed only where a call the agent made may
    change it, with the seeded key order kept: a restore that replayed, lost or reordered
    state would show here, not only in a final reward."""
    tasks = {r.rollout_id: r.task for r in rollouts}
    exports = records_by_rollout(Path(first["directory"]), "resources", "prompt_injection")
    problems = []
    for rollout_id, raw in exports.items():
        environment = json.loads(raw)["state"]["environment"]
        seeded = tasks[rollout_id]["environment"]
        boundary = json.loads(agent_records.get(rollout_id, "{}")).get("boundary") or {}
        called = {c["name"] for c in boundary.get("function_calls", [])}
        allowed = set().union(*(STATE_CHANGES.get(name, set()) for name in called)) | (
            {ID_COUNTERS} if called & set(STATE_CHANGES) else set()
        )
        changed = {k for k in set(environment) | set(seeded) if environment.get(k) != seeded.get(k)}
        if not changed <= allowed:
            problems.append(
                f"{rollout_id}: {sorted(changed - allowed)} changed without a call that changes them"
            )
        if not _order_kept(seeded, environment):
            problems.append(f"{rollout_id}: the seeded key order was not kept")
    report.numbers["environments_checked"] = len(exports)
    report.check("exports_differ_only_where_state_changed", not problems, "; ".join(problems[:5]))
