"""Generated protobuf messages and gRPC stubs of the rollout_checkpoint.v1 API (scripts/generate)."""
