"""What both sides may import: episode identity, error reasons, the checkpoint storage format.

Only the standard library, `rollout_checkpoint.v1` and protobuf; never grpc, never the
participant runtime (an import-linter layers contract in the tests enforces it). Import the
modules themselves; this package imports nothing.
"""
