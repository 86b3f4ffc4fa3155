"""build_app: the builder `serve run` / `serve deploy` import (`serve_app.app:build_app`).

    serve run serve_app.app:build_app model=<dir-or-gguf> num_replicas=2 dtype=float32

Validates the AppConfig once, prepares the model (GGUF -> checkpoint, cached),
checks that Tether serves its architecture, and binds the ModelReplica
deployment, with the conversation router, into the Ingress deployment.

A model that cannot be served fails here, in the `serve run` driver (or in
Serve's build task for a config file, where `serve status` shows it), before
anything is deployed. What only a replica can find (its node's copy of the
model, the weights) fails its constructor; after
`replica_max_constructor_retry_count` such failures Serve marks ModelReplica
DEPLOY_FAILED with the error, and the ingress's `/health` answers 503.
"""

import asyncio
import json
import logging
import os

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from cache_router.router import ConversationRouter
from core.app_config import AppConfig
from core.app_status import app_deleting
from core.heap import freeze_startup_heap
from core.priority import run_at_normal_priority
from model_files.architectures import check_model_dir
from model_files.prepare import prepare_model
from replicas.deployment import ModelReplica
from replicas.depot import StateDepot
from serve_app.backend import HandleBackend
from serve_app.front_door import FrontDoor
from serve_app.routes import OpenAIServer, make_api

logger = logging.getLogger("ray.serve")


@serve.ingress()
class Ingress:
    def __init__(self, config: dict, replicas):
        run_at_normal_priority("Ingress")
        app_config = AppConfig(**config)
        backend = HandleBackend(replicas, app_config.ingress.delta_channels)
        self.server = OpenAIServer.from_config(app_config, backend)
        self.api = make_api(self.server)
        ingress = app_config.ingress
        self.front_door = None
        if ingress.http_port is not None:  # the fast path: this replica answers HTTP itself
            self.front_door = FrontDoor(self.api, ingress.http_host, ingress.http_port, ingress.drain_timeout_s)
        freeze_startup_heap("Ingress")

    def __serve_build_asgi_app__(self):
        return self.api  # through Serve's proxy: the same app

    def check_health(self) -> None:
        if self.front_door is not None and not self.front_door.is_alive:
            raise RuntimeError("the Ingress's HTTP server stopped")

    async def __del__(self):
        """Serve's ingress wrapper awaits this when it removes the replica (an async __del__: a coroutine a
        sync one returned would be dropped there): the front door drains, after a successor listens on its
        port while the app stays deployed (a rolling update)."""
        if getattr(self, "front_door", None) is None:
            return
        stays = await app_deleting() is False  # outside Serve (None): nobody to wait for
        logger.info("Ingress leaving: %s", "waiting for a successor on the port" if stays else "closing")
        await asyncio.to_thread(self.front_door.close, stays)


def build_app(args: dict) -> serve.Application:
    """The builder `serve run` / `serve deploy` call: Serve requires exactly one parameter, the args."""
    return build_app_with(args)


def build_app_with(args: dict, request_router: RequestRouterConfig | None = None,
                   replica_class: type = ModelReplica) -> serve.Application:
    """`request_router` replaces the ConversationRouter (bench/serve_path/routing.py compares Ray's own routers);
    `replica_class` the ModelReplica (bench/serve_path/serve_path.py measures the path with a model-less one)."""
    config = AppConfig(**_parse_args(args))  # validated here, once, not on a replica
    engine = config.engine
    if os.path.exists(engine.model):
        engine = engine.model_copy(update={"model": os.path.abspath(engine.model)})
        config = config.model_copy(update={"engine": engine})
    # Converts once, with a progress bar; replicas prepare the same spec on their own node (cached).
    model_dir = str(prepare_model(engine.model))
    check_model_dir(model_dir)  # an unsupported architecture stops here, with the message the loader gives
    replica_options = dict(
        max_ongoing_requests=engine.max_num_seqs,
        max_queued_requests=config.replica_max_queued_requests,
        ray_actor_options={"num_cpus": config.replica_num_cpus, "resources": dict(config.replica_resources)},
        max_constructor_retry_count=config.replica_max_constructor_retry_count,
        # check_health only reads whether the step thread lives: every 2 s (Serve's default 10 s left a replica
        # whose engine had died taking its conversations' requests, each a 503, for ~34 s:
        # bench/reliability/drills.py).
        health_check_period_s=2,
        request_router_config=request_router or router_config(config),
        # A leaving replica drains its requests, then exports its conversations (replicas/depot.py); Serve
        # checks for the drain every wait loop, so a short loop starts the export soon after the last request.
        graceful_shutdown_timeout_s=config.migration.graceful_shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=0.25,
    )
    if config.num_replicas == "auto":
        replica_options["autoscaling_config"] = AutoscalingConfig(**config.autoscaling.model_dump())
    else:
        replica_options["num_replicas"] = config.num_replicas
    replicas = serve.deployment(replica_class, name="ModelReplica").options(**replica_options)
    # The proxy's queue for the ingress is bounded too (past it Serve answers 503), so nothing
    # waits without bound between the client and a replica. A leaving Ingress drains its own HTTP server
    # (the fast path) within drain_timeout_s: Serve waits that long, with margin, before killing it.
    ingress = serve.deployment(Ingress, name="Ingress").options(
        max_ongoing_requests=config.ingress.max_queued_requests + 8,
        max_queued_requests=config.ingress.max_queued_requests, ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=config.ingress.drain_timeout_s + 5, graceful_shutdown_wait_loop_s=0.25)
    depot = None
    if config.migration.enabled:
        migration = config.migration
        # Its bytes reserved as Ray `memory`: it only lands on a node with that much to spare.
        depot = serve.deployment(StateDepot, name="StateDepot").options(
            num_replicas=1, ray_actor_options={"num_cpus": 0, "memory": migration.depot_bytes or None,
                                               "resources": dict(migration.depot_resources)}
        ).bind(migration.depot_bytes, migration.depot_ttl_s)
    logger.info("Tether: %s as %r, %s replica(s)", model_dir, config.model_name(), config.num_replicas)
    return ingress.bind(config.model_dump(),
                        replicas.bind(engine.model_dump(), config.migration.model_dump(), depot))


def router_config(config: AppConfig) -> RequestRouterConfig:
    """The ConversationRouter with the app's thresholds; replicas report what they hold every period."""
    router = config.router
    return RequestRouterConfig(
        request_router_class=ConversationRouter,
        request_router_kwargs={"imbalance_threshold": router.imbalance_threshold, "max_wait_s": router.max_wait_s,
                               "min_prefix_blocks": router.min_prefix_blocks,
                               "block_size": config.engine.block_size,
                               # Own routing records outlive the report that will show them, with margin.
                               "knowledge_ttl_s": 4 * router.stats_period_s},
        request_routing_stats_period_s=router.stats_period_s,
        request_routing_stats_timeout_s=max(router.stats_period_s, 3.0))


def _parse_args(args: dict) -> dict:
    """The args of a YAML `args:` block (typed), or the command line's `key=value` strings, where a section's key
    is dotted (`engine.max_num_seqs=8`) or the whole section is JSON (`engine='{"max_num_seqs": 8}'`); a value
    that is a JSON list or object (`ingress.cors_allow_origins='["https://a.example"]'`) is parsed as one."""
    parsed: dict = {}
    for name, value in args.items():
        if isinstance(value, str) and value[:1] in "[{":
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{name}: a value starting with {value[0]!r} is read as JSON: {exc}") from None
        *sections, leaf = name.split(".")
        target = parsed
        for section in sections:
            target = target.setdefault(section, {})
            if not isinstance(target, dict):
                raise ValueError(f"{name}: {section} is given both as a value and as a section")
        if isinstance(target.get(leaf), dict) and isinstance(value, dict):
            value = {**value, **target[leaf]}  # `engine={...}` and `engine.x=...` together: merged
        target[leaf] = value
    if isinstance(parsed.get("num_replicas"), str) and parsed["num_replicas"] != "auto":
        parsed["num_replicas"] = int(parsed["num_replicas"])
    return parsed
