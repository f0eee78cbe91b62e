"""The `rollout-checkpoint collect` verb: its arguments, and running a `Collector` to an
exit code.

It ends through the CLI's one handler (`console.run_verb` around `console.run_async`), so its
errors are one line (one JSON object with `--json`) and its exit codes are the rows of the one
table (`console.ExitCode`) every verb documents: 0 every rollout collected; 1 done, some
rollouts recorded as failed; 2 usage, configuration or input error; 4 a participant refused;
5 a participant was unreachable, or lost (down past --checkpoint-timeout, or replaced once more
than --max-recoveries allows: the run stops with the `--resume` command, as on SIGTERM); 6 a
corrupt output, dispatch log or checkpoint; 7 the output or dispatch log cannot be written
(checked before the fleet is touched); 130/143 stopped by SIGINT/SIGTERM (after a checkpoint
when one could be taken).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from rollout_checkpoint.client.checkpointing.publication import (
    CheckpointCorrupt,
    PublicationError,
    StorageFailed,
)
from rollout_checkpoint.client.cli.console import (
    CliError,
    ExitCode,
    HelpFormatter,
    Output,
    add_output_flags,
    epilog,
    run_async,
    run_verb,
)
from rollout_checkpoint.client.cli.errors import classify as classify_fleet_error
from rollout_checkpoint.client.collect.checkpoints import CheckpointStepHook
from rollout_checkpoint.client.collect.collector import Collector
from rollout_checkpoint.client.collect.errors import CorruptFile, OutputFailed, UsageError
from rollout_checkpoint.client.collect.options import CollectOptions
from rollout_checkpoint.client.ledger import GROUP_RECOVERIES
from rollout_checkpoint.client.staleness import Stale, StalenessPolicy
from rollout_checkpoint.server.core.errors import Reason
from rollout_checkpoint.server.core.object_store import is_object_url

EXAMPLE = (
    "rollout-checkpoint collect --fleet fleet.toml --entry-url http://127.0.0.1:8105 "
    "--input tasks.jsonl --output rollouts.jsonl --checkpoint-dir /tmp/eval-7"
)


def add_collect_verb(verbs: Any) -> None:
    """Register `collect` on the CLI's subparsers (`verbs`, what `add_subparsers` returned)."""
    sub: argparse.ArgumentParser = verbs.add_parser(
        "collect",
        help="collect K rollouts of every task through a fleet, with crash-safe checkpoints",
        description="Collect K rollouts of every task through a fleet, with checkpoints that "
        "survive a crash of the collector, a server, or everything (the docs' operations page, "
        "'Collecting rollouts'). Progress goes to stderr; `--json` prints a final summary as one "
        "JSON object on stdout.",
        epilog=epilog(EXAMPLE),
        formatter_class=HelpFormatter,
    )
    sub.add_argument("--fleet", type=Path, required=True, help="fleet file (TOML or YAML)")
    sub.add_argument(
        "--entry-url",
        required=True,
        help="the entry point's base URL (the environment server's or the agent's HTTP address)",
    )
    sub.add_argument("--input", type=Path, required=True, help="tasks, one JSON object a line")
    sub.add_argument("--output", type=Path, required=True, help="rollouts, one JSON line each")
    sub.add_argument("--num-repeats", type=_positive_int, default=1, help="rollouts per task (K)")
    sub.add_argument("--concurrency", type=_positive_int, default=32, help="rollouts in flight")
    sub.add_argument(
        "--checkpoint-dir",
        type=_checkpoint_location,
        required=True,
        help="checkpoints, LATEST and the dispatch log (a directory of its own), or an "
        "object-store URL s3://bucket/prefix (the dispatch log then lies next to --output)",
    )
    sub.add_argument(
        "--checkpoint-every", type=_positive_float, default=None, help="seconds between checkpoints"
    )
    sub.add_argument(
        "--resume", action="store_true", help="continue the collection in --output/--checkpoint-dir"
    )
    sub.add_argument(
        "--group-recovery",
        choices=GROUP_RECOVERIES,
        default="sibling",
        help="after a crash cut one rollout of a prompt group (a task's K repeats): 'sibling' "
        "keeps its finished siblings, 'group' regenerates the whole group from its input; a "
        "task row's group_recovery overrides it (default sibling). Either way a group reaches "
        "the output whole, in one write",
    )
    sub.add_argument(
        "--max-attempts",
        type=_positive_int,
        default=3,
        help="failures of one rollout before it is recorded as failed (default 3)",
    )
    sub.add_argument(
        "--max-recoveries",
        type=_non_negative_int,
        default=3,
        metavar="N",
        help="times a member lost mid-run (SIGKILLed, its replacement up on the same address) "
        "is recovered in place: the run's latest checkpoint restored into the whole fleet, "
        "the rollouts it cut continued or restarted; once more, the run stops (exit 5) for a "
        "--resume. 0: never recover in place (default 3)",
    )
    sub.add_argument(
        "--max-policy-lag",
        type=_non_negative_int,
        default=None,
        metavar="N",
        help="after a restore, a continued rollout whose oldest turn was sampled more than N "
        "weight versions behind the policy model's current one (SetWeightVersion) is handled "
        "by --stale (default: no bound)",
    )
    sub.add_argument(
        "--stale",
        choices=[s.value for s in Stale],
        default=Stale.REGENERATE.value,
        help="what happens to a continued rollout past --max-policy-lag: continue it anyway "
        "(counted), regenerate it from its input, or drop it (recorded as dropped with the "
        "reason) (default regenerate)",
    )
    sub.add_argument(
        "--checkpoint-timeout",
        type=_positive_float,
        default=300.0,
        help="seconds for one checkpoint, and for one recovery including the wait for a lost "
        "member to answer again (default 300)",
    )
    sub.add_argument(
        "--request-timeout",
        type=_positive_float,
        default=3600.0,
        help="seconds for one /run (default 3600)",
    )
    sub.add_argument(
        "--keep", type=_positive_int, default=None, help="published checkpoints kept (default 2)"
    )
    add_output_flags(sub, verbose=False)


def _checkpoint_location(text: str) -> Path | str:
    """A directory (a Path) or an object-store URL (kept as the string it is)."""
    return text if is_object_url(text) else Path(text)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be at least 0")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def run_collect(
    args: argparse.Namespace,
    command: Sequence[str] = (),
    *,
    step_hook: CheckpointStepHook | None = None,
) -> int:
    """Run the collection `args` (parsed by `add_collect_verb`'s parser) to its exit code.

    `command` is the command line, repeated with `--resume` in the message of a stopped run.
    Every expected failure ends as one line on stderr (one JSON object on stdout with
    `--json`) and its exit code (see the module doc), through `console.run_verb`; an
    unexpected one keeps its traceback. With `--json` the run ends with one JSON summary line
    on stdout. `step_hook` is for fault tests only (see `CheckpointStepHook`)."""
    options = CollectOptions(
        fleet=args.fleet,
        entry_url=args.entry_url,
        input=args.input,
        output=args.output,
        checkpoint_dir=args.checkpoint_dir,
        num_repeats=args.num_repeats,
        concurrency=args.concurrency,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        group_recovery=args.group_recovery,
        max_attempts=args.max_attempts,
        max_recoveries=args.max_recoveries,
        checkpoint_timeout=args.checkpoint_timeout,
        request_timeout=args.request_timeout,
        keep=args.keep,
        staleness=StalenessPolicy(args.max_policy_lag, Stale(args.stale)),
        command=command,
    )
    as_json = bool(getattr(args, "json", False))
    console = Console(stderr=True, soft_wrap=True)  # plain lines stay whole in logs

    def collect() -> int:
        collector = Collector(options, console, step_hook=step_hook)
        code = run_async(lambda signals: collector.run())
        if as_json:
            Output(as_json=True).json_line(summary(collector, options, code))
        return code

    return run_verb(collect, classify, as_json=as_json)


def summary(collector: Collector, options: CollectOptions, code: int) -> dict[str, Any]:
    """The `--json` summary of a finished (or stopped) run."""
    counts = collector.counts
    return {
        "run_id": collector.run_id,
        "total": counts.total,
        "collected": counts.done,
        "failed": counts.failed,
        "retried": counts.retried,
        "checkpoints": counts.checkpoints,
        "recoveries": counts.recoveries,
        "groups_sealed": counts.groups_sealed,
        "siblings_kept": counts.siblings_kept,
        "groups_regenerated": counts.groups_regenerated,
        "last_checkpoint": counts.last_checkpoint,
        "output": str(options.output),
        "checkpoint_dir": str(options.checkpoint_dir),
        "stopped": collector.stopped,
        "exit_code": int(code),
    }


def classify(error: BaseException) -> CliError | None:
    """The exit code and one line for an exception that ends a collection (None: a bug).

    Collect's own errors first (a corrupt file is a `ValueError` too, and a checkpoint that
    does not publish or read back is corrupt state here, not a refusal); the rest as every
    fleet verb classifies them."""
    if isinstance(error, OutputFailed):
        return CliError(ExitCode.OUTPUT_UNWRITABLE, str(error))
    if isinstance(error, CorruptFile):
        return CliError(ExitCode.CORRUPT, str(error))
    if isinstance(error, UsageError):
        return CliError(ExitCode.USAGE, str(error))
    if isinstance(error, StorageFailed):  # the store failed or hung: refused, retryable
        return CliError(ExitCode.REFUSED, str(error), Reason.STORAGE_FAILED)
    if isinstance(error, PublicationError) and not isinstance(error, CheckpointCorrupt):
        return CliError(ExitCode.CORRUPT, str(error), Reason.INVALID_CHECKPOINT_STATE)
    return classify_fleet_error(error)
