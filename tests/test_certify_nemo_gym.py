"""`rollout-checkpoint certify` on NeMo Gym's own counter and IPI servers: every check holds.

The example fleet (environment, scripted policy model, agent) with its two resources members
served by NeMo Gym 0.4.0's servers, `rollout-checkpoint serve nemo-gym:<server>` from the env
beside nemo-gym (`beside_nemo_gym`), on ports moved to free ones. One tasks file drives both:
the shipped prompt-injection tasks routed to `prompt_injection` and counter tasks routed to
`counter` (each row's `resources_server`). The seeded trials SIGKILL each NeMo Gym member
(mid-step, and while the fleet restores) and SIGSTOP the counter past its lease while the fleet
restores: each recovery restores NeMo Gym's own session state into a fresh process of it.

NeMo Gym's counter keeps a session's count past `/verify`, so the baseline exports every
counter session and the exported-state check compares each trial's with it: a restore that
applied a tool call twice would show at `$.count`. IPI drops a session's environment at
`/verify` (FACTS.md), so an ended IPI session exports nothing to compare.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from rollout_checkpoint.client.certify.findings import REPORT_FORMAT
from rollout_checkpoint.client.certify.plan import plan_trials
from rollout_checkpoint.client.cli.console import ExitCode

from .certify_fleet import EXAMPLE_TASKS, example_fleet, load
from .test_certify import certify
from .test_fleet_launch import write_fleet
from .test_nemo_gym_checkpoint import serve_command
from .test_nemo_gym_install import beside_nemo_gym as beside_nemo_gym  # the shared fixtures
from .test_nemo_gym_smoke import COUNTER, IPI
from .test_nemo_gym_smoke import nemo_env as nemo_env

SEED = 293
TRIALS = 3
"""`--seed 293 --trials 3` SIGKILLs `prompt_injection` mid-step, SIGSTOPs `counter` during the
restore and SIGKILLs `counter` during the restore (`test_the_plan_faults_both_nemo_gym_members`)."""
MEMBERS = ["environment", "policy_model", "agent", "prompt_injection", "counter"]
NEMO_GYM_MEMBERS = {"prompt_injection": IPI, "counter": COUNTER}
RANDOM_OUTPUT_TOOLS = frozenset(
    {
        "schedule_appointment",
        "schedule_inspection",
        "schedule_interview",
        "create_claim",
        "create_course",
        "create_incident",
        "create_job_posting",
        "create_property",
        "create_support_ticket",
        "create_document_filing",
        "add_adjuster_note",
        "add_billing_entry",
        "add_warehouse_inventory",
        "flag_fraud_investigation",
        "process_payout",
        "send_carrier_message",
        "submit_customs_declaration",
        "submit_grade",
        "submit_interview_feedback",
    }
)
"""NeMo Gym IPI tools whose output holds a fresh `uuid4` id (FACTS.md): two runs of a task
calling one differ, which certify rightly reports as not deterministic. Tasks that call one
(or whose injection targets one) are left out."""
COUNTER_STEPS = 6
COUNTER_TASKS = 3


def nemo_gym_fleet(directory: Path, python: Path, tasks: Path) -> Path:
    """The example fleet moved to free ports, its resources members NeMo Gym's servers on the
    same addresses, and the scripted model following `tasks`."""
    fleet, _ = example_fleet(directory)
    spec = load(fleet)
    participants: list[dict[str, Any]] = []
    for member in spec.members:
        command = list(member.command)
        if member.name in NEMO_GYM_MEMBERS:
            addresses = [
                argument
                for flag in ("--http-address", "--grpc-address")
                for argument in (flag, command[command.index(flag) + 1])
            ]
            command = serve_command(python, NEMO_GYM_MEMBERS[member.name], *addresses)
        elif member.name == "policy_model":
            command += ["--tasks", str(tasks)]
        participants.append(
            {
                "name": member.name,
                "address": member.address,
                "command": command,
                "env": dict(member.env),
            }
        )
    return write_fleet(fleet, participants, checkpoint_root=str(directory / "checkpoints"))


def ipi_tasks() -> list[dict[str, Any]]:
    """The shipped prompt-injection tasks whose calls NeMo Gym's IPI answers deterministically."""
    rows = [json.loads(line) for line in EXAMPLE_TASKS.read_text().splitlines() if line.strip()]
    return [
        {**row, "resources_server": "prompt_injection"}
        for row in rows
        if not RANDOM_OUTPUT_TOOLS & called(row)
    ]


def called(row: dict[str, Any]) -> set[str]:
    """The tools a task's episode may call: its plan's, and its injection's target."""
    return {step["name"] for step in row["reference_plan"]} | {row["injection"]["target_tool"]}


def counter_tasks() -> list[dict[str, Any]]:
    """Counter episodes as NeMo Gym's counter takes them: `initial_count` at the row's top
    (its `/seed_session` gets the whole row), `expected_count` for its `/verify`."""
    return [
        {
            "task_id": f"count-{start}",
            "resources_server": "counter",
            "user_prompt": f"The counter starts at {start}: add 1, then 2, up to "
            f"{COUNTER_STEPS}, one at a time, then read it.",
            "initial_count": start,
            "reference_plan": [
                *(
                    {"name": "increment_counter", "arguments": {"count": count}}
                    for count in range(1, COUNTER_STEPS + 1)
                ),
                {"name": "get_counter_value", "arguments": {}},
            ],
            "verify_args": {"expected_count": start + sum(range(1, COUNTER_STEPS + 1))},
        }
        for start in range(1, COUNTER_TASKS + 1)
    ]


def interleaved(*sources: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row of each in turn: both servers have rollouts in flight whenever a fault strikes
    (the collector dispatches in file order)."""
    rows = [row for group in itertools.zip_longest(*sources) for row in group if row is not None]
    return rows


@pytest.fixture(scope="module")
def certified(beside_nemo_gym: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One certify run of the fleet (cwd outside the repo: nemo-gym's top-level `benchmarks`
    package would be shadowed by ours)."""
    work = tmp_path_factory.mktemp("certify-nemo-gym")
    tasks = work / "tasks.jsonl"
    rows = interleaved(counter_tasks(), ipi_tasks())
    tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))
    fleet = nemo_gym_fleet(work, beside_nemo_gym, tasks)
    report = work / "report"
    args = ["--fleet", str(fleet), "--tasks", str(tasks), "--trials", str(TRIALS)]
    args += ["--seed", str(SEED), "--report", str(report), "--json"]
    completed = certify(*args, cwd=work)
    return {"completed": completed, "report": report, "rollouts": len(rows)}


def test_the_plan_faults_both_nemo_gym_members() -> None:
    plans = [(p.fault.value, p.phase.value, p.target) for p in plan_trials(SEED, TRIALS, MEMBERS)]
    assert plans == [
        ("kill_member", "mid_step", "prompt_injection"),
        ("stop_member", "restore", "counter"),
        ("kill_member", "restore", "counter"),
    ]


@pytest.mark.slow  # two minutes of CI's 30-minute budget; `-m slow` runs it
def test_every_check_holds_on_nemo_gyms_servers(certified: dict[str, Any]) -> None:
    completed = certified["completed"]
    assert completed.returncode == ExitCode.OK, completed.stderr[-6000:]
    report = json.loads((certified["report"] / "report.json").read_text())
    assert report["format"] == REPORT_FORMAT
    assert report["verdict"] == "held", report["findings"]
    assert report["findings"] == []
    assert {s["name"]: (s["kind"], s["mode"]) for s in report["servers"]} == {
        "environment": ("environment", None),
        "policy_model": ("policy_model", None),
        "agent": ("agent", None),
        "prompt_injection": ("resources", "exported"),
        "counter": ("resources", "exported"),
    }
    assert report["baseline"]["rollouts"] == certified["rollouts"]
    # Every counter session's state, kept past /verify, is what each trial is compared with;
    # IPI keeps none past /verify.
    assert report["baseline"]["exported_sessions"] == {
        "counter": COUNTER_TASKS,
        "prompt_injection": 0,
    }
    outcomes = [(t["fault"], t["phase"], t["target"], t["outcome"]) for t in report["trials"]]
    assert all(outcome == "held" for *_, outcome in outcomes), outcomes
