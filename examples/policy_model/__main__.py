"""`python -m rollout_checkpoint.examples.policy_model`: the policy model as its own process."""

from .cli import main

main()
