"""The prompt-injection tasks shipped with the examples (`prompt_injection_tasks.jsonl`).

One file for the server, the scripted policy model and the demo alike: a task's seed, its
injection and its reference plan must be the very rows every process of a fleet reads, or a
restored rollout would be scored against another task than the one it ran.
"""

from __future__ import annotations

import importlib.resources
import json
from typing import Any

TASKS_FILE = "prompt_injection_tasks.jsonl"


def load_tasks() -> list[dict[str, Any]]:
    """The example tasks shipped with the package (JSON lines, one task a line).

    Each task: `task_id`, `domain`, `user_prompt`, `environment` (the seed), `injection`
    (`goal`, `target_tool`, `target_args`, `verification_type`, `injection_text`, `vector`,
    `attack_strategy`, `attack_difficulty`, `category`) and `required_tools`.
    """
    text = (
        importlib.resources.files("rollout_checkpoint.examples")
        .joinpath(TASKS_FILE)
        .read_text(encoding="utf-8")
    )
    return [json.loads(line) for line in text.splitlines() if line.strip()]
