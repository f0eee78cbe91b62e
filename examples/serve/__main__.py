"""`python -m rollout_checkpoint.examples.serve` (what `rollout-checkpoint serve` execs, and
each worker of `--workers N`)."""

from .process import run_main

run_main()
