"""A hybrid (Qwen3.5-text) checkpoint served by the same routes. Over a 6-turn chat whose prompts stay
under 300 tokens (where block-aligned caching reports nothing), each turn from the second computes at
most its new ids + 2, usage agrees with the engine's counter, and the replies equal a cold run's; the same
with a template that rewrites earlier turns."""

import openai
import pytest

from testing.tiny_models import with_chat_template
from tests.http.test_multiturn import QWEN_STYLE_TEMPLATE, converse


@pytest.fixture(scope="module", params=["smollm2-template", "qwen-style-template"])
def servers(request, tiny_hybrid_dir, tmp_path_factory, start_server):
    """(with checkpoints, cold: checkpoints off) over the same tiny hybrid model and template."""
    model = tiny_hybrid_dir if request.param == "smollm2-template" \
        else with_chat_template(tiny_hybrid_dir, tmp_path_factory.mktemp("hybrid-qwen-style"), QWEN_STYLE_TEMPLATE)
    warm = start_server(own_replica=True, model=str(model))
    cold = start_server(own_replica=True, model=str(model), engine={"enable_state_checkpoints": False})
    return warm, cold


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_six_turns_cost_only_the_new_ids_plus_two(servers):
    warm, cold = servers
    turns = converse(client_of(warm), warm, "Hello hybrid! Name three rivers.", 6)
    cold_turns = converse(client_of(cold), cold, "Hello hybrid! Name three rivers.", 6)
    assert [t["text"] for t in turns] == [t["text"] for t in cold_turns]  # replies equal a cold run's
    assert all(t["prompt_tokens"] < 300 for t in turns)
    for prev, cur in zip(turns, turns[1:]):
        kept = prev["prompt"] + prev["completion"]
        assert cur["retention"] == "retained" and cur["prompt"][:len(kept)] == kept
        num_new = len(cur["prompt"]) - len(kept)
        assert cur["computed"] <= num_new + 2
        assert cur["cached"] == cur["prompt_tokens"] - cur["computed"]
    assert all(t["cached"] == 0 for t in cold_turns)  # without checkpoints a hybrid model reuses nothing


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
