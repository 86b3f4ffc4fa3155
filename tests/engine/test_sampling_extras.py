"""Sampling extras through the real engine on the tiny Llama: logit_bias, min_tokens, the penalties against a
hand-applied reference on transformers' logits, seeded sampling with every processor alone and in a batch,
logprobs and prompt_logprobs against transformers' log_softmax, the detokenization options and the
reasoning count."""

import pytest
import torch

from core.messages import GenerateDelta, GenerateRequest, RequestError, SamplingParams
from tests.engine.conftest import greedy, prompts, run_all

PROMPT = prompts([12])[0]


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def free_run(engine) -> list[int]:
    return run_all(engine, [greedy("free", PROMPT, 12)])["free"]


def ref_logits(reference, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return reference(torch.tensor([token_ids])).logits[0].float()  # [T, vocab]


def deltas_of(engine, request: GenerateRequest) -> list[GenerateDelta]:
    engine.add_request(request)
    out = []
    while engine.has_unfinished():
        out += [d for d in engine.step() if d.request_id == request.request_id]
    return out


def ids_of(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def test_logit_bias_forces_a_token(engine, free_run):
    forced = 4242
    assert forced not in free_run
    out = run_all(engine, [greedy("b", PROMPT, 6, logit_bias={forced: 100.0})])["b"]
    assert out == [forced] * 6


def test_logit_bias_outside_the_vocabulary_is_refused(engine):
    with pytest.raises(RequestError) as err:
        engine.add_request(greedy("v", PROMPT, 4, logit_bias={engine.model_config.vocab_size: 1.0}))
    assert err.value.param == "logit_bias" and not engine.has_unfinished()


def test_min_tokens_holds_back_a_stop_token_id(engine, free_run):
    stop_id = free_run[1]
    assert run_all(engine, [greedy("s", PROMPT, 12, stop_token_ids=[stop_id])])["s"] == free_run[:2]
    held = deltas_of(engine, greedy("m", PROMPT, 12, stop_token_ids=[stop_id], min_tokens=5))
    out = ids_of(held)
    assert len(out) >= 5 and stop_id not in out[:5]
    exact = deltas_of(engine, greedy("e", PROMPT, 6, stop_token_ids=[stop_id], min_tokens=6))
    assert len(ids_of(exact)) == 6 and exact[-1].finish_reason == "length"


def test_max_tokens_one_is_one_token_and_one_forward(make_engine):
    engine = make_engine()
    deltas = deltas_of(engine, greedy("one", PROMPT, 1, min_tokens=1, presence_penalty=1.0))
    assert len(ids_of(deltas)) == 1 and deltas[-1].finish_reason == "length"
    assert engine.stats.num_steps == 1


def hand_processed(logits: torch.Tensor, history: list[int], output: list[int], rep: float, presence: float,
                   frequency: float, bias: dict[int, float]) -> torch.Tensor:
    x = logits.clone()
    for t in set(history):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in set(output):
        x[t] -= presence + frequency * output.count(t)
    for t, b in bias.items():
        x[t] += b
    return x


# The tiny model never repeats itself in 12 greedy tokens; a bias that makes one token win again and again
# gives the penalties something to push against (and checks they come before the bias).
BIAS = {4242: 6.0}


@pytest.mark.parametrize("penalties", [(1.5, 0.0, 0.0), (1.0, 1.5, 0.0), (1.0, 0.0, 0.8), (1.3, 0.5, 0.5)],
                         ids=["repetition", "presence", "frequency", "all-three"])
def test_penalties_match_a_hand_applied_reference(engine, reference, penalties):
    rep, presence, frequency = penalties
    plain = run_all(engine, [greedy("plain", PROMPT, 12, logit_bias=BIAS)])["plain"]
    got = run_all(engine, [greedy("p", PROMPT, 12, repetition_penalty=rep, presence_penalty=presence,
                                  frequency_penalty=frequency, logit_bias=BIAS)])["p"]
    expected: list[int] = []
    for _ in range(12):
        logits = ref_logits(reference, PROMPT + expected)[-1]
        x = hand_processed(logits, PROMPT + expected, expected, rep, presence, frequency, BIAS)
        expected.append(x.argmax().item())
    assert got == expected
    assert got != plain


def test_seeded_sampling_with_every_processor_does_not_depend_on_the_batch(engine, free_run):
    def sampled(rid, prompt, seed=5):
        return GenerateRequest(rid, prompt, SamplingParams(
            temperature=0.8, top_p=0.95, top_k=40, seed=seed, max_tokens=16, repetition_penalty=1.2,
            presence_penalty=0.3, frequency_penalty=0.2, logit_bias={free_run[0]: -5.0, 4242: 2.0}, min_tokens=4,
            min_p=0.02, logprobs=2))
    alone = run_all(engine, [sampled("x", PROMPT)])["x"]
    ps = prompts([20, 35, 8, 50, 3, 17, 26, 9], start=900)
    others = [sampled(f"o{i}", p, seed=i) if i % 2 else greedy(f"o{i}", p, 16) for i, p in enumerate(ps)]
    together = run_all(engine, others[:4] + [sampled("x", PROMPT)] + others[4:])
    assert together["x"] == alone


def test_logprobs_match_transformers_and_the_returned_tokens(engine, reference, free_run):
    deltas = deltas_of(engine, greedy("l", PROMPT, 8, logprobs=3))
    ids = ids_of(deltas)
    entries = [e for d in deltas for e in d.logprobs]
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)  # one per token, in its own delta
    assert [e.token_id for e in entries] == ids == free_run[:8]
    expected = torch.log_softmax(ref_logits(reference, PROMPT + ids)[len(PROMPT) - 1:-1], dim=-1)  # [8, vocab]
    for i, e in enumerate(entries):
        assert e.token == engine.tokenizer.decode([e.token_id], skip_special_tokens=False)
        assert abs(e.logprob - expected[i, e.token_id].item()) <= 1e-4
        top_values, top_ids = expected[i].topk(3)
        assert [t for t, _, _ in e.top] == top_ids.tolist()
        assert max(abs(lp - v) for (_, _, lp), v in zip(e.top, top_values.tolist())) <= 1e-4
        assert e.top[0][0] == e.token_id  # greedy: the chosen token is the most likely


def test_no_logprob_for_the_stop_token_or_text_a_stop_string_cut(engine, free_run):
    stopped = deltas_of(engine, greedy("t", PROMPT, 12, logprobs=0, stop_token_ids=[free_run[3]]))
    assert ids_of(stopped) == free_run[:4]
    assert [e.token_id for d in stopped for e in d.logprobs] == free_run[:3]
    assert all(e.top == [] for d in stopped for e in d.logprobs)
    # include_stop_str_in_output keeps a stop token id's text too (vLLM), and so its entry.
    kept_id = deltas_of(engine, greedy("i", PROMPT, 12, logprobs=0, stop_token_ids=[free_run[3]],
                                       include_stop_str_in_output=True))
    assert [e.token_id for d in kept_id for e in d.logprobs] == free_run[:4]
    assert "".join(d.text for d in kept_id) == engine.tokenizer.decode(free_run[:4])
    text = engine.tokenizer.decode(free_run)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = deltas_of(engine, greedy("c", PROMPT, 12, logprobs=0, stop=[stop]))
    returned = "".join(d.text for d in cut)
    assert returned == text[:text.find(stop)]
    tokens = [e.token for d in cut for e in d.logprobs]
    # Exactly the tokens with text before the cut: all of them reach into it, the last may straddle it.
    assert "".join(tokens).startswith(returned) and len("".join(tokens[:-1])) < len(returned)
    kept = deltas_of(engine, greedy("k", PROMPT, 12, stop=[stop], include_stop_str_in_output=True))
    assert "".join(d.text for d in kept) == text[:text.find(stop) + len(stop)]


def test_prompt_logprobs_match_transformers_and_bypass_the_cache(make_engine, reference):
    prompt = prompts([40], start=3000)[0]
    expected = torch.log_softmax(ref_logits(reference, prompt), dim=-1)  # [40, vocab]
    for budget in (512, 16):  # whole prefill, then 3 chunks
        engine = make_engine(block_size=4, max_num_batched_tokens=budget, max_num_seqs=8)
        run_all(engine, [greedy("warm", prompt, 2)])
        request = greedy("pl", prompt, 2, prompt_logprobs=2)
        request.retention = "first turn"
        first = deltas_of(engine, request)[0]
        assert first.num_cached_tokens == 0
        assert first.retention == "off: prompt_logprobs needs every prompt position"
        entries = first.prompt_logprobs
        assert entries[0] is None and len(entries) == len(prompt)
        for i, e in enumerate(entries[1:], start=1):
            assert e.token_id == prompt[i]
            assert abs(e.logprob - expected[i - 1, prompt[i]].item()) <= 1e-4
            assert [t for t, _, _ in e.top] == expected[i - 1].topk(2).indices.tolist()
        again = deltas_of(engine, greedy("hit", prompt, 2))[0]
        assert again.num_cached_tokens == 36 and again.prompt_logprobs is None


def test_prompt_logprobs_survive_chunking_and_preemption(make_engine):
    lengths = [3, 17, 40, 64, 5, 33, 90, 12]

    def run(engine) -> dict[str, GenerateDelta]:
        requests = [greedy(f"r{i}", p, 24, prompt_logprobs=1) for i, p in enumerate(prompts(lengths))]
        firsts = {}
        for r in requests:
            engine.add_request(r)
        while engine.has_unfinished():
            for delta in engine.step():
                firsts.setdefault(delta.request_id, delta)
        return firsts

    roomy = run(make_engine())
    tight_engine = make_engine(num_kv_blocks=40, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
    tight = run(tight_engine)
    assert tight_engine.scheduler.num_preemptions > 0
    for rid, delta in roomy.items():
        got = tight[rid].prompt_logprobs
        assert len(got) == len(delta.prompt_logprobs) == delta.num_prompt_tokens
        assert [e.token_id for e in got[1:]] == [e.token_id for e in delta.prompt_logprobs[1:]]
        assert max((abs(a.logprob - b.logprob) for a, b in zip(got[1:], delta.prompt_logprobs[1:])), default=0) <= 1e-4


def test_skip_special_tokens_per_request(engine):
    im_start = 1  # <|im_start|>: special, not an EOS
    def forced(rid, skip):
        return greedy(rid, PROMPT, 3, logit_bias={im_start: 100.0}, skip_special_tokens=skip)
    assert "".join(d.text for d in deltas_of(engine, forced("s", True))) == ""
    assert "".join(d.text for d in deltas_of(engine, forced("k", False))) == "<|im_start|>" * 3


def test_num_reasoning_tokens_counts_up_to_the_end_tag(make_engine, free_run):
    engine = make_engine()
    assert engine.reasoning_end_id is None  # SmolLM2 has no </think> token
    assert [d.num_reasoning_tokens for d in deltas_of(engine, greedy("a", PROMPT, 5))] == [0] * 5
    engine.reasoning_end_id = free_run[2]  # as if the third token were </think>
    counts = [d.num_reasoning_tokens for d in deltas_of(engine, greedy("b", PROMPT, 5))]
    assert counts == [0, 0, 3, 3, 3]


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
