"""Structure of the Ray cluster launcher config and the KubeRay manifest (parsed, checked against the
fields pdserve relies on; they are not run on a real cluster here)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]

_STR_LIST = {"type": "array", "items": {"type": "string"}, "minItems": 1}
_TOKEN_ENV = {
    "type": "array",
    "allOf": [
        {
            "contains": {
                "properties": {"name": {"const": "RAY_AUTH_MODE"}, "value": {"const": "token"}},
                "required": ["name", "value"],
            }
        },
        {
            "contains": {
                "properties": {"name": {"const": "RAY_AUTH_TOKEN"}, "valueFrom": {"type": "object"}},
                "required": ["name", "valueFrom"],
            }
        },
    ],
}
_POD = {
    "type": "object",
    "required": ["spec"],
    "properties": {
        "spec": {
            "type": "object",
            "required": ["containers"],
            "properties": {
                "containers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["name", "image", "env", "resources"],
                        "properties": {"env": _TOKEN_ENV},
                    },
                }
            },
        }
    },
}
RAY_LAUNCHER_SCHEMA = {
    "type": "object",
    "required": [
        "cluster_name",
        "max_workers",
        "provider",
        "auth",
        "available_node_types",
        "head_node_type",
        "setup_commands",
        "head_start_ray_commands",
        "worker_start_ray_commands",
    ],
    "properties": {
        "provider": {"type": "object", "required": ["type"]},
        "available_node_types": {
            "type": "object",
            "minProperties": 3,
            "additionalProperties": {
                "type": "object",
                "required": ["resources", "node_config", "min_workers", "max_workers"],
                "properties": {
                    "resources": {"type": "object", "additionalProperties": {"type": "number"}},
                    "min_workers": {"type": "integer", "minimum": 0},
                    "max_workers": {"type": "integer", "minimum": 0},
                },
            },
        },
        "head_start_ray_commands": _STR_LIST,
        "worker_start_ray_commands": _STR_LIST,
        "setup_commands": _STR_LIST,
    },
}
_WORKER_GROUP = {
    "type": "object",
    "required": ["groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams", "template"],
    "properties": {
        "rayStartParams": {
            "type": "object",
            "required": ["num-gpus", "resources"],
            "additionalProperties": {"type": "string"},
        },
        "replicas": {"type": "integer", "minimum": 0},
        "template": _POD,
    },
}
RAYCLUSTER_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayCluster"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["rayVersion", "headGroupSpec", "workerGroupSpecs"],
            "properties": {
                "headGroupSpec": {
                    "type": "object",
                    "required": ["rayStartParams", "template"],
                    "properties": {"template": _POD},
                },
                "workerGroupSpecs": {"type": "array", "minItems": 2, "items": _WORKER_GROUP},
            },
        },
    },
}


def _load_all(path: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((ROOT / path).read_text()) if d is not None]


def test_ray_launcher_config() -> None:
    (config,) = _load_all("cluster/ray/cluster.yaml")
    jsonschema.validate(config, RAY_LAUNCHER_SCHEMA)
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    custom = {name: t["resources"] for name, t in types.items()}
    assert any(r.get("prefill_gpu") for r in custom.values()) and any(r.get("decode_gpu") for r in custom.values())
    assert not any(r.get("prefill_gpu") and r.get("decode_gpu") for r in custom.values())  # separate pools
    assert all(r.get("GPU", 0) >= 1 for r in custom.values() if r.get("prefill_gpu") or r.get("decode_gpu"))
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token" in c for c in starts if "ray start" in c)
    assert "~/.ray/auth_token" in config["file_mounts"]
    assert sum(t["max_workers"] for t in types.values()) <= config["max_workers"]


def test_kuberay_manifest() -> None:
    docs = _load_all("cluster/kuberay/raycluster.yaml")
    (cluster,) = [d for d in docs if d["kind"] == "RayCluster"]
    jsonschema.validate(cluster, RAYCLUSTER_SCHEMA)
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    resources = {name: json.loads(json.loads(g["rayStartParams"]["resources"])) for name, g in groups.items()}
    assert resources == {"prefill-gpu": {"prefill_gpu": 1}, "decode-gpu": {"decode_gpu": 1}}
    for group in groups.values():
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == group["rayStartParams"]["num-gpus"]
    (service,) = [d for d in docs if d["kind"] == "Service"]
    assert service["spec"]["selector"]["ray.io/cluster"] == cluster["metadata"]["name"]
    assert service["spec"]["ports"][0]["targetPort"] == 50051


def test_manifests_name_no_registry_host() -> None:
    for path in ("cluster/ray/cluster.yaml", "cluster/kuberay/raycluster.yaml"):
        text = (ROOT / path).read_text()
        assert "://" not in text and "ghcr.io" not in text and "docker.io" not in text
