"""`serve run serve_app.app:build_app` / `serve deploy` hand the builder to Serve's own check: it must
take exactly one parameter (a keyword-only extra broke `make serve` once)."""

from ray import serve
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

from serve_app.app import build_app


def test_serve_accepts_build_app_as_an_application_builder(tiny_llama_dir):
    args = {"model": str(tiny_llama_dir), "num_replicas": 2, "dtype": "float32"}
    app = call_user_app_builder_with_args_if_necessary(build_app, args)
    assert isinstance(app, serve.Application)


def test_autoscaling_and_placement_reach_the_deployments(tiny_llama_dir):
    """AppConfig's autoscaling knobs become ModelReplica's AutoscalingConfig; replica and depot resources, and
    the depot's bytes as Ray memory, become their actor options."""
    args = {"model": str(tiny_llama_dir), "num_replicas": "auto", "dtype": "float32",
            "autoscaling": {"min_replicas": 2, "max_replicas": 6, "target_ongoing_requests": 3,
                            "upscale_delay_s": 5, "downscale_delay_s": 60},
            "replica_resources": {"tether-slot": 1},
            "migration": {"depot_bytes": 1 << 30, "depot_resources": {"tether-depot": 1}}}
    ingress = build_app(args)._bound_deployment
    replicas = ingress.init_args[1]._bound_deployment
    depot = replicas.init_args[2]._bound_deployment
    scaling = replicas._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (2, 6, 3)
    assert (scaling.upscale_delay_s, scaling.downscale_delay_s) == (5, 60)
    assert replicas.ray_actor_options["resources"] == {"tether-slot": 1}
    assert depot.ray_actor_options["resources"] == {"tether-depot": 1}
    assert depot.ray_actor_options["memory"] == 1 << 30
