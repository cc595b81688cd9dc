"""Strict offline validation of KubeRay manifests against the CRD schemas in `../shared/kuberay-crds/`.

kubeconform's strict mode, done by hand: take the `v1` `openAPIV3Schema` of a CRD, forbid unknown
fields wherever a schema lists `properties` (unless it preserves unknown fields), and validate with
JSON Schema draft 7. `x-kubernetes-int-or-string` fields accept an integer or a string.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import jsonschema
import yaml

CRD_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "kuberay-crds"
CRD_FILES = {
    "RayJob": "ray.io_rayjobs.yaml",
    "RayService": "ray.io_rayservices.yaml",
    "RayCluster": "ray.io_rayclusters.yaml",
}


def _strict(schema: Any) -> Any:
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if schema.get("x-kubernetes-int-or-string"):
            out.pop("type", None)
            out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def strict_schema(kind: str) -> dict[str, Any]:
    """The strict v1 schema of a KubeRay kind (RayJob, RayService, RayCluster)."""
    crd = yaml.load(
        (CRD_DIR / CRD_FILES[kind]).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    )
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta is not part of the CRD schema
    return schema


def validation_errors(manifest: dict[str, Any]) -> list[str]:
    """Every schema violation of `manifest` as 'path: message' (empty when valid)."""
    validator = jsonschema.Draft7Validator(strict_schema(manifest["kind"]))
    return [
        f"{'.'.join(str(p) for p in err.absolute_path) or '<root>'}: {err.message}"
        for err in sorted(validator.iter_errors(manifest), key=lambda e: list(map(str, e.absolute_path)))
    ]
