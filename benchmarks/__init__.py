"""Benchmarks of rollout-checkpoint (not tests): `python -m benchmarks` from the repository root.

Every benchmark starts the real servers as processes, drives them from this process (or from
a load-generator subprocess), and reports medians over repeated runs with their spread, and
ratios measured side by side in the same run. See `python -m benchmarks --help` and the
docs/benchmarks.md.

Modules imported by subprocesses (`httpraw`, `loadgen`, `raw_io`, `states`) keep to the
standard library so those processes start in milliseconds.
"""
