"""The demo's options and its command line (`rollout-checkpoint demo --help`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from rollout_checkpoint.client.cli.console import HelpFormatter, epilog

SUMMARY = (
    "`rollout-checkpoint demo`: checkpoint a live fleet mid-flight, SIGKILL it, restore, continue."
)
"""The first line of `--help` (and of the package's docstring)."""


@dataclass
class Options:
    rollouts: int = 32
    concurrency: int = 24
    checkpoint_after: int = 4
    latency: float = 0.05
    output_dir: Path | None = None
    json: bool = False
    timeout: float = 60.0
    crash_twice: bool = False
    skip_resources_restore: bool = False
    self_heal: bool = False
    victim: str = "policy_model"
    workers: int = 1
    """HTTP worker processes of each resources, agent and environment server (`--workers`)."""
    async_commit: bool = False
    """Commit asynchronously (`--async-commit`): every member answers at its snapshot, the
    parts are awaited (AwaitPart) before publishing; the second checkpoint resumes the fleet
    before its parts are durable."""


def parse_args(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="rollout-checkpoint demo",
        description=SUMMARY,
        epilog=epilog(
            "rollout-checkpoint demo --rollouts 32 --checkpoint-after 4 --output-dir /tmp/demo",
            "exit 1 means a check failed (the report names it).",
        ),
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--rollouts", type=int, default=32, help="rollouts to run (default 32)")
    parser.add_argument(
        "--concurrency", type=int, default=24, help="rollouts in flight at once (default 24)"
    )
    parser.add_argument(
        "--checkpoint-after",
        type=int,
        default=None,
        help="checkpoint once this many have finished (default: an eighth of --rollouts; at "
        "most --rollouts - 1)",
    )
    parser.add_argument(
        "--latency", type=float, default=0.05, help="seconds per scripted model call (default 0.05)"
    )
    parser.add_argument(
        "--output-dir", type=Path, default=None, help="keep checkpoints, logs and the report here"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--crash-twice",
        action="store_true",
        help="crash the restored fleet again before it resumes work; continue as attempt N+2",
    )
    parser.add_argument(
        "--skip-resources-restore",
        action="store_true",
        help="negative control: restore every member but the resources servers (the demo must then fail)",
    )
    parser.add_argument(
        "--self-heal",
        action="store_true",
        help="instead: run the fleet under `coordinator --supervise`, SIGKILL one member "
        "mid-flight and watch the supervisor restore and reopen the fleet by itself",
    )
    parser.add_argument(
        "--victim",
        default="policy_model",
        choices=["policy_model", "agent", "environment", "prompt_injection", "counter"],
        help="with --self-heal: the member to kill (default policy_model)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="HTTP worker processes per resources, agent and environment server (default 1)",
    )
    parser.add_argument(
        "--async-commit",
        action="store_true",
        help="commit asynchronously: members answer at their snapshot and write their parts "
        "in the background; the demo publishes once every part is durable",
    )
    args = parser.parse_args(argv)
    if args.rollouts < 2 or args.concurrency < 1:
        parser.error("--rollouts must be at least 2 and --concurrency at least 1")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    checkpoint_after = (
        args.checkpoint_after if args.checkpoint_after is not None else max(1, args.rollouts // 8)
    )
    return Options(
        args.rollouts,
        args.concurrency,
        min(checkpoint_after, args.rollouts - 1),
        args.latency,
        args.output_dir,
        args.json,
        crash_twice=args.crash_twice,
        skip_resources_restore=args.skip_resources_restore,
        self_heal=args.self_heal,
        victim=args.victim,
        workers=args.workers,
        async_commit=args.async_commit,
    )
