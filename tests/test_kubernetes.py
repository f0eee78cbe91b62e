"""deploy/kubernetes: every manifest loads, and the properties that make it work hold.

Every manifest, and what kustomize renders from them (alone and under an image override),
validates strictly against the Kubernetes API schemas of every supported version, offline
(kubernetes-validate's schemas; unknown fields fail). Ports are numbers; every probe is a
native `grpc:` probe naming a health service the sidecar (or the coordinator) really
registers, on the container's plaintext health-only port (`--health-address`), which no
Service publishes; the token and the TLS certificate come only from Secrets made by hand;
control traffic to the participants is TLS, with the README's certificate (made here with its
openssl lines) accepted for every member's fleet address, while the probes' names answer in
plaintext on a real sidecar's and coordinator's health port; the control Service is
headless and publishes not-ready pods, and the fleet file names pods through it;
participants and coordinator mount one ReadWriteMany volume at the path the participants
allow; commands are real CLI verbs whose flags parse (the README's `kubectl exec` lines too), and the
environment maps onto the settings `serve` builds; grace periods and the startup window fit
the settings.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shlex
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
import pytest
import yaml
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from packaging.version import Version

from rollout_checkpoint.client.cli import main as cli
from rollout_checkpoint.client.coordinator.service import SERVICE_NAME as COORDINATOR_SERVICE
from rollout_checkpoint.client.coordinator.service import Coordinator
from rollout_checkpoint.client.fleet import FleetSpec, MemberSpec, load_fleet_file
from rollout_checkpoint.examples import serve
from rollout_checkpoint.server.core.rpc.tls import server_credentials
from rollout_checkpoint.server.runtime.settings import CheckpointSettings
from rollout_checkpoint.v1 import participant_service_pb2 as pb
from rollout_checkpoint.v1 import participant_service_pb2_grpc as pb_grpc

from .conftest import REPO, TOKEN, start_harness, stop_harness

DEPLOY = REPO / "deploy" / "kubernetes"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))
PREFIX = "ROLLOUT_CHECKPOINT_"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")
TLS_SECRET = "rollout-checkpoint-tls"
# The oldest Kubernetes the manifests support: native gRPC probes (the coordinator's) are GA
# from 1.27. Every version from there to the newest kubernetes-validate ships is checked.
MIN_KUBERNETES = Version("1.27")


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


def coordinator_service() -> dict[str, Any]:
    return one("Service", "rollout-checkpoint-coordinator")


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
    numeric_keys = {"containerPort", "port", "targetPort"}  # a grpc: probe's port too
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
    """{kind: {port, service}} of every probe of `c`, each a native `grpc:` probe."""
    probes = {}
    for kind in PROBES:
        if kind in c:
            assert set(c[kind]) & {"exec", "httpGet", "tcpSocket"} == set(), (kind, c[kind])
            probes[kind] = c[kind]["grpc"]
    return probes


def services_publishing(target: int) -> list[str]:
    """The Services whose ports forward to container port `target`."""
    return [
        service["metadata"]["name"]
        for service in objects()
        if service["kind"] == "Service"
        and any(p["targetPort"] == target for p in service["spec"]["ports"])
    ]


def assert_probes_on_the_health_port(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every probe of `c` asks its health-only port, which `--health-address` binds beside
    the TLS `--grpc-address`, and which no Service publishes (only the kubelet asks it)."""
    probes = grpc_probes(c)
    health_port = port(c, "health")
    assert health_port != port(c, "grpc")
    assert flag(c["command"], "--health-address") == f"0.0.0.0:{health_port}"
    assert flag(c["command"], "--grpc-address") == f"0.0.0.0:{port(c, 'grpc')}"
    for probe in probes.values():
        assert set(probe) == {"port", "service"} and probe["port"] == health_port, probe
    assert services_publishing(health_port) == []
    return probes


async def health_status(address: str, service: str) -> int:
    async with aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
        return int(reply.status)


async def test_participant_probes_name_registered_services_on_the_health_port() -> None:
    c = container(participants())
    probes = assert_probes_on_the_health_port(c)
    assert set(probes) == set(PROBES)
    assert probes["startupProbe"]["service"] == "participant-readiness"
    assert probes["livenessProbe"]["service"] == "participant-liveness"
    assert probes["readinessProbe"]["service"] == "participant-readiness"
    # The names exist on a real sidecar's health port: Check answers (no NOT_FOUND), in
    # plaintext, without a token.
    h = await start_harness(health_address="127.0.0.1:0")
    try:
        for probe in probes.values():
            assert h.runtime.health_address is not None
            assert await health_status(h.runtime.health_address, probe["service"]) in (1, 2)
    finally:
        await stop_harness(h)


async def test_coordinator_probes_name_registered_services_on_its_health_port() -> None:
    c = container(coordinator())
    probes = assert_probes_on_the_health_port(c)
    assert set(probes) == {"livenessProbe", "readinessProbe"}
    assert probes["livenessProbe"]["service"] == ""
    assert probes["readinessProbe"]["service"] == COORDINATOR_SERVICE
    spec = FleetSpec(members=(MemberSpec("counter-0", "127.0.0.1:9"),), token=TOKEN)
    server = Coordinator(spec, "127.0.0.1:0", health_address="127.0.0.1:0")
    await server.start()
    try:
        assert server.health_listener is not None
        for probe in probes.values():
            status = await health_status(server.health_listener.bound_address, probe["service"])
            assert status == 1
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
            # The coordinator supervises: a replaced pod is restored and a fresh install
            # opened with no person (issue 15), so it needs somewhere to publish to.
            assert args.supervise and args.checkpoint_every > 0
            fleet_file = yaml.safe_load(one("ConfigMap")["data"][args.fleet.name])
            mount = {m["name"]: m["mountPath"] for m in container(workload)["volumeMounts"]}
            assert Path(fleet_file["checkpoint_root"]).is_relative_to(mount["checkpoints"])
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
    assert settings.health_address == f"0.0.0.0:{port(c, 'health')}"
    assert settings.metrics_address == f"0.0.0.0:{port(c, 'metrics')}"
    annotations = participants()["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port(c, "metrics"))
    assert settings.allowed_checkpoint_roots == ("/checkpoints",)
    assert settings.readiness_pause_threshold_seconds == 30
    tls = mount_of_secret(participants(), TLS_SECRET)
    assert settings.tls_cert_file == f"{tls}/tls.crt"
    assert settings.tls_key_file == f"{tls}/tls.key"
    assert settings.tls_client_ca_file is None  # mutual TLS is not set up here


# -- the Kubernetes API schemas, offline -----------------------------------------------------


def kubernetes_versions() -> list[str]:
    """Every schema version kubernetes-validate ships from MIN_KUBERNETES on."""
    shipped = sorted({Version(v) for v in kubernetes_validate.utils.all_versions()})
    return [str(v) for v in shipped if v >= MIN_KUBERNETES]


def validate_strictly(docs: list[dict[str, Any]], where: str) -> None:
    versions = kubernetes_versions()
    failures = []
    for doc in docs:
        for version in versions:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except (
                kubernetes_validate.ValidationError,
                kubernetes_validate.SchemaNotFoundError,
            ) as error:
                name = f"{doc['kind']}/{doc['metadata']['name']}"
                failures.append(f"{where}: {name} on {version}: {getattr(error, 'message', error)}")
    assert not failures, "\n".join(failures)


def test_the_validator_ships_the_versions_checked_and_rejects_unknown_fields() -> None:
    # Guard for the tests below: the pinned kubernetes-validate has the schemas we claim
    # (1.34, the version these manifests were first checked on, and a floor at 1.27), and
    # strict mode really fails a field the API does not have.
    versions = kubernetes_versions()
    assert versions[0] == "1.27.0" and "1.34.0" in versions
    assert Version(versions[-1]) >= Version("1.37"), versions
    pvc = json.loads(json.dumps(one("PersistentVolumeClaim")))
    kubernetes_validate.validate(pvc, versions[-1], strict=True)
    pvc["spec"]["acessModes"] = ["ReadWriteMany"]  # misspelt
    with pytest.raises(kubernetes_validate.ValidationError, match="acessModes"):
        kubernetes_validate.validate(pvc, versions[-1], strict=True)
    probe = json.loads(json.dumps(participants()))
    container(probe)["readinessProbe"]["grpc"]["svc"] = "participant-readiness"
    with pytest.raises(kubernetes_validate.ValidationError, match="svc"):
        kubernetes_validate.validate(probe, versions[-1], strict=True)


def test_every_manifest_validates_strictly_on_every_supported_kubernetes() -> None:
    validate_strictly(objects(), "deploy/kubernetes")


def kustomize() -> str:
    """The cached kustomize binary (scripts/kustomize builds it once with `go install`)."""
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "kustomize")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, f"scripts/kustomize failed:\n{proc.stderr}"
    return proc.stdout.strip()


def render(directory: Path) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [kustomize(), "build", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"kustomize build {directory} failed:\n{proc.stderr}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc is not None]


def identity(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def test_the_kustomization_renders_every_object_unchanged_and_valid() -> None:
    rendered = render(DEPLOY)
    validate_strictly(rendered, "kustomize build deploy/kubernetes")
    assert sorted(map(identity, rendered)) == sorted(map(identity, objects()))
    source = {identity(o): o for o in objects()}
    for doc in rendered:  # no transformer in the base: what is applied is what is reviewed
        assert doc == source[identity(doc)], identity(doc)


def readme_kubernetes() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("## Running on Kubernetes")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def readme_shell_blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)```", readme_kubernetes(), flags=re.DOTALL)


def readme_block(containing: str) -> str:
    (block,) = [b for b in readme_shell_blocks() if containing in b]
    return block


def test_the_readme_image_override_renders_and_validates(tmp_path: Path) -> None:
    # The README's own overlay, as written (its `../deploy/kubernetes` reaches this repo
    # through a link), renders the registry image into both workloads and nothing else.
    block = readme_block("kind load docker-image")
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    tag = f"rollout-checkpoint:{version}"
    assert f"docker build -f deploy/Dockerfile -t {tag} ." in block
    assert f"kind load docker-image {tag}" in block and f"minikube image load {tag}" in block
    push = readme_block("docker push")
    (overlay,) = re.findall(r"<<'YAML'\n(.*?)\nYAML\n", push, flags=re.DOTALL)
    (pushed,) = re.findall(r"docker push (\S+)", push)
    (tmp_path / "deploy").symlink_to(REPO / "deploy")
    (tmp_path / "my-cluster").mkdir()
    (tmp_path / "my-cluster" / "kustomization.yaml").write_text(overlay)
    rendered = render(tmp_path / "my-cluster")
    validate_strictly(rendered, "README overlay")
    images = {
        identity(doc): [c["image"] for c in doc["spec"]["template"]["spec"]["containers"]]
        for doc in rendered
        if doc["kind"] in ("StatefulSet", "Deployment")
    }
    assert images == {
        ("StatefulSet", "counter"): [pushed],
        ("Deployment", "rollout-checkpoint-coordinator"): [pushed],
    }
    source = {identity(o): o for o in objects()}
    for doc in rendered:
        if doc["kind"] not in ("StatefulSet", "Deployment"):
            assert doc == source[identity(doc)], identity(doc)


# -- TLS ------------------------------------------------------------------------------------


def secret_volumes(workload: dict[str, Any], secret: str) -> list[dict[str, Any]]:
    return [
        v for v in pod_spec(workload)["volumes"] if v.get("secret", {}).get("secretName") == secret
    ]


def mount_of_secret(workload: dict[str, Any], secret: str) -> str:
    (volume,) = secret_volumes(workload, secret)
    (mount,) = [m for m in container(workload)["volumeMounts"] if m["name"] == volume["name"]]
    assert mount.get("readOnly") is True
    path: str = mount["mountPath"]
    return path


def test_control_traffic_is_tls_from_a_secret_made_by_hand() -> None:
    # Participants: certificate and key from the Secret, by the settings' variables.
    c = container(participants())
    variables = env(c)
    tls = mount_of_secret(participants(), TLS_SECRET)
    assert variables[f"{PREFIX}TLS_CERT_FILE"]["value"] == f"{tls}/tls.crt"
    assert variables[f"{PREFIX}TLS_KEY_FILE"]["value"] == f"{tls}/tls.key"
    (volume,) = secret_volumes(participants(), TLS_SECRET)
    assert "items" not in volume["secret"]  # tls.crt, tls.key and ca.crt
    # Readable by the app user (fsGroup) only.
    for workload in (participants(), coordinator()):
        (volume,) = secret_volumes(workload, TLS_SECRET)
        assert volume["secret"]["defaultMode"] == 0o440
        assert (
            pod_spec(workload)["securityContext"]["fsGroup"]
            == pod_spec(workload)["securityContext"]["runAsUser"]
        )
    # The coordinator serves its own port with the same certificate and key, and the fleet
    # file names the CA, so it (and every fleet verb run in its pod) dials the members over
    # TLS.
    (volume,) = secret_volumes(coordinator(), TLS_SECRET)
    assert "items" not in volume["secret"]
    ca = mount_of_secret(coordinator(), TLS_SECRET)
    command = container(coordinator())["command"]
    assert flag(command, "--tls-cert-file") == f"{ca}/tls.crt"
    assert flag(command, "--tls-key-file") == f"{ca}/tls.key"
    fleet = yaml.safe_load(one("ConfigMap")["data"]["fleet.yaml"])
    assert fleet["tls_ca_file"] == f"{ca}/ca.crt"
    assert "tls_cert_file" not in fleet and "tls_key_file" not in fleet
    # The TLS mounts do not nest inside the read-only fleet ConfigMap mount.
    for workload in (participants(), coordinator()):
        paths = [m["mountPath"] for m in container(workload)["volumeMounts"]]
        for a in paths:
            assert not any(b != a and b.startswith(a + "/") for b in paths), paths
    # No certificate or key material in any manifest.
    for doc in objects():
        for path, node in walk(doc):
            if isinstance(node, str):
                assert "-----BEGIN" not in node, path
    # The README creates the Secret every workload names, with the keys they mount.
    block = readme_block("openssl req -x509")
    assert (
        f"create secret generic {TLS_SECRET} --type=kubernetes.io/tls \\\n"
        "  --from-file=tls.crt --from-file=tls.key --from-file=ca.crt" in block
    )


def run_readme_certificate_commands(directory: Path) -> list[list[str]]:
    """Run the README's Secrets block as written, in `directory`, with kubectl replaced by a
    stub that records its arguments; return them."""
    script = (
        'kubectl() { printf "%s\\0" "$@" >> kubectl.calls; printf "\\n\\0" >> kubectl.calls; }\n'
        "set -euo pipefail\n" + readme_block("openssl req -x509")
    )
    proc = subprocess.run(
        ["bash", "-c", script],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    raw = (directory / "kubectl.calls").read_text().split("\n\0")
    return [call.rstrip("\0").split("\0") for call in raw if call]


def member_hosts() -> list[str]:
    fleet = yaml.safe_load(one("ConfigMap")["data"]["fleet.yaml"])
    return [member["address"].rsplit(":", 1)[0] for member in fleet["participants"]]


async def get_participant(address: str, credentials: grpc.ChannelCredentials, name: str) -> str:
    """GetParticipant over TLS to `address`, verifying the server for `name` (what a
    controller in the cluster verifies when it dials `name:9000`)."""
    options = [("grpc.ssl_target_name_override", name)]
    async with aio.secure_channel(address, credentials, options=options) as channel:
        reply = await pb_grpc.ParticipantServiceStub(channel).GetParticipant(
            pb.GetParticipantRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10
        )
        return str(reply.instance)


async def kubelet_probe(c: dict[str, Any], kind: str, health_address: str) -> int:
    """What the kubelet's `grpc:` probe `kind` of container `c` gets from a local health port
    (the container's port number replaced by the local one): plaintext, no token."""
    return await health_status(health_address, c[kind]["grpc"]["service"])


async def test_the_readme_certificate_serves_every_member_beside_plaintext_probes(
    tmp_path: Path,
) -> None:
    calls = run_readme_certificate_commands(tmp_path)
    token, tls = calls
    secret = ["-n", "default", "create", "secret", "generic"]
    assert token[:-1] == [*secret, "rollout-checkpoint-token"], calls
    assert re.fullmatch(r"--from-literal=token=[0-9a-f]{64}", token[-1]), token
    assert tls == [
        *secret,
        TLS_SECRET,
        "--type=kubernetes.io/tls",
        "--from-file=tls.crt",
        "--from-file=tls.key",
        "--from-file=ca.crt",
    ]
    for name in ("ca.crt", "tls.crt", "tls.key"):
        assert (tmp_path / name).is_file()
    h = await start_harness(
        tls_cert_file=str(tmp_path / "tls.crt"),
        tls_key_file=str(tmp_path / "tls.key"),
        health_address="127.0.0.1:0",
    )
    try:
        # The coordinator's view: the fleet file's TLS settings, with the Secret's CA, accept
        # the certificate for every member's address, short or fully qualified...
        fleet_file = tmp_path / "fleet.yaml"
        fleet = yaml.safe_load(one("ConfigMap")["data"]["fleet.yaml"])
        fleet["tls_ca_file"] = str(tmp_path / "ca.crt")
        fleet_file.write_text(yaml.safe_dump(fleet))
        spec = load_fleet_file(fleet_file, environ={f"{PREFIX}TOKEN": TOKEN})
        credentials = spec.credentials()
        assert credentials is not None
        hosts = member_hosts()
        assert hosts == ["counter-0.counter-control", "counter-1.counter-control"]
        for host in [*hosts, f"{hosts[0]}.default.svc", f"{hosts[1]}.default.svc.cluster.local"]:
            assert await get_participant(h.grpc_address, credentials, host) == "double"
        # ...and refuse a name the certificate does not carry (the check is real).
        with pytest.raises(aio.AioRpcError) as refused:
            await get_participant(h.grpc_address, credentials, "counter-2.counter-control")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # A plaintext client (what the kubelet's grpc: probe is) gets no answer on the TLS
        # port, and every probe's answer on the health port, as the manifest writes it.
        with pytest.raises(aio.AioRpcError):
            await health_status(h.grpc_address, "participant-liveness")
        c = container(participants())
        assert h.runtime.health_address is not None
        for kind in PROBES:
            assert await kubelet_probe(c, kind, h.runtime.health_address) == SERVING, kind
        # The coordinator serves its port with the same files, as its command line says: a
        # controller verifies it by its Service name, and its probes pass as written.
        await check_the_coordinator_serves_the_readme_certificate(tmp_path, spec)
    finally:
        await stop_harness(h)


async def check_the_coordinator_serves_the_readme_certificate(
    tmp_path: Path, spec: FleetSpec
) -> None:
    # The manifest's files, as the README's commands made them here.
    command = container(coordinator())["command"]
    cert, key = (
        tmp_path / Path(flag(command, f)).name for f in ("--tls-cert-file", "--tls-key-file")
    )
    credentials = server_credentials(cert, key, None)
    server = Coordinator(spec, "127.0.0.1:0", credentials=credentials, health_address="127.0.0.1:0")
    await server.start()
    try:
        trusted = grpc.ssl_channel_credentials((tmp_path / "ca.crt").read_bytes())
        service = coordinator_service()["metadata"]["name"]
        for name in (service, f"{service}.default.svc", f"{service}.default.svc.cluster.local"):
            options = [("grpc.ssl_target_name_override", name)]
            async with aio.secure_channel(
                f"127.0.0.1:{server.port}", trusted, options=options
            ) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                request = health_pb2.HealthCheckRequest(service=COORDINATOR_SERVICE)
                reply = await health.Check(request, timeout=30)
                assert reply.status == SERVING
        c = container(coordinator())
        assert server.health_listener is not None
        for kind in ("livenessProbe", "readinessProbe"):
            status = await kubelet_probe(c, kind, server.health_listener.bound_address)
            assert status == SERVING, kind
        with pytest.raises(aio.AioRpcError):  # plaintext gets no answer on the TLS port
            await health_status(f"127.0.0.1:{server.port}", COORDINATOR_SERVICE)
    finally:
        await server.stop()


async def test_the_probes_keep_a_start_closed_pod_alive_but_not_ready(tmp_path: Path) -> None:
    run_readme_certificate_commands(tmp_path)
    h = await start_harness(
        tls_cert_file=str(tmp_path / "tls.crt"),
        tls_key_file=str(tmp_path / "tls.key"),
        start_closed=True,
        health_address="127.0.0.1:0",
    )
    try:
        c = container(participants())
        assert h.runtime.health_address is not None
        results = {kind: await kubelet_probe(c, kind, h.runtime.health_address) for kind in PROBES}
        assert results == {
            "startupProbe": NOT_SERVING,
            "livenessProbe": SERVING,
            "readinessProbe": NOT_SERVING,
        }
    finally:
        await stop_harness(h)


# -- no first Resume: the supervisor opens a fresh install ----------------------------------


def readme_exec_commands() -> list[list[str]]:
    """Every `kubectl exec deploy/... -- CMD` of the README's Kubernetes section, joined
    across continuation lines and split as the shell would."""
    commands = []
    for block in readme_shell_blocks():
        for line in block.replace("\\\n", " ").splitlines():
            if " exec " in line and line.startswith("kubectl"):
                commands.append(shlex.split(line))
    return commands


def test_the_readme_fleet_verbs_run_in_the_coordinator_pod() -> None:
    # A fresh install needs no hand-run Resume any more (the supervisor opens it), so the
    # README runs only a read-only verb by hand, in the pod that has everything it needs.
    commands = readme_exec_commands()
    verbs = [command[command.index("--") + 2] for command in commands]
    assert verbs == ["status"]
    c = container(coordinator())
    fleet_mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["fleet"]
    parser = cli._parser()
    for command in commands:
        assert command[:4] == ["kubectl", "-n", "$NS", "exec"]
        assert command[4] == f"deploy/{coordinator()['metadata']['name']}"
        argv = command[command.index("--") + 1 :]
        assert argv[0] == c["command"][0] == "rollout-checkpoint"
        args = parser.parse_args(argv[1:])
        assert Path(args.fleet).parent == Path(fleet_mount)
        assert args.fleet.name in one("ConfigMap")["data"]
    # The pod has what the fleet file needs: the token (token_env) and the CA (tls_ca_file).
    fleet = yaml.safe_load(one("ConfigMap")["data"]["fleet.yaml"])
    assert "valueFrom" in env(c)[fleet["token_env"]]
    assert Path(fleet["tls_ca_file"]).parent == Path(mount_of_secret(coordinator(), TLS_SECRET))
    # The coordinator is Ready on its own (its probes ask its own health port, never a
    # member), so `kubectl exec deploy/...` finds it while every participant is still not
    # Ready.
    for probe in grpc_probes(c).values():
        assert probe["port"] == port(c, "health")
        assert probe["service"] in ("", COORDINATOR_SERVICE)
