"""The shipped serve configs (configs/*.yaml, k8s/rayservice.yaml's serveConfigV2) are what `serve deploy`
accepts, their args are valid AppConfigs, and they run the fast path: the Ingress answers HTTP on 8000."""

from pathlib import Path

import pytest
import yaml

from core.app_config import AppConfig
from serve_app.app import _parse_args

ROOT = Path(__file__).resolve().parents[2]


def serve_configs() -> dict[str, dict]:
    configs = {p.name: yaml.safe_load(p.read_text()) for p in sorted((ROOT / "configs").glob("*.yaml"))}
    documents = list(yaml.safe_load_all((ROOT / "k8s" / "rayservice.yaml").read_text()))
    service = next(d for d in documents if d["kind"] == "RayService")
    configs["rayservice.yaml"] = yaml.safe_load(service["spec"]["serveConfigV2"])
    return configs


@pytest.mark.parametrize("name", sorted(serve_configs()))
def test_a_shipped_config_deploys_the_fast_path(name):
    from ray.serve.schema import ServeDeploySchema

    config = serve_configs()[name]
    schema = ServeDeploySchema(**config)
    for app in schema.applications:
        ingress = AppConfig(**_parse_args(app.args)).ingress
        assert ingress.http_port == 8000 and ingress.delta_channels, name
    if schema.proxy_location.value != "Disabled":  # the old path beside it, on another port
        assert schema.http_options.port != 8000, name


def test_the_kubernetes_service_reaches_the_ingress_port():
    documents = list(yaml.safe_load_all((ROOT / "k8s" / "rayservice.yaml").read_text()))
    service = next(d for d in documents if d["kind"] == "Service")
    assert service["spec"]["ports"][0]["targetPort"] == 8000
    head = next(d for d in documents if d["kind"] == "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]
    ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert ports["tether-http"] == 8000 and "tether-ingress" in head["rayStartParams"]["resources"]


def test_command_line_args_take_dotted_keys_and_json():
    """`serve run serve_app.app:build_app engine.max_num_seqs=8 ...`: what the README shows works as written."""
    args = {"model": "default", "num_replicas": "auto", "autoscaling.max_replicas": "3",
            "engine": '{"kv_cache_bytes": 268435456}', "engine.max_num_seqs": "8",
            "ingress.cors_allow_origins": '["https://chat.example.com"]', "ingress.api_keys_file": "/etc/keys"}
    config = AppConfig(**_parse_args(args))
    assert (config.engine.kv_cache_bytes, config.engine.max_num_seqs) == (268435456, 8)
    assert config.autoscaling.max_replicas == 3 and config.num_replicas == "auto"
    assert config.ingress.cors_allow_origins == ["https://chat.example.com"]
    assert config.ingress.api_keys_file == "/etc/keys"
    with pytest.raises(ValueError, match="engine"):
        _parse_args({"engine": "x", "engine.max_num_seqs": "8"})
    with pytest.raises(ValueError, match="ingress.cors_allow_origins: a value starting with '\\[' is read as JSON"):
        _parse_args({"ingress.cors_allow_origins": "[https://a.example]"})
