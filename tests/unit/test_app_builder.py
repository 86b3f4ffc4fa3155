"""`serve run serve_app.app:build_app` / `serve deploy` hand the builder to Serve's own check: it must
take exactly one parameter (a keyword-only extra broke `make serve` once)."""

from ray import serve
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

from serve_app.app import build_app


def test_serve_accepts_build_app_as_an_application_builder(tiny_llama_dir):
    args = {"model": str(tiny_llama_dir), "num_replicas": 2, "dtype": "float32"}
    app = call_user_app_builder_with_args_if_necessary(build_app, args)
    assert isinstance(app, serve.Application)
