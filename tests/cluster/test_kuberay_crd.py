"""cluster/kuberay/raycluster.yaml against the RayCluster CRD schema published by the KubeRay operator
(cluster/kuberay/schema/raycluster-v1.json, see its README), validated strictly: an undeclared field
is an error, as with `kubectl apply --validate=strict` or `kubeconform -strict`."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "cluster/kuberay/schema/raycluster-v1.json"


def strict(schema: Any) -> Any:  # noqa: ANN401 - JSON
    """The schema with ``additionalProperties: false`` on every object that declares its properties
    (Kubernetes' strict field validation), except where the CRD keeps unknown fields."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    schema = strict(json.loads(SCHEMA.read_text()))
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.fixture
def manifest() -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all((ROOT / "cluster/kuberay/raycluster.yaml").read_text()) if d]
    (cluster,) = [d for d in docs if d["kind"] == "RayCluster"]
    return cluster


def _errors(validator: jsonschema.protocols.Validator, doc: dict[str, Any]) -> list[str]:
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc))


def test_schema_is_the_published_raycluster_v1() -> None:
    schema = json.loads(SCHEMA.read_text())
    spec = schema["properties"]["spec"]["properties"]
    assert {"headGroupSpec", "workerGroupSpecs", "rayVersion", "enableInTreeAutoscaling", "authOptions"} <= set(spec)
    assert "groupName" in spec["workerGroupSpecs"]["items"]["required"]
    assert "Apache License 2.0" in (SCHEMA.parent / "README.md").read_text()


def test_manifest_is_valid(validator: jsonschema.protocols.Validator, manifest: dict[str, Any]) -> None:
    assert _errors(validator, manifest) == []


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (lambda m: m["spec"]["workerGroupSpecs"][0].update(replica=1), "spec/workerGroupSpecs/0"),  # typo
        (lambda m: m["spec"]["workerGroupSpecs"][1].update(replicas="1"), "spec/workerGroupSpecs/1/replicas"),
        (
            lambda m: m["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0].update(volumeMount=[]),
            "spec/headGroupSpec/template/spec/containers/0",
        ),
        (
            lambda m: m["spec"]["headGroupSpec"]["template"]["spec"]["volumes"][0]["secret"].update(name="x"),
            "spec/headGroupSpec/template/spec/volumes/0/secret",
        ),
        (lambda m: m["spec"].update(authOptions={"mode": "tokens"}), "spec/authOptions/mode"),
        (lambda m: m["spec"]["workerGroupSpecs"][0].pop("groupName"), "spec/workerGroupSpecs/0"),
    ],
)
def test_schema_catches_mistakes(
    validator: jsonschema.protocols.Validator, manifest: dict[str, Any], edit: Any, where: str
) -> None:  # noqa: ANN401
    broken = copy.deepcopy(manifest)
    edit(broken)
    errors = _errors(validator, broken)
    assert errors and all(e.startswith(where) for e in errors), errors


def test_head_mounts_the_router_tls_and_token(manifest: dict[str, Any]) -> None:
    pod = manifest["spec"]["headGroupSpec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert secrets == {"router-tls": "pdserve-router-tls", "router-auth": "pdserve-router-token"}
    assert mounts == {"router-tls": "/etc/pdserve/tls", "router-auth": "/etc/pdserve/auth"}
    recipe = (ROOT / "docs/ray.md").read_text()  # the documented command uses these paths
    for path in ("/etc/pdserve/tls/tls.crt", "/etc/pdserve/tls/tls.key", "/etc/pdserve/auth/token"):
        assert path in recipe
