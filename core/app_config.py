"""AppConfig: the one configuration of a Tether application, validated once in build_app, frozen.

Sections: the ingress, the router, and the replicas' EngineConfig. The replica
count and CPUs set here are the builder's defaults; a serve config YAML's
`deployments:` section overrides them, as Ray Serve users expect.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.engine_config import EngineConfig, MigrationConfig


class IngressConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    api_keys: list[str] = Field(
        default_factory=list, description="Bearer tokens accepted, in the config itself (it ends up wherever the "
                                          "config does: prefer api_keys_env or api_keys_file). With none of the "
                                          "three: no auth.")
    api_keys_env: str | None = Field(
        "TETHER_API_KEYS", description="An environment variable of the Ingress's process holding accepted keys, "
                                       "comma-separated (a Kubernetes Secret as env, k8s/rayservice.yaml); "
                                       "unset or empty: adds none. None: no variable is read.")
    api_keys_file: str | None = Field(
        None, description="A file of accepted keys, one per line (blank lines and #-comments skipped): a mounted "
                          "Secret. Read when the Ingress starts; a missing file fails the start.")
    cors_allow_origins: list[str] = Field(
        default_factory=list, description="Origins a browser may call the API from ('*': any); empty: no CORS "
                                          "headers (same-origin only).")
    cors_allow_methods: list[str] = Field(["GET", "POST"], description="Methods allowed cross-origin.")
    cors_allow_headers: list[str] = Field(["Authorization", "Content-Type"],
                                          description="Request headers allowed cross-origin.")
    cors_allow_credentials: bool = Field(False, description="Allow cookies / HTTP auth cross-origin (never with "
                                                            "origin '*').")
    http_port: int | None = Field(
        None, ge=1, le=65535, description="The fast path: each Ingress replica serves HTTP itself on this port "
                                          "(SO_REUSEPORT: replicas on one node share it), with no Serve proxy "
                                          "hop (serve_app/front_door.py). None: only through Serve's proxy.")
    http_host: str = Field("127.0.0.1", description="The address the Ingress's own HTTP server binds "
                                                     "(with http_port); 0.0.0.0 in a pod.")
    delta_channels: bool = Field(
        True, description="Deltas come back from each replica over one socket per ingress event loop, one "
                          "frame per engine step for all its streams (replicas/delta_channel.py); off: each "
                          "delta is its own item on the request's Serve handle call.")
    drain_timeout_s: float = Field(
        30.0, gt=0, description="A leaving Ingress replica (rolling update, scale-in) stops accepting, then "
                                "lets its requests in flight finish for at most this long.")
    max_queued_requests: int = Field(
        64, ge=1, description="Requests one ingress replica holds at once (waiting or streaming); "
                              "past it the ingress answers 429 with Retry-After.")
    retry_after_s: int = Field(1, ge=1, description="Retry-After of a 429 / 503.")
    expose_replica_header: bool = Field(True, description="Send `x-tether-replica` (the replica(s) that served).")
    max_n: int = Field(16, ge=1, le=128, description="Most choices one request may ask for (`n`).")
    health_timeout_s: float = Field(
        2.0, gt=0, description="How long `GET /health` waits for a ModelReplica to answer before it says 503.")
    tool_parser: Literal["auto", "hermes", "qwen3_xml"] = Field(
        "auto", description="How tool calls are read from chat replies (serve_app/tools/): 'hermes' "
                            "(<tool_call> + JSON: Qwen2.5, Qwen3, Hermes), 'qwen3_xml' (<tool_call><function=..>: "
                            "Qwen3.5, Qwen3-Coder); 'auto' picks by the chat template ('<function=' -> qwen3_xml, "
                            "else hermes; a template without tool support gets a Hermes tool prompt).")
    reasoning_parser: Literal["auto", "think", "none"] = Field(
        "auto", description="Split chat replies into reasoning_content and content at <think>…</think> "
                            "(serve_app/reasoning.py): 'auto' when the chat template writes <think>, 'think' "
                            "always, 'none' never.")
    allow_image_urls: bool = Field(
        False, description="Fetch `image_url` parts given as http(s) URLs (serve_app/images.py); off: only "
                           "base64 `data:` URIs are accepted. On, the ingress fetches any URL a client names.")
    max_image_bytes: int = Field(
        20 * 1024 * 1024, ge=1, description="Most encoded bytes one image may have (decoded from base64 or "
                                            "fetched; a fetch stops reading past it).")
    max_image_pixels: int = Field(
        50_000_000, ge=1, description="Most pixels (width x height) one image may decode to, checked from its "
                                      "header before decoding; past it: 400. Images over the model's own "
                                      "size are resized by the replica.")
    max_images_per_request: int = Field(16, ge=0, description="Most images one chat request may carry.")
    image_fetch_timeout_s: float = Field(10.0, gt=0, description="How long fetching one image URL may take.")
    # Limits on hostile or runaway input (docs/reliability.md, "Limits"); past one: a 4xx naming the field.
    max_body_bytes: int = Field(
        32 * 1024 * 1024, ge=1024, description="Most bytes of one request body, counted as they arrive (chunked "
                                               "bodies too); past it: 413. Fits one image of max_image_bytes "
                                               "as a base64 data URI (4/3 of its bytes) and the JSON around it.")
    max_messages: int = Field(4096, ge=1, description="Most messages one chat request may carry.")
    max_content_parts: int = Field(128, ge=1, description="Most content parts one chat message may carry.")
    max_stop_strings: int = Field(16, ge=0, description="Most stop strings one request may give (`stop`).")
    max_stop_string_chars: int = Field(
        1024, ge=1, description="Longest stop string, in characters (streamed text holds back one fewer).")
    max_logit_bias: int = Field(1024, ge=0, description="Most `logit_bias` entries one request may give.")
    max_generated_tokens_per_request: int | None = Field(
        None, ge=1, description="Most tokens one request may generate over all its choices: n x max_tokens "
                                "(n x what the context leaves the prompt when max_tokens is unset); past it: "
                                "400 naming max_tokens. None: each choice is bounded by the context only.")
    max_buffered_tokens: int = Field(
        4096, ge=1, description="Streaming: most generated tokens one response may hold at the ingress while its "
                                "client is not reading (over all its choices); past it the replica calls are "
                                "aborted and the stream is cut.")
    stream_send_timeout_s: float = Field(
        60.0, gt=0, description="Streaming: how long one write to a client that is not reading may wait before "
                                "the connection is closed and the request aborted.")

    @model_validator(mode="after")
    def _cors_credentials_need_origins(self):
        if self.cors_allow_credentials and "*" in self.cors_allow_origins:
            raise ValueError("cors_allow_credentials cannot be used with cors_allow_origins ['*']: name the origins")
        return self


class RouterConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    imbalance_threshold: int = Field(8, ge=0, description="Spill a conversation off its replica when that "
                                                          "replica's queue exceeds the shortest by more than this.")
    max_wait_s: float = Field(5.0, gt=0, description="Spill a request that waited this long for its replica.")
    num_route_blocks: int = Field(4, ge=1, description="Blocks of a token-id prompt that key its route.")
    min_prefix_blocks: int = Field(4, ge=0, description="Blocks a replica's longer cached prefix must save over "
                                                        "the conversation's rendezvous owner to win the request.")
    stats_period_s: float = Field(2.0, gt=0, description="How often replicas report what they hold to the routers "
                                                         "(Serve's request_routing_stats_period_s).")


class AutoscalingOptions(BaseModel):
    """Serve's replica autoscaling for `num_replicas: auto` (ray.serve.config.AutoscalingConfig): Serve adds a
    ModelReplica when the ongoing requests per replica, averaged over `look_back_period_s`, stay above the target
    for `upscale_delay_s`, and removes one when below for `downscale_delay_s`. A replica added takes new
    conversations (rendezvous hashing moves ~1/N of new keys to it; the router keeps each live conversation
    where it is cached); a replica removed exports its conversations to the StateDepot on the way out."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_replicas: int = Field(1, ge=0, description="Fewest ModelReplicas.")
    max_replicas: int = Field(4, ge=1, description="Most ModelReplicas (the cluster must have room for them, or "
                                                   "Ray's autoscaler must add nodes).")
    initial_replicas: int | None = Field(None, ge=0, description="Replicas at deploy time; None: min_replicas.")
    target_ongoing_requests: float = Field(
        8.0, gt=0, description="Ongoing requests per replica Serve aims for (a replica runs up to "
                               "engine.max_num_seqs at once; each choice of an n > 1 request counts).")
    upscale_delay_s: float = Field(30.0, ge=0, description="How long the load must stay above target to add.")
    downscale_delay_s: float = Field(600.0, ge=0, description="How long it must stay below target to remove.")
    look_back_period_s: float = Field(30.0, gt=0, description="The window the load is averaged over.")
    metrics_interval_s: float = Field(10.0, gt=0, description="How often replicas and handles report their load "
                                                              "(shorter than look_back_period_s).")

    @model_validator(mode="after")
    def _ordered(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling.min_replicas must be at most max_replicas")
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError("autoscaling.look_back_period_s must be longer than metrics_interval_s")
        return self


class AppConfig(BaseModel):
    """`model` and `dtype` are accepted at the top level (the command line's `model=... dtype=...`)
    and live in the engine section."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    served_model_name: str | None = Field(None, description="The model's name in the API; default: from the model.")
    num_replicas: int | Literal["auto"] = Field(1, description="ModelReplica count ('auto': autoscaling).")
    autoscaling: AutoscalingOptions = Field(default_factory=AutoscalingOptions,
                                            description="Serve's autoscaling, used with num_replicas 'auto'.")
    replica_num_cpus: float = Field(1.0, ge=0, description="CPUs each ModelReplica actor reserves.")
    replica_resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources each ModelReplica reserves (nodes started with "
                                          "`--resources`), to keep replicas on the nodes meant for them.")
    replica_max_queued_requests: int = Field(
        32, ge=1, description="Requests each caller may queue for busy replicas; past it: 503 with Retry-After.")
    replica_max_constructor_retry_count: int = Field(
        2, ge=1, description="ModelReplica start-up failures (all replicas together, before any has started) "
                             "after which Serve stops retrying and marks the deployment DEPLOY_FAILED with the "
                             "error; Serve takes min(this, 3 x replicas). Start-up errors are mostly "
                             "configuration (a model Tether cannot load): retrying them only hides them.")
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    migration: MigrationConfig = Field(default_factory=MigrationConfig)

    @model_validator(mode="before")
    @classmethod
    def _model_and_dtype_into_engine(cls, data):
        if isinstance(data, dict) and ("model" in data or "dtype" in data):
            data = dict(data)
            engine = dict(data.get("engine") or {})
            for name in ("model", "dtype"):
                if name in data:
                    if name in engine:
                        raise ValueError(f"{name} is given twice: at the top level and in engine")
                    engine[name] = data.pop(name)
            data["engine"] = engine
        return data

    @property
    def model(self) -> str:
        return self.engine.model

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model == "default":
            return "SmolLM2-135M-Instruct"
        return self.model.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")
