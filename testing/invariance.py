"""What the batch-invariance test (tests/engine/test_batch_invariance.py) and its bench
(bench/engine/invariance.py) share: the prompts, and greedy decoding that returns each reply's tokens with the
logprob of each, so two runs can be compared bit for bit."""

import time

from core.messages import GenerateRequest, SamplingParams

PROMPTS = ["Tell me about the sea.", "Why is the sky blue? Explain it carefully to a child who asks.",
           "Write a poem about autumn.", "What is 17 times 23?",
           "List three uses of copper in modern electronics and industry.", "Describe Paris."]
# Seven other requests of other lengths, to share the six's steps.
OTHERS = ["Hi", "Explain photosynthesis in detail, step by step, with examples of plants and algae.",
          "Count to ten.", "What are the rules of chess? " * 3, "Name a color.",
          "Give me a recipe for bread with flour, water, salt.", "Ok"]

Reply = list[tuple[int, float]]  # (token id, its logprob) per generated token


def greedy_replies(engine, prompts: list[list[int]], tokens: int) -> list[Reply]:
    """Every prompt submitted at once, stepped to the end; each reply's (token, logprob) pairs, in prompt order."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=0)
    ids = [f"r{i}-{time.perf_counter_ns()}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(GenerateRequest(request_id, prompt, params))
    out: dict[str, Reply] = {request_id: [] for request_id in ids}
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id] += [(lp.token_id, lp.logprob) for lp in delta.logprobs or []]
    return [out[request_id] for request_id in ids]


def first_difference(a: Reply, b: Reply) -> int | None:
    """The first position where two replies differ (token or logprob bits), None where they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
