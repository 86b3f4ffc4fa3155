"""A model Tether cannot serve fails where an operator looks, and `/health` says whether any replica can serve.

- An unsupported architecture stops the builder (what `serve run` imports) with the loader's message.
- What only a replica finds (here: a checkpoint without weights) fails its constructor; after the app's
  `replica_max_constructor_retry_count` failures Serve gives up: `serve.run` raises and `serve status`
  shows ModelReplica DEPLOY_FAILED with the engine's ValueError, verbatim.
- `/health` is 200 on the healthy app and 503, in OpenAI's error shape, on the failed one.
"""

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest

from model_files.architectures import UnsupportedModelError

BROKEN = "broken"


def copy_model(src: Path, dst: Path, weights: bool = True, **config) -> Path:
    """The tiny model's files in `dst`, its config.json updated with `config`."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and (weights or path.suffix != ".safetensors"):
            shutil.copy(path, dst / path.name)
    config_path = dst / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **config}))
    return dst


def app_args(model: Path) -> dict:
    return {"model": str(model), "served_model_name": BROKEN, "num_replicas": 2, "dtype": "float32", "replica_num_cpus": 0,
            "engine": {"num_threads": 1}}


def test_the_builder_refuses_an_unsupported_architecture(tiny_llama_dir, tmp_path):
    from serve_app.app import build_app

    gpt2 = copy_model(tiny_llama_dir, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError) as refused:
        build_app(app_args(gpt2))
    message = str(refused.value)
    assert message.startswith("architecture 'GPT2LMHeadModel' is not supported. Supported: ")
    assert "LlamaForCausalLM (llama)" in message and "Qwen3_5ForCausalLM (qwen3_5)" in message
    assert "Closest" not in message  # no family is honestly close to GPT-2

    gemma2 = copy_model(tiny_llama_dir, tmp_path / "gemma2", architectures=["Gemma2ForCausalLM"])
    with pytest.raises(UnsupportedModelError, match=r"Closest supported family: gemma3 \(Gemma3ForCausalLM: "):
        build_app(app_args(gemma2))


def test_every_hint_names_a_supported_architecture_and_says_why():
    from model_files.architectures import CLOSEST, CLOSEST_WHY, SUPPORTED, check_architecture

    assert set(CLOSEST) == set(CLOSEST_WHY) and not set(CLOSEST) & set(SUPPORTED)
    assert all(target in SUPPORTED for target in CLOSEST.values())
    assert check_architecture(None) == check_architecture([]) == "LlamaForCausalLM"  # as the loader always did
    assert check_architecture(["Qwen3_5ForCausalLM"]) == "Qwen3_5ForCausalLM"


def test_health_is_200_while_replicas_serve(serve_app):
    reply = httpx.get(f"{serve_app}/health", timeout=30)
    assert reply.status_code == 200 and reply.json() == {"status": "ok"}


@pytest.fixture(scope="module")
def broken_app(serve_app, tiny_llama_dir, tmp_path_factory):
    """The app over a checkpoint without its weights: it passes the builder (config.json is fine) and
    fails every ModelReplica constructor with the loader's ValueError. -> (serve.run's error, seconds)."""
    from ray import serve

    from serve_app.app import build_app

    model = copy_model(tiny_llama_dir, tmp_path_factory.mktemp("no-weights"), weights=False)
    app = build_app(app_args(model))
    start = time.monotonic()
    with pytest.raises(RuntimeError) as failed:
        serve.run(app, name=BROKEN, route_prefix=f"/{BROKEN}")
    yield str(failed.value), time.monotonic() - start
    serve.delete(BROKEN)


def test_a_replica_that_cannot_start_is_deploy_failed_with_its_error(broken_app):
    from ray import serve

    raised, seconds = broken_app
    assert f"Deploying application {BROKEN} failed" in raised and "ModelReplica" in raised
    status = serve.status().applications[BROKEN]
    deployment = status.deployments["ModelReplica"]
    assert status.status == "DEPLOY_FAILED" and deployment.status == "DEPLOY_FAILED"
    # Both replicas failed once, in parallel (the default retry count is 2): no retry loop.
    assert "The deployment failed to start 2 times in a row" in deployment.message
    assert deployment.message.rstrip().splitlines()[-1].startswith("ValueError: no *.safetensors in ")
    assert seconds < 60


def test_health_is_503_when_no_replica_can_serve(serve_app, proxy_url, broken_app):
    url = f"{proxy_url}/{BROKEN}/health"
    failed = "no model replica can serve: the model deployment failed to start; `serve status` shows why"
    deadline = time.monotonic() + 10
    while True:
        # Before the ingress's handle hears from the controller that the deployment failed, the probe
        # waits for a replica and answers 503 after ingress.health_timeout_s; then at once, saying why.
        reply = httpx.get(url, timeout=30)
        assert reply.status_code == 503, reply.text
        error = reply.json()["error"]
        assert error["type"] == "server_unavailable" and error["message"].startswith("no model replica can serve")
        assert reply.headers["Retry-After"] == "1"
        if error["message"] == failed or time.monotonic() > deadline:
            break
    assert error["message"] == failed
    assert httpx.get(f"{serve_app}/health", timeout=30).status_code == 200  # the healthy app beside it


def test_a_request_to_the_failed_deployment_gets_a_503_in_openai_shape(proxy_url, broken_app):
    """Once the ingress knows the deployment failed; a bounded wait (at most ingress.health_timeout_s for its
    context-length sync) before it knows."""
    body = {"model": BROKEN, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    reply = httpx.post(f"{proxy_url}/{BROKEN}/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 503, reply.text
    assert reply.headers.get("content-type", "").startswith("application/json"), (reply.headers, reply.text)
    error = reply.json()["error"]
    assert error["type"] == "server_unavailable" and "failed to start" in error["message"]


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
