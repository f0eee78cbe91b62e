"""The gRPC plumbing both the participant sidecar and the CoordinatorService use.

Bearer auth, the `google.rpc.Status` codec, handler adapters, wire conversions, health and
reflection. Imports the core, grpc and the google.rpc packages, nothing of the runtime.
"""
