"""`rollout-checkpoint collect`: K rollouts of every task through a fleet, losing nothing to a crash.

    rollout-checkpoint collect --fleet fleet.toml --entry-url http://10.0.0.5:8000 \\
        --input tasks.jsonl --output rollouts.jsonl --num-repeats 4 --concurrency 64 \\
        --checkpoint-dir /checkpoints/eval-7 --checkpoint-every 600          [--resume]

The collector is the fleet's controller (upstream-behaviour.md §2.4 and §4.5). One concept a
module:

* `options`: a collection's settings (`CollectOptions`);
* `inputs`: the task file, the rollout ids it makes, its digest;
* `journal`: the durable output and dispatch log, and reading a previous run back;
* `outcome`: what a rollout's `/run` reply means;
* `rollouts`: every rollout's state and what is recorded of it (output lines, the
  controller-state blob);
* `view`: the terminal UI;
* `control`: the ids and backoff of the control calls;
* `starting_point`: what a run starts from, read before anything touches the fleet;
* `resume`: setting the fleet up from what a previous run left;
* `checkpoints`: taking one checkpoint with the collector's state inside;
* `dispatch`: sending rollouts, the dispatch log written ahead, recording replies;
* `retirement`: failed rollouts retired before they are retried, retired ones forgotten;
* `member_loss`: a member lost mid-run, and the fleet recovered in place without exiting;
* `control_loop`: every fleet-wide action of a running collection, one at a time
  (checkpoints, recoveries, retiring, stopping);
* `ending`: how a run ends (exit code, and the command that continues a stopped run);
* `collector`: the `Collector` (a run set up, handed to the control loop, taken down);
* `cli`: the argparse verb and `run_collect` (exit codes in `errors`).
"""

from __future__ import annotations

from rollout_checkpoint.client.collect.checkpoints import CheckpointStepHook
from rollout_checkpoint.client.collect.cli import add_collect_verb, run_collect
from rollout_checkpoint.client.collect.collector import Collector
from rollout_checkpoint.client.collect.errors import CorruptFile, OutputFailed, UsageError
from rollout_checkpoint.client.collect.journal import DurableAppender, read_jsonl, read_previous
from rollout_checkpoint.client.collect.options import CollectOptions

__all__ = [
    "CheckpointStepHook",
    "CollectOptions",
    "Collector",
    "CorruptFile",
    "DurableAppender",
    "OutputFailed",
    "UsageError",
    "add_collect_verb",
    "read_jsonl",
    "read_previous",
    "run_collect",
]
