"""The participant runtime, kind-agnostic: control plane, sidecar, health, ASGI install.

The public entry points: `install.install_checkpointing`, `settings.CheckpointSettings`,
`participant.Participant`.
"""
