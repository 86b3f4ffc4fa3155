"""Ingress metrics: Prometheus text at `GET /metrics`, one private registry per server.

Each `IngressMetrics` owns its own `CollectorRegistry`, so several servers in one
process (tests, LocalServer beside a Serve app) never share or collide on counts.
`install_metrics(app, metrics)` adds the route and a pure ASGI middleware that
counts every response, 4xx and 5xx included, when its status line is sent: the
body is never buffered, so SSE streams pass through untouched.

Inside Ray (the Serve Ingress) every count also goes to Ray's metrics path (`RayIngressMetrics`), under the
same names with Ray's `ray_` prefix (counters `_total`), so one scrape of a node's Ray metrics port sees the
ingress, the replicas (replicas/metrics.py) and the routers (cache_router/metrics.py); docs/metrics.md lists
them all.
"""

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["IngressMetrics", "install_metrics", "METRICS_PATH"]
METRICS_PATH = "/metrics"

# CPU-scale: a tiny model's first token can take 10 ms, a long prefill on 2 cores tens of seconds.
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS_S = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class IngressMetrics:
    """The ingress's counters. Contract: every method is cheap, synchronous and never raises on valid input.

    `requests_in_flight` is owned by the middleware `install_metrics` adds (from request arrival to the
    end of the response body, streaming included); call `in_flight_inc` / `in_flight_dec` yourself only
    on an app without it.
    """

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("tether_requests", "HTTP responses by route template and status code.",
                                ("route", "status"), registry=r)
        self.prompt_tokens = Counter("tether_prompt_tokens", "Prompt tokens of finished generations.", registry=r)
        self.completion_tokens = Counter("tether_completion_tokens", "Generated tokens of finished generations.",
                                         registry=r)
        self.time_to_first_token = Histogram("tether_time_to_first_token_seconds",
                                             "Seconds from request arrival to the first generated token.",
                                             buckets=TTFT_BUCKETS_S, registry=r)
        self.inter_token_latency = Histogram("tether_inter_token_latency_seconds",
                                             "Seconds between consecutive token deltas of one generation.",
                                             buckets=ITL_BUCKETS_S, registry=r)
        self.in_flight = Gauge("tether_requests_in_flight", "HTTP requests received and not yet fully answered.",
                               registry=r)
        self.ray = RayIngressMetrics() if ray_is_running() else None

    def request_done(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()
        if self.ray:
            self.ray.requests.inc(1, tags={"route": route, "status": str(status)})

    def tokens(self, prompt: int, completion: int) -> None:
        if prompt > 0:
            self.prompt_tokens.inc(prompt)
            if self.ray:
                self.ray.prompt_tokens.inc(prompt)
        if completion > 0:
            self.completion_tokens.inc(completion)
            if self.ray:
                self.ray.completion_tokens.inc(completion)

    def first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)
        if self.ray:
            self.ray.time_to_first_token.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)
        if self.ray:
            self.ray.inter_token_latency.observe(seconds)

    def in_flight_inc(self) -> None:
        self.in_flight.inc()
        if self.ray:
            self.ray.add_in_flight(1)

    def in_flight_dec(self) -> None:
        self.in_flight.dec()
        if self.ray:
            self.ray.add_in_flight(-1)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition of this registry only."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def ray_is_running() -> bool:
    import ray

    return ray.is_initialized()


def serve_application() -> str:
    """The Serve application this process serves ("" outside a Serve replica)."""
    try:
        from ray import serve

        return serve.get_replica_context().app_name
    except Exception:  # a driver, LocalServer beside Ray
        return ""


class RayIngressMetrics:
    """The same counts through `ray.util.metrics` (a Ray worker or driver only), tagged like the registry's and
    with the Serve application's name (`application`), so apps sharing a cluster stay apart."""

    def __init__(self):
        from ray.util.metrics import Counter, Gauge, Histogram

        app = {"application": serve_application()}
        keys = ("application",)
        self.requests = Counter("tether_requests", "HTTP responses by route template and status code.",
                                tag_keys=("route", "status", *keys)).set_default_tags(app)
        self.prompt_tokens = Counter("tether_prompt_tokens", "Prompt tokens of finished generations.",
                                     tag_keys=keys).set_default_tags(app)
        self.completion_tokens = Counter("tether_completion_tokens", "Generated tokens of finished generations.",
                                         tag_keys=keys).set_default_tags(app)
        self.time_to_first_token = Histogram("tether_time_to_first_token_seconds",
                                             "Seconds from request arrival to the first generated token.",
                                             boundaries=list(TTFT_BUCKETS_S), tag_keys=keys).set_default_tags(app)
        self.inter_token_latency = Histogram("tether_inter_token_latency_seconds",
                                             "Seconds between consecutive token deltas of one generation.",
                                             boundaries=list(ITL_BUCKETS_S), tag_keys=keys).set_default_tags(app)
        self.in_flight = Gauge("tether_requests_in_flight", "HTTP requests received and not yet fully answered.",
                               tag_keys=keys).set_default_tags(app)
        self.num_in_flight = 0

    def add_in_flight(self, change: int) -> None:
        self.num_in_flight += change
        self.in_flight.set(self.num_in_flight)


class TokenTimer:
    """Times one generation's deltas: the first `tick` observes time to first token, later ones the gap.

        timer = TokenTimer(metrics)          # at request arrival
        for delta in deltas: timer.tick()    # per delta that carries tokens
    """

    def __init__(self, metrics: IngressMetrics, start: float | None = None):
        self.metrics = metrics
        self.last = time.perf_counter() if start is None else start
        self.has_first = False

    def tick(self) -> None:
        now = time.perf_counter()
        if self.has_first:
            self.metrics.inter_token(now - self.last)
        else:
            self.metrics.first_token(now - self.last)
            self.has_first = True
        self.last = now


class MetricsMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware): it wraps `send` and never touches the body.

    The route label is the matched template (`scope["route"].path`, set by the router on this same
    scope dict), else "<unmatched>" (404s). An exception that escapes the app before a status was sent
    is counted as 500 and re-raised, since FastAPI's `Exception` handler sits outside user middleware.
    """

    def __init__(self, app, metrics: IngressMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == METRICS_PATH:
            await self.app(scope, receive, send)
            return
        counted = False

        async def send_counting(message):
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self.metrics.request_done(route_label(scope), message["status"])
            await send(message)

        self.metrics.in_flight_inc()
        try:
            await self.app(scope, receive, send_counting)
        except Exception:
            if not counted:
                counted = True
                self.metrics.request_done(route_label(scope), 500)
            raise
        finally:
            self.metrics.in_flight_dec()


def route_label(scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "<unmatched>"  # a fixed label: scanners can't grow series


def install_metrics(app, metrics: IngressMetrics) -> None:
    """Adds `GET /metrics` and the counting middleware to a FastAPI app (before it starts serving)."""
    from fastapi import Response

    @app.get(METRICS_PATH, include_in_schema=False)
    async def _metrics():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    app.add_middleware(MetricsMiddleware, metrics=metrics)
