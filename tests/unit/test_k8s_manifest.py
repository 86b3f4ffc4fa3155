"""k8s/rayservice.yaml: what `kubectl apply --validate=strict` would accept, with the pieces agreeing.

- The RayService validates against KubeRay's published CRD schema (k8s/crd/, with the KubeRay version it
  came from), read the way a strict apply reads it: a field the schema does not declare is an error wherever
  the schema does not say `x-kubernetes-preserve-unknown-fields: true` (the API server would prune it
  silently, so a typo like `rayClusterConfg` would just vanish). `x-kubernetes-int-or-string` allows an
  integer or a string; other `x-kubernetes-*` keys (list types, CEL rules) are not checked here.
- serveConfigV2 is a valid Serve config (Ray's own ServeDeploySchema) of valid Tether args (AppConfig), whose
  custom resources, API-key variable and depot fit the head pod they name.
- The Service `tether-http` selects the head pod (the labels KubeRay gives it, plus its template's) and no
  worker, and reaches a port the head container declares.
"""

import ast
import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from core.app_config import AppConfig
from serve_app.app import _parse_args

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "k8s" / "rayservice.yaml"
CRD = ROOT / "k8s" / "crd" / "rayservices.ray.io.v1.schema.json"
# Labels KubeRay puts on every head pod whatever the cluster's name (labelPod in
# ray-operator/controllers/ray/common/pod.go, v1.7.0); ray.io/cluster and ray.io/identifier carry the
# RayCluster's generated name, so a Service cannot select by them.
KUBERAY_HEAD_LABELS = {"ray.io/node-type": "head", "ray.io/group": "headgroup", "ray.io/is-ray-node": "yes",
                       "app.kubernetes.io/name": "kuberay", "app.kubernetes.io/created-by": "kuberay-operator"}
# The API server checks ObjectMeta itself (the CRD says only `type: object`): the fields a manifest may set.
OBJECT_META = {"type": "object", "additionalProperties": False, "required": ["name"],
               "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                              "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                              "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}}
INT_RANGES = {"int32": (-2**31, 2**31 - 1), "int64": (-2**63, 2**63 - 1)}


def documents() -> list[dict]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def rayservice(docs: list[dict]) -> dict:
    return next(d for d in docs if d["kind"] == "RayService")


def strict(schema: dict) -> dict:
    """The structural schema as `kubectl apply --validate=strict` applies it (see the module doc)."""
    if schema.get("x-kubernetes-int-or-string"):
        schema = {**schema, "anyOf": [{"type": "integer"}, {"type": "string"}]}
    out = dict(schema)
    if "properties" in schema:
        out["properties"] = {name: strict(sub) for name, sub in schema["properties"].items()}
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = strict(schema["additionalProperties"])
    if isinstance(schema.get("items"), dict):
        out["items"] = strict(schema["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in schema:
            out[key] = [strict(sub) for sub in schema[key]]
    if schema.get("type") == "object" and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def crd_validator() -> jsonschema.Draft7Validator:
    schema = strict(json.loads(CRD.read_text())["openAPIV3Schema"])
    schema["properties"]["metadata"] = OBJECT_META
    checker = jsonschema.FormatChecker()
    for name, (low, high) in INT_RANGES.items():
        checker.checks(name)(lambda value, low=low, high=high: not isinstance(value, int) or low <= value <= high)
    return jsonschema.Draft7Validator(schema, format_checker=checker)


def crd_errors(document: dict) -> list[str]:
    return sorted(f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
                  for e in crd_validator().iter_errors(document))


def test_the_vendored_crd_is_kuberays_rayservice_v1():
    crd = json.loads(CRD.read_text())
    assert re.fullmatch(r"v\d+\.\d+\.\d+", crd["kuberay_version"]) and re.fullmatch(r"[0-9a-f]{40}",
                                                                                    crd["kuberay_commit"])
    assert (crd["crd"], crd["kind"], crd["version"]) == ("rayservices.ray.io", "RayService", "v1")
    spec = crd["openAPIV3Schema"]["properties"]["spec"]
    assert {"serveConfigV2", "rayClusterConfig"} <= set(spec["properties"]) and "rayClusterConfig" in spec["required"]


def test_the_rayservice_validates_against_kuberays_crd():
    docs = [d for d in documents() if d["kind"] == "RayService"]
    assert docs and all(d["apiVersion"] == "ray.io/v1" for d in docs)
    for document in docs:
        assert crd_errors(document) == []


@pytest.mark.parametrize("path, change", [
    ("spec", lambda s: s.__setitem__("rayClusterConfg", s.pop("rayClusterConfig"))),
    ("spec.rayClusterConfig.headGroupSpec.template.spec.containers.0", lambda c: c.__setitem__("imagee", "x")),
    ("spec.rayClusterConfig.headGroupSpec.rayStartParams", lambda p: p.__setitem__("num-cpus", 0)),
    ("spec.rayClusterConfig.workerGroupSpecs.0", lambda w: w.__setitem__("replicas", "2")),
    ("metadata", lambda m: m.__setitem__("nmae", "tether")),
])
def test_the_validation_catches_a_mistake(path, change):
    document = copy.deepcopy(rayservice(documents()))
    node = document
    for key in path.split("."):
        node = node[int(key) if key.isdigit() else key]
    change(node)
    assert crd_errors(document), f"a mistake at {path} passed"


def test_the_strict_reading_keeps_preserve_unknown_fields_open():
    schema = {"type": "object", "properties": {
        "open": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"a": {}}},
        "closed": {"type": "object", "properties": {"a": {}}},
        "port": {"x-kubernetes-int-or-string": True}}}
    validator = jsonschema.Draft7Validator(strict(schema))
    assert validator.is_valid({"open": {"b": 1}, "port": "http"}) and validator.is_valid({"port": 8000})
    assert not validator.is_valid({"closed": {"b": 1}}) and not validator.is_valid({"port": 1.5})


def serve_config() -> dict:
    return yaml.safe_load(rayservice(documents())["spec"]["serveConfigV2"])


def head_group() -> dict:
    return rayservice(documents())["spec"]["rayClusterConfig"]["headGroupSpec"]


def advertised(group: dict) -> dict[str, float]:
    """The custom resources of a group's rayStartParams: KubeRay's '"{\\"name\\": n}"' form."""
    value = group.get("rayStartParams", {}).get("resources")
    return json.loads(value.strip('"').replace('\\"', '"')) if value else {}


def deployment_names() -> set[str]:
    """The names serve_app/app.py gives its deployments (`serve.deployment(cls, name="...")`)."""
    tree = ast.parse((ROOT / "serve_app" / "app.py").read_text())
    return {k.value.value for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) == "deployment" for k in node.keywords if k.arg == "name"}


def quantity_bytes(value: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([KMGT]i)?", value).groups()
    return int(number) * 1024 ** (" KMGT".index(unit[0]) if unit else 0)


def test_the_serve_config_fits_the_cluster_it_names():
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema(**serve_config())
    head = head_group()
    workers = rayservice(documents())["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    on_head = advertised(head)
    container = head["template"]["spec"]["containers"][0]
    for app in schema.applications:
        config = AppConfig(**_parse_args(app.args))
        assert {d.name for d in app.deployments} <= deployment_names()
        ingress = next(d for d in app.deployments if d.name == "Ingress")
        # The Ingress and the StateDepot only fit the head, where port 8000 and the API keys are.
        for resources in (ingress.ray_actor_options.resources, config.migration.depot_resources):
            assert resources and all(on_head.get(name, 0) >= need for name, need in resources.items()), resources
            assert not any(name in advertised(group) for group in workers for name in resources)
        key_env = next(e for e in container["env"] if e["name"] == config.ingress.api_keys_env)
        assert key_env["valueFrom"]["secretKeyRef"] == {"name": "tether-api-keys", "key": "keys"}
        # The depot reserves depot_bytes of Ray's `memory` resource: the pod's limit less the object store (30%).
        memory = quantity_bytes(container["resources"]["limits"]["memory"])
        assert 0 < config.migration.depot_bytes <= 0.7 * memory, "no room for the depot on the head"


def test_the_http_service_selects_the_head_pod_and_reaches_its_port():
    docs = documents()
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "tether-http")
    assert service["apiVersion"] == "v1" and service["spec"]["selector"]
    cluster = rayservice(docs)["spec"]["rayClusterConfig"]
    head_labels = {**cluster["headGroupSpec"]["template"].get("metadata", {}).get("labels", {}),
                   **KUBERAY_HEAD_LABELS}
    selector = service["spec"]["selector"]
    assert selector.items() <= head_labels.items(), f"{selector} selects no head pod (it has {head_labels})"
    for group in cluster["workerGroupSpecs"]:
        worker_labels = {**group["template"].get("metadata", {}).get("labels", {}), "ray.io/node-type": "worker"}
        assert not selector.items() <= worker_labels.items(), f"{selector} also selects {group['groupName']}"
    container_ports = {p["containerPort"] for c in cluster["headGroupSpec"]["template"]["spec"]["containers"]
                       for p in c["ports"]}
    names = [p["name"] for p in service["spec"]["ports"]]
    assert len(names) == len(set(names))
    for port in service["spec"]["ports"]:
        assert 1 <= port["port"] <= 65535 and port["targetPort"] in container_ports, port
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", port["name"]) and len(port["name"]) <= 15
