"""A local Ray instance serving one Tether app, as configs/local.yaml runs it: for tests and benchmarks.

The fast path (the default): Serve's proxy is off and the Ingress answers HTTP on `port` itself
(`ingress.http_port`, serve_app/front_door.py), deltas coming back over the delta channels. With
`proxy=True` the same app also answers through Serve's proxy on `proxy_port`: the old path.
"""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_local_app(args: dict, port: int, *, proxy_port: int | None = None, app_name: str = "tether",
                    num_cpus: int = 2, builder=None, **ray_init) -> str:
    """Starts Ray and Serve, deploys `builder(args)` (default: build_app) -> the fast path's base URL."""
    import ray
    from ray import serve

    from serve_app.app import build_app

    if "runtime_env" not in ray_init:
        ray_init["runtime_env"] = {"env_vars": {"PYTHONPATH": ROOT}}
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, **ray_init)
    if proxy_port is None:
        serve.start(proxy_location="Disabled")
    else:
        # HeadOnly: nodes added on this machine (testing/local_nodes.py) would each start a proxy on the same port.
        serve.start(http_options={"host": "127.0.0.1", "port": proxy_port}, proxy_location="HeadOnly")
    args = with_http_port(args, port)
    serve.run((builder or build_app)(args), name=app_name, route_prefix="/")
    return f"http://127.0.0.1:{port}"


def with_http_port(args: dict, port: int | None) -> dict:
    """`args` with ingress.http_port set (None: through Serve's proxy only)."""
    ingress = dict(args.get("ingress") or {})
    ingress["http_port"] = port
    return {**args, "ingress": ingress}


def stop_local_app() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
