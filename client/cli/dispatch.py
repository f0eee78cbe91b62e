"""Running a parsed verb other than `serve`, `demo`, `collect` and `participant`: the fleet
verbs, `health`, `inspect`, `history` and `coordinator` (the modules are listed in the package's
docstring). Every verb ends through `console.run_verb` with `errors.classify`.
"""

from __future__ import annotations

import argparse
import asyncio

from rollout_checkpoint.client.cli.console import run_async
from rollout_checkpoint.client.cli.coordinator_verb import coordinator_verb
from rollout_checkpoint.client.cli.fleet_verbs import fleet_command
from rollout_checkpoint.client.cli.history_verb import history_verb
from rollout_checkpoint.client.cli.inspection import inspect_verb
from rollout_checkpoint.client.cli.parsers import FLEET_VERBS
from rollout_checkpoint.client.cli.status import health_verb
from rollout_checkpoint.server.core.stop_signals import PROCESS


def is_fleet_command(name: str) -> bool:
    """Whether `name` is a verb `run` handles (a fleet verb, `inspect`, `history`,
    `coordinator`, `health`)."""
    return name in FLEET_VERBS or name in ("inspect", "history", "coordinator", "health")


def run(args: argparse.Namespace) -> int:
    """Run one fleet verb (or `health`, `inspect`, `history`, `coordinator`); returns the
    exit code.

    Raises what the verb raises (for `console.run_verb` and `errors.classify`)."""
    if args.command == "inspect":
        return inspect_verb(args)
    if args.command == "history":
        return history_verb(args)
    if args.command == "coordinator":  # a server: its signals are `stop_signals`
        PROCESS.exit_if_received()
        code = asyncio.run(coordinator_verb(args))
        PROCESS.exit_if_received()
        return code
    if args.command == "health":
        return run_async(lambda signals: health_verb(args))
    return run_async(lambda signals: fleet_command(args, signals))
