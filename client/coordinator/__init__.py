"""CoordinatorService: the fleet rules behind typed RPCs (`rollout-checkpoint coordinator`)."""
