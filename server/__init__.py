"""The participant side, cut by role (this package imports nothing):

    core/        what both sides may import: episodes, errors, clock, the storage format
    core/rpc/    the gRPC plumbing of the sidecar and the coordinator
    runtime/     the participant runtime, kind-agnostic
    resources/   episodic/   model/     the participant kinds

Never imports `rollout_checkpoint.client` or `rollout_checkpoint.examples` (import-linter
contracts in the tests enforce the layering).
"""
