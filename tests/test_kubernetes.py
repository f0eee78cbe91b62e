"""deploy/kubernetes: every manifest loads, and the properties that make it work hold.

Ports are numbers; every gRPC probe names a health service the sidecar (or the coordinator)
really registers, on the container's gRPC port; the token comes only from a Secret; the
control Service is headless and publishes not-ready pods, and the fleet file names pods
through it; participants and coordinator mount one ReadWriteMany volume at the path the
participants allow; commands are real CLI verbs whose flags parse, and the environment maps
onto the settings `serve` builds; grace periods and the startup window fit the settings.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout_checkpoint.client import cli
from rollout_checkpoint.client.coordinator.service import SERVICE_NAME as COORDINATOR_SERVICE
from rollout_checkpoint.client.coordinator.service import Coordinator
from rollout_checkpoint.client.fleet import FleetSpec, MemberSpec, load_fleet_file
from rollout_checkpoint.examples import serve
from rollout_checkpoint.server.runtime.settings import CheckpointSettings

from .conftest import REPO, TOKEN, start_harness, stop_harness

DEPLOY = REPO / "deploy" / "kubernetes"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))
PREFIX = "ROLLOUT_CHECKPOINT_"


@functools.cache
def load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def objects() -> list[dict[str, Any]]:
    return [doc for path in MANIFESTS for doc in load(path) if doc.get("kind") != "Kustomization"]


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects() if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (only,) = pod_spec(workload)["containers"]
    result: dict[str, Any] = only
    return result


def port(c: dict[str, Any], name: str) -> int:
    (number,) = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    assert isinstance(number, int)
    return number


def env(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env", [])}


def walk(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    yield path, node
    if isinstance(node, dict):
        for key, child in node.items():
            yield from walk(child, f"{path}.{key}")
    elif isinstance(node, list):
        for i, child in enumerate(node):
            yield from walk(child, f"{path}[{i}]")


def participants() -> dict[str, Any]:
    return one("StatefulSet")


def coordinator() -> dict[str, Any]:
    return one("Deployment", "rollout-checkpoint-coordinator")


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


# -- structure ------------------------------------------------------------------------------


def test_every_manifest_loads_and_the_kustomization_lists_them_all() -> None:
    assert MANIFESTS
    kustomizations = [d for p in MANIFESTS for d in load(p) if d.get("kind") == "Kustomization"]
    assert len(kustomizations) == 1
    listed = sorted(kustomizations[0]["resources"])
    assert listed == sorted(p.name for p in MANIFESTS if p.name != "kustomization.yaml")
    for doc in objects():
        assert {"apiVersion", "kind", "metadata"} <= set(doc), doc
        assert "namespace" not in doc["metadata"]  # `kubectl -n` decides
    kinds = sorted(o["kind"] for o in objects())
    assert kinds == sorted(
        ["ConfigMap", "Deployment", "PersistentVolumeClaim", "StatefulSet", *["Service"] * 3]
    )


def test_ports_are_numbers_everywhere() -> None:
    numeric_keys = {"containerPort", "port", "targetPort"}
    seen = 0
    for doc in objects():
        for path, node in walk(doc):
            key = path.rsplit(".", 1)[-1]
            if key in numeric_keys:
                assert isinstance(node, int) and not isinstance(node, bool), (path, node)
                assert 0 < node < 65536
                seen += 1
    assert seen >= 10


def test_images_are_the_project_image_built_by_the_dockerfile() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for workload in (participants(), coordinator()):
        assert container(workload)["image"] == f"rollout-checkpoint:{version}"
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    assert f"rollout-checkpoint:{version}" in dockerfile
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (REPO / source).exists(), source
    user = pod_spec(participants())["securityContext"]["runAsUser"]
    assert f"--uid {user}" in dockerfile


# -- probes ---------------------------------------------------------------------------------


def grpc_probes(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        kind: c[kind]["grpc"]
        for kind in ("startupProbe", "livenessProbe", "readinessProbe")
        if kind in c
    }


async def health_status(address: str, service: str) -> int:
    async with aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
        return int(reply.status)


async def test_participant_probes_name_registered_services_on_the_grpc_port() -> None:
    c = container(participants())
    probes = grpc_probes(c)
    assert set(probes) == {"startupProbe", "livenessProbe", "readinessProbe"}
    assert probes["livenessProbe"]["service"] == "participant-liveness"
    assert probes["readinessProbe"]["service"] == "participant-readiness"
    grpc_port = port(c, "grpc")
    assert flag(c["command"], "--grpc-address") == f"0.0.0.0:{grpc_port}"
    for probe in probes.values():
        assert set(probe) == {"port", "service"} and probe["port"] == grpc_port
    # The names exist on a real sidecar: Check answers (no NOT_FOUND), without a token.
    h = await start_harness()
    try:
        for probe in probes.values():
            assert await health_status(h.grpc_address, probe["service"]) in (1, 2)
    finally:
        await stop_harness(h)


async def test_coordinator_probes_name_registered_services_on_its_port() -> None:
    c = container(coordinator())
    probes = grpc_probes(c)
    grpc_port = port(c, "grpc")
    assert flag(c["command"], "--grpc-address") == f"0.0.0.0:{grpc_port}"
    services = {probe["service"] for probe in probes.values()}
    assert services == {"", COORDINATOR_SERVICE}
    spec = FleetSpec(members=(MemberSpec("counter-0", "127.0.0.1:9"),), token=TOKEN)
    server = Coordinator(spec, "127.0.0.1:0")
    await server.start()
    try:
        for probe in probes.values():
            assert probe["port"] == grpc_port
            assert await health_status(f"127.0.0.1:{server.port}", probe["service"]) == 1
    finally:
        await server.stop()


def test_startup_window_and_grace_periods_fit_the_settings() -> None:
    c = container(participants())
    variables = env(c)
    closed_timeout = float(variables[f"{PREFIX}START_CLOSED_TIMEOUT_SECONDS"]["value"])
    startup = c["startupProbe"]
    assert startup["grpc"]["service"] == "participant-readiness"  # up only after restore
    assert startup["periodSeconds"] * startup["failureThreshold"] > closed_timeout
    shutdown_grace = float(variables[f"{PREFIX}SHUTDOWN_GRACE_SECONDS"]["value"])
    termination = pod_spec(participants())["terminationGracePeriodSeconds"]
    assert termination >= serve.GRACEFUL_SHUTDOWN_SECONDS + shutdown_grace + 5
    liveness = c["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 60  # loop stalls
    coordinator_grace = Coordinator.__init__.__kwdefaults__["grace"]
    assert pod_spec(coordinator())["terminationGracePeriodSeconds"] >= coordinator_grace + 5


# -- token ----------------------------------------------------------------------------------


def test_the_token_is_never_inline() -> None:
    refs = 0
    for doc in objects():
        assert doc["kind"] != "Secret", "the Secret is created by hand, never committed"
        for path, node in walk(doc):
            is_env = re.search(r"\.env\[\d+\]$", path) is not None
            if is_env and "TOKEN" in str(node.get("name", "")).upper():
                assert "value" not in node, path
                ref = node["valueFrom"]["secretKeyRef"]
                assert ref == {"name": "rollout-checkpoint-token", "key": "token"}, path
                refs += 1
            if isinstance(node, str):
                assert not re.search(r"--token\b|Bearer ", node), (path, node)
    assert refs == 2  # the participants and the coordinator
    fleet = yaml.safe_load(one("ConfigMap")["data"]["fleet.yaml"])
    assert "token_file" not in fleet and fleet["token_env"] == f"{PREFIX}TOKEN"


# -- services and the fleet file ------------------------------------------------------------


def selects(service: dict[str, Any], workload: dict[str, Any]) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


def test_control_traffic_goes_to_pod_addresses_through_a_headless_service(
    tmp_path: Path,
) -> None:
    statefulset = participants()
    c = container(statefulset)
    headless = one("Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert selects(headless, statefulset)
    assert [p["targetPort"] for p in headless["spec"]["ports"]] == [port(c, "grpc")]
    data = one("Service", "counter")
    assert data["spec"].get("clusterIP") != "None" and not data["spec"].get(
        "publishNotReadyAddresses"
    )
    assert selects(data, statefulset)
    assert [p["targetPort"] for p in data["spec"]["ports"]] == [port(c, "http")]
    assert flag(c["command"], "--http-address") == f"0.0.0.0:{port(c, 'http')}"
    # The fleet file names every pod by its stable DNS name on the headless Service, and
    # the member's name is the pod name, which is also the participant's instance.
    assert flag(c["command"], "--instance") == "$(POD_NAME)"
    assert env(c)["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(one("ConfigMap")["data"]["fleet.yaml"])
    spec = load_fleet_file(fleet_file, environ={f"{PREFIX}TOKEN": TOKEN})
    name = statefulset["metadata"]["name"]
    pods = [f"{name}-{i}" for i in range(statefulset["spec"]["replicas"])]
    assert [m.name for m in spec.members] == pods
    grpc_port = port(c, "grpc")
    service = headless["metadata"]["name"]
    assert [m.address for m in spec.members] == [f"{p}.{service}:{grpc_port}" for p in pods]
    assert statefulset["spec"]["podManagementPolicy"] == "Parallel"


def test_one_shared_volume_at_the_allowed_root(tmp_path: Path) -> None:
    pvc = one("PersistentVolumeClaim")
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    mounts: dict[str, str] = {}
    for workload in (participants(), coordinator()):
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"]
            for v in pod_spec(workload)["volumes"]
            if "persistentVolumeClaim" in v
        }
        (volume,) = [v for v, claim in claims.items() if claim == pvc["metadata"]["name"]]
        (mount,) = [m for m in container(workload)["volumeMounts"] if m["name"] == volume]
        mounts[workload["kind"]] = mount["mountPath"]
    assert len(set(mounts.values())) == 1, mounts
    root = mounts["StatefulSet"]
    allowed = json.loads(
        env(container(participants()))[f"{PREFIX}ALLOWED_CHECKPOINT_ROOTS"]["value"]
    )
    assert allowed == [root]
    fleet = yaml.safe_load(one("ConfigMap")["data"]["fleet.yaml"])
    assert Path(fleet["checkpoint_root"]).is_relative_to(root)


# -- commands and settings ------------------------------------------------------------------


def test_commands_are_cli_verbs_whose_flags_parse() -> None:
    parser = cli._parser()
    (verbs,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for workload in (participants(), coordinator()):
        command = container(workload)["command"]
        assert command[0] == "rollout-checkpoint"
        assert command[1] in verbs.choices, command
        if command[1] == "serve":
            args = serve.parse_args(command[2:])
            assert args.server == "counter" and args.log_format == "json"
        else:
            args = parser.parse_args(command[1:])
            assert args.command == "coordinator"
            mount = {m["name"]: m["mountPath"] for m in container(workload)["volumeMounts"]}
            assert Path(args.fleet).parent == Path(mount["fleet"])
            assert args.fleet.name in one("ConfigMap")["data"]


def test_the_environment_maps_onto_the_settings_serve_builds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c = container(participants())
    variables = env(c)
    fields = set(CheckpointSettings.model_fields)
    for name in variables:
        if name.startswith(PREFIX):
            assert name.removeprefix(PREFIX).lower() in fields, name
    for variable in list(CheckpointSettings.model_fields):
        monkeypatch.delenv(f"{PREFIX}{variable.upper()}", raising=False)
    resolved = {"POD_NAME": "counter-1", f"{PREFIX}TOKEN": "from-the-secret"}
    for name, entry in variables.items():
        monkeypatch.setenv(name, entry.get("value", resolved.get(name, "")))
    command = [part.replace("$(POD_NAME)", "counter-1") for part in c["command"]]
    args = serve.parse_args(command[2:])
    settings = serve.checkpoint_settings(args, args.instance)
    assert settings is not None and settings.enabled
    assert settings.instance == "counter-1"
    assert settings.token.get_secret_value() == "from-the-secret"
    assert settings.start_closed  # from the environment: no --start-closed flag needed
    assert settings.grpc_address == f"0.0.0.0:{port(c, 'grpc')}"
    assert settings.metrics_address == f"0.0.0.0:{port(c, 'metrics')}"
    annotations = participants()["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port(c, "metrics"))
    assert settings.allowed_checkpoint_roots == ("/checkpoints",)
    assert settings.readiness_pause_threshold_seconds == 30
