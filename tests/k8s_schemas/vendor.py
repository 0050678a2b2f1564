"""Regenerate the vendored CRD schemas of this folder from the projects' published CRDs.

    python tests/k8s_schemas/vendor.py DIR_WITH_THE_CRD_YAMLS

DIR holds the files named in SOURCES (downloaded from their `url`s); each CRD's
`openAPIV3Schema` of the served version is written as JSON Schema (`<kind>.json`) the way
kubeconform's and datree's openapi2jsonschema do it, strictly:

- an object with `properties` gets `additionalProperties: false` unless it carries
  `x-kubernetes-preserve-unknown-fields` (the API server prunes unknown fields of a structural
  schema without an error: a misspelt field would vanish silently, so it is an error here);
- `x-kubernetes-int-or-string` becomes integer or string; `nullable` admits null;
- descriptions are dropped (they are most of the size and validate nothing).

CEL rules (`x-kubernetes-validations`) are kept in the file but not evaluated by the tests.
`SOURCES.json` records each schema's project, version, URL and the sha256 of the file read.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
SOURCES = [
    {
        "kind": "JobSet",
        "project": "kubernetes-sigs/jobset",
        "version": "v0.12.0",
        "file": "jobset.x-k8s.io_jobsets.yaml",
        "url": "https://raw.githubusercontent.com/kubernetes-sigs/jobset/v0.12.0/config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml",
    },
    {
        "kind": "TrainJob",
        "project": "kubeflow/trainer",
        "version": "v2.3.0",
        "file": "trainer.kubeflow.org_trainjobs.yaml",
        "url": "https://raw.githubusercontent.com/kubeflow/trainer/v2.3.0/manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml",
    },
    {
        "kind": "InferenceService",
        "project": "kserve/kserve",
        "version": "v0.20.0",
        "file": "serving.kserve.io_inferenceservices.yaml",
        "url": "https://raw.githubusercontent.com/kserve/kserve/v0.20.0/config/crd/full/serving.kserve.io_inferenceservices.yaml",
    },
    {
        "kind": "PodMonitor",
        "project": "prometheus-operator/prometheus-operator",
        "version": "v0.93.0",
        "file": "monitoring.coreos.com_podmonitors.yaml",
        "url": "https://raw.githubusercontent.com/prometheus-operator/prometheus-operator/v0.93.0/example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml",
    },
]


def strict(node: Any) -> Any:
    if isinstance(node, list):
        return [strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict(v) for k, v in node.items() if k != "description"}
    if out.pop("x-kubernetes-int-or-string", False):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


def convert(crd: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
    schema = strict(version["schema"]["openAPIV3Schema"])
    schema["properties"]["apiVersion"] = {"enum": [f"{group}/{version['name']}"]}
    schema["properties"]["kind"] = {"enum": [kind]}
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
    schema["$schema"] = "http://json-schema.org/draft-04/schema#"
    return kind, schema


def main(src: Path) -> None:
    records = []
    for source in SOURCES:
        raw = (src / source["file"]).read_bytes()
        kind, schema = convert(yaml.safe_load(raw))
        assert kind == source["kind"], (kind, source)
        (HERE / f"{kind}.json").write_text(json.dumps(schema, sort_keys=True) + "\n")
        records.append({**source, "sha256": hashlib.sha256(raw).hexdigest()})
    (HERE / "SOURCES.json").write_text(json.dumps(records, indent=2) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
