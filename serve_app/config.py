"""AppConfig: the one configuration of a Tether application, validated once in build_app, frozen.

Sections: the ingress, the router, and the replicas' EngineConfig. Deployment
options (replica counts, autoscaling, actor resources) are not here: they come
from the serve config YAML's `deployments:` section, as Ray Serve users expect.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from replicas.config import EngineConfig


class IngressConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    api_keys: list[str] = Field(default_factory=list, description="Bearer tokens accepted; empty: no auth.")
    max_queued_requests: int = Field(
        64, ge=1, description="Requests one ingress replica holds at once (waiting or streaming); "
                              "past it the ingress answers 429 with Retry-After.")
    retry_after_s: int = Field(1, ge=1, description="Retry-After of a 429 / 503.")
    expose_replica_header: bool = Field(True, description="Send `x-tether-replica` (the replica that served).")


class RouterConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    imbalance_threshold: int = Field(8, ge=1, description="Spill a conversation off its replica when that "
                                                          "replica's queue exceeds the shortest by more than this.")
    max_wait_s: float = Field(5.0, gt=0, description="Spill a request that waited this long for its replica.")
    num_route_blocks: int = Field(4, ge=1, description="Blocks of a token-id prompt that key its route.")


class AppConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field("default", description="'default' (SmolLM2-135M-Instruct), a .gguf file, or a checkpoint dir.")
    served_model_name: str | None = Field(None, description="The model's name in the API; default: from `model`.")
    num_replicas: int | Literal["auto"] = Field(1, description="ModelReplica count ('auto': autoscaling).")
    replica_num_cpus: float = Field(1.0, ge=0, description="CPUs each ModelReplica actor reserves.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="Weights' and KV's precision.")
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    engine: dict = Field(default_factory=dict, description="EngineConfig fields (block_size, kv_cache_bytes, ...).")

    def engine_config(self, model_dir: str) -> EngineConfig:
        return EngineConfig(**{"dtype": self.dtype, **self.engine, "model": model_dir})

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model == "default":
            return "SmolLM2-135M-Instruct"
        return self.model.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")
