"""`python -m rollout_checkpoint.examples.demo` (what `rollout-checkpoint demo` execs)."""

import sys

from .cli import main

sys.exit(main())
