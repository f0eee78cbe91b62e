"""The participant runtime: control plane, storage, sidecar and the ASGI wiring.

Never imports `rollout_checkpoint.client` or `rollout_checkpoint.examples` (an import-linter
contract in the tests enforces it).
"""
