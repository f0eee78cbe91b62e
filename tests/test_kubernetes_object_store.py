"""deploy/kubernetes-object-store: the base fleet with its checkpoints on an object store.

What kustomize renders from the overlay validates strictly on every supported Kubernetes
(offline, as the base does); it has no ReadWriteMany claim, no checkpoint volume and no mount
of one anywhere; both workloads take the store's credentials from a Secret made by hand
(envFrom), and no AWS variable has an inline value; the participants allow exactly the URL the
fleet file's checkpoint_root lies under, as the settings and the fleet-file loader read them;
every other object is the base's, unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from rollout_checkpoint.client.fleet import load_fleet_file
from rollout_checkpoint.server.core.object_store import parse_object_url
from rollout_checkpoint.server.runtime.settings import CheckpointSettings

from .conftest import REPO
from .test_kubernetes import (
    identity,
    objects,
    render,
    validate_strictly,
    walk,
)

OVERLAY = REPO / "deploy" / "kubernetes-object-store"
KUBERNETES_PAGE = REPO / "docs" / "kubernetes.md"
SECRET = "rollout-checkpoint-object-store"
PREFIX = "ROLLOUT_CHECKPOINT_"


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    return render(OVERLAY)


def workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in ("StatefulSet", "Deployment")]


def only_container(workload: dict[str, Any]) -> dict[str, Any]:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    result: dict[str, Any] = c
    return result


def test_the_overlay_renders_valid_objects_without_any_shared_volume(
    rendered: list[dict[str, Any]],
) -> None:
    validate_strictly(rendered, "kustomize build deploy/kubernetes-object-store")
    assert [d for d in rendered if d["kind"] == "PersistentVolumeClaim"] == []
    for doc in rendered:
        for path, node in walk(doc):
            assert not path.endswith(".persistentVolumeClaim"), (identity(doc), path)
            if path.endswith(".mountPath"):
                assert node != "/checkpoints", (identity(doc), path)
    base = {identity(o): o for o in objects()}
    assert sorted(map(identity, rendered)) == sorted(
        k for k in base if k[0] != "PersistentVolumeClaim"
    )
    for doc in rendered:  # only the workloads and the fleet file change
        if doc["kind"] not in ("StatefulSet", "Deployment", "ConfigMap"):
            assert doc == base[identity(doc)], identity(doc)


def test_credentials_come_only_from_a_secret_made_by_hand(
    rendered: list[dict[str, Any]],
) -> None:
    assert [d for d in rendered if d["kind"] == "Secret"] == []  # made by hand, never here
    for workload in workloads(rendered):
        c = only_container(workload)
        assert c["envFrom"] == [{"secretRef": {"name": SECRET}}], identity(workload)
        for variable in c.get("env", []):
            assert not variable["name"].startswith("AWS_"), (identity(workload), variable)
    text = (OVERLAY / "kustomization.yaml").read_text()
    assert f"kubectl create secret generic {SECRET}" in text
    assert f"create secret generic {SECRET}" in KUBERNETES_PAGE.read_text()


def test_participants_allow_the_url_the_fleet_file_publishes_under(
    rendered: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (statefulset,) = [d for d in rendered if d["kind"] == "StatefulSet"]
    variables = {e["name"]: e for e in only_container(statefulset)["env"]}
    roots = json.loads(variables[f"{PREFIX}ALLOWED_CHECKPOINT_ROOTS"]["value"])
    settings = CheckpointSettings(enabled=True, token="t", allowed_checkpoint_roots=roots)
    (root,) = settings.allowed_checkpoint_roots
    (config,) = [d for d in rendered if d["kind"] == "ConfigMap"]
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(config["data"]["fleet.yaml"])
    monkeypatch.setenv("ROLLOUT_CHECKPOINT_TOKEN", "t")
    spec = _load_without_tls(fleet_file)
    assert spec.checkpoint_root is not None
    assert parse_object_url(root).contains(parse_object_url(spec.checkpoint_root))
    assert spec.checkpoint_root.startswith("s3://")


def _load_without_tls(fleet_file: Path) -> Any:
    """The fleet file as the coordinator reads it, minus the CA file only the pod has."""
    data = yaml.safe_load(fleet_file.read_text())
    data.pop("tls_ca_file")
    fleet_file.write_text(yaml.safe_dump(data))
    return load_fleet_file(fleet_file)
