"""Engine fixtures: a real Engine on the tiny random-weight Llama, float32."""

import pytest

from core.engine_config import EngineConfig
from core.messages import GenerateRequest, SamplingParams
from replicas.engine.engine import Engine


@pytest.fixture(scope="module")
def make_engine(tiny_llama_dir):
    def make(**overrides) -> Engine:
        return Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", **overrides))
    return make


def greedy(request_id: str, prompt: list[int], max_tokens: int = 16, **kwargs) -> GenerateRequest:
    return GenerateRequest(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs))


def run_all(engine: Engine, requests: list[GenerateRequest]) -> dict[str, list[int]]:
    """Adds every request, steps until all finish; returns the generated ids of each."""
    outputs = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished():
        for delta in engine.step():
            outputs[delta.request_id] += delta.token_ids
    return outputs


def prompts(lengths, start: int = 200) -> list[list[int]]:
    return [[start + (7 * i + 3 * j) % 5000 for j in range(n)] for i, n in enumerate(lengths)]
