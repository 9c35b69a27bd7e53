"""Convert a KubeRay CRD's openAPIV3Schema into the JSON Schema the tests validate against.

The conversion is KubeRay's own (ray-project/kuberay ``scripts/openapi2jsonschema.py``, itself
derived from kubeconform's), which KubeRay runs before kubeconform:

- every object with ``properties`` and no ``additionalProperties`` gets
  ``additionalProperties: false`` (what kubectl's validation does), except the root object
  (KubeRay's default, unless DENY_ROOT_ADDITIONAL_PROPERTIES is set);
- ``format: int-or-string`` becomes ``oneOf: [string, integer]``.

Two changes keep the stored files small (the RayCluster CRD is ~0.9 MB of YAML, the RayJob
one ~1.4 MB), neither changes what a manifest is checked against:
``status`` is dropped (a manifest has none; the API server ignores it on create), and the
JSON is written minified.

Usage (from the repo root, the CRDs taken from a KubeRay release tag)::

    git -C kuberay show v1.7.0:ray-operator/config/crd/bases/ray.io_rayclusters.yaml > rc.yaml
    python k8s/schemas/convert.py rc.yaml k8s/schemas/raycluster-v1.json
"""
from __future__ import annotations

import json
import sys

import yaml

VERSION = "v1"


def additional_properties(data, skip=False):
    """KubeRay's additional_properties(), unchanged."""
    if isinstance(data, dict):
        if "properties" in data and not skip:
            if "additionalProperties" not in data:
                data["additionalProperties"] = False
        for _, v in data.items():
            additional_properties(v)
    return data


def replace_int_or_string(data):
    """KubeRay's replace_int_or_string(), unchanged."""
    new = {}
    try:
        for k, v in iter(data.items()):
            new_v = v
            if isinstance(v, dict):
                if "format" in v and v["format"] == "int-or-string":
                    new_v = {"oneOf": [{"type": "string"}, {"type": "integer"}]}
                else:
                    new_v = replace_int_or_string(v)
            elif isinstance(v, list):
                new_v = list()
                for x in v:
                    new_v.append(replace_int_or_string(x))
            else:
                new_v = v
            new[k] = new_v
        return new
    except AttributeError:
        return data


def convert(crd: dict, version: str = VERSION) -> dict:
    """The JSON Schema of ``version`` of a CustomResourceDefinition."""
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            schema = v["schema"]["openAPIV3Schema"]
            break
    else:
        raise ValueError(f"{crd['metadata']['name']}: no version {version!r}")
    schema.get("properties", {}).pop("status", None)
    schema = additional_properties(schema, skip=True)
    return replace_int_or_string(schema)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        crd = next(d for d in yaml.safe_load_all(f) if d and d.get("kind") == "CustomResourceDefinition")
    with open(argv[1], "w") as f:
        json.dump(convert(crd), f, separators=(",", ":"), sort_keys=True)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
