"""Our Qwen3.5 forward (paged KV + linear-state slots, flattened varlen steps) vs transformers' Qwen3_5ForCausalLM
on a tiny random-weight hybrid checkpoint: float32 logits within 1e-4 at every position.

transformers runs each whole sequence once; ours runs it the engine's way: packed with other sequences, in
prefill chunks and decode rows, decode and prefill in one forward, state carried in slots between steps.
"""

import pytest
import torch

from core.messages import SamplingParams
from replicas.engine.model_runner import ModelRunner
from replicas.engine.scheduler import ScheduledRequest
from replicas.models.gated_deltanet import allocate_linear_states, make_linear_state_batch, use_native_recurrent
from replicas.models.qwen3_5 import Qwen3_5ForCausalLM
from replicas.request.request import Request

TOL = 1e-4
BLOCK, NUM_BLOCKS, NUM_SLOTS = 4, 96, 6


@pytest.fixture(scope="module")
def tiny_qwen3_5_dir(smollm2_dir, tmp_path_factory):
    from testing.tiny_hybrid import make_tiny_qwen3_5

    return make_tiny_qwen3_5(tmp_path_factory.mktemp("tiny-qwen3_5"), smollm2_dir)


@pytest.fixture(scope="module", params=["pytorch", "native"])
def models(tiny_qwen3_5_dir, request):
    """(ours, transformers'), both float32. Ours is loaded as replicas/models/loader.py loads: on the meta
    device, then name for name from the safetensors; its recurrent layers on their PyTorch path or on the native
    ops (replicas/kernels/gated_delta_rule/cpu_native.py)."""
    from transformers import Qwen3_5ForCausalLM as Reference

    from replicas.models.loader import _init_buffers, _load_weights, load_config

    config = load_config(tiny_qwen3_5_dir)
    with torch.device("meta"):
        ours = Qwen3_5ForCausalLM(config)
    ours = ours.to_empty(device="cpu")
    ours.tie_weights()
    _load_weights(ours, tiny_qwen3_5_dir)
    _init_buffers(ours, config, torch.device("cpu"))
    if request.param == "native" and use_native_recurrent(ours) == 0:
        pytest.skip("the native gated delta ops did not build")
    ref = Reference.from_pretrained(str(tiny_qwen3_5_dir), dtype=torch.float32).eval()
    return ours.eval(), ref


def reference_logits(ref, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return ref(torch.tensor([token_ids])).logits[0].float()  # [L, vocab]


def sequence(seed: int, length: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


class Harness:
    """The engine's part in miniature: scattered KV blocks per request, one state slot per request, a step =
    one ForwardBatch (ModelRunner.prepare) + one LinearStateBatch. Slots start with garbage: a sequence's
    first step must ignore it (has_initial_state False)."""

    def __init__(self, model: Qwen3_5ForCausalLM):
        config = model.config
        self.model = model
        shape = (NUM_BLOCKS, BLOCK, config.num_key_value_heads, config.head_dim)
        self.kv_caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in model.full_attention_layers]
        self.states = allocate_linear_states(config, NUM_SLOTS, torch.float32, torch.device("cpu"))
        for layer in self.states:
            layer.conv_state.normal_()
            layer.recurrent_state.normal_()
        self.runner = ModelRunner(model, self.kv_caches, BLOCK, torch.device("cpu"))
        self.free_blocks = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0)).tolist()
        self.slots: dict[str, int] = {}

    def add(self, request_id: str, token_ids: list[int], slot: int, block_table: list[int] | None = None) -> Request:
        req = Request(request_id, token_ids, SamplingParams(), 1, frozenset())
        req.block_table = list(block_table or [])
        req.block_table += [self.free_blocks.pop() for _ in range(-(-len(token_ids) // BLOCK) - len(req.block_table))]
        self.slots[request_id] = slot
        return req

    def step(self, work: list[tuple[Request, int]]) -> list[torch.Tensor]:
        """Runs one forward over (request, num_tokens) items; -> each item's logits [num_tokens, vocab]."""
        scheduled = [ScheduledRequest(req, n) for req, n in work]
        batch = self.runner.prepare(scheduled)
        slots = torch.tensor([self.slots[req.request_id] for req, _ in work], dtype=torch.int64)
        has_initial_state = torch.tensor([req.num_computed_tokens > 0 for req, _ in work])
        linear_state = make_linear_state_batch(self.states, batch.cu_seqlens, slots, has_initial_state)
        with torch.inference_mode():
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch, linear_state)
            logits = self.model.compute_logits(hidden)  # [T, vocab]
        bounds = batch.cu_seqlens.tolist()
        for req, n in work:
            req.num_computed_tokens += n
        return [logits[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def test_module_names_are_the_checkpoint_names(models, tiny_qwen3_5_dir):
    from safetensors.torch import load_file

    from replicas.models.loader import checkpoint_names

    ours, _ = models
    saved = set(load_file(str(tiny_qwen3_5_dir / "model.safetensors")))
    assert checkpoint_names(ours) == saved  # merged projections (gate/up) count as their parts


def test_prefill_one_sequence(models):
    ours, ref = models
    token_ids = sequence(0, 70, ours.config.vocab_size)  # past one 64-token chunk, not a block multiple
    expected = reference_logits(ref, token_ids)
    harness = Harness(ours)
    [got] = harness.step([(harness.add("a", token_ids, slot=2), 70)])
    assert max_diff(expected, got) <= TOL
    # Without a linear state every sequence starts from zeros: the same logits.
    batch = harness.runner.prepare([ScheduledRequest(harness.add("b", token_ids, slot=3), 70)])
    with torch.inference_mode():
        stateless = ours.compute_logits(ours(batch.input_ids, batch.positions, harness.kv_caches, batch))
    assert max_diff(expected, stateless) <= TOL


def test_packed_batch_of_prompts(models):
    ours, ref = models
    lengths = [5, 1, 70, 37]  # a one-token prompt runs as a decode row with no initial state
    prompts = [sequence(10 + i, n, ours.config.vocab_size) for i, n in enumerate(lengths)]
    harness = Harness(ours)
    requests = [harness.add(f"p{i}", ids, slot=slot) for i, (ids, slot) in enumerate(zip(prompts, [4, 0, 5, 1]))]
    outputs = harness.step([(req, len(ids)) for req, ids in zip(requests, prompts)])
    for i, (ids, got) in enumerate(zip(prompts, outputs)):
        assert max_diff(reference_logits(ref, ids), got) <= TOL, f"prompt {i}"


def test_chunked_prefill_then_decode_mixed_with_prefill(models):
    ours, ref = models
    vocab = ours.config.vocab_size
    a_ids, b_ids = sequence(20, 45, vocab), sequence(21, 30, vocab)
    a_ref, b_ref = reference_logits(ref, a_ids), reference_logits(ref, b_ids)
    harness = Harness(ours)
    a, b = harness.add("a", a_ids, slot=3), harness.add("b", b_ids, slot=1)
    [got] = harness.step([(a, 23)])  # prefill chunk 1
    assert max_diff(a_ref[:23], got) <= TOL
    [got] = harness.step([(a, 17)])  # prefill chunk 2, from the slot's state and the cached KV
    assert max_diff(a_ref[23:40], got) <= TOL
    b_chunks = [7, 7, 7, 9]
    for i in range(5):  # a decodes, b prefills beside it in the same forward
        pos = a.num_computed_tokens
        work = [(a, 1)] + ([(b, b_chunks[i])] if i < len(b_chunks) else [])
        b_start = b.num_computed_tokens
        outputs = harness.step(work)
        assert max_diff(a_ref[pos:pos + 1], outputs[0]) <= TOL, f"a decode {i}"
        if i < len(b_chunks):
            assert max_diff(b_ref[b_start:b_start + b_chunks[i]], outputs[1]) <= TOL, f"b chunk {i}"
    assert a.num_computed_tokens == 45 and b.num_computed_tokens == 30


def test_checkpoint_copy_forks_exactly(models):
    """What a recurrent checkpoint is: both state tensors of every linear layer at the slot, plus the partial
    last KV block (full blocks are shared). A fork restored from it continues exactly."""
    ours, ref = models
    vocab = ours.config.vocab_size
    prefix = sequence(30, 38, vocab)  # 38 = 9 full blocks + 2 tokens
    a_ids, c_ids = prefix + sequence(31, 4, vocab), prefix + sequence(32, 4, vocab)
    harness = Harness(ours)
    a = harness.add("a", a_ids, slot=0)
    harness.step([(a, 38)])
    full = len(prefix) // BLOCK
    partial = harness.free_blocks.pop()
    for k_cache, v_cache in harness.kv_caches:
        k_cache[partial] = k_cache[a.block_table[full]]
        v_cache[partial] = v_cache[a.block_table[full]]
    for layer in harness.states:
        layer.conv_state[4] = layer.conv_state[0]
        layer.recurrent_state[4] = layer.recurrent_state[0]
    c = harness.add("c", c_ids, slot=4, block_table=a.block_table[:full] + [partial])
    c.num_computed_tokens = len(prefix)
    a_ref, c_ref = reference_logits(ref, a_ids), reference_logits(ref, c_ids)
    for pos in range(len(prefix), len(a_ids)):  # both decode, in one forward, from the same boundary
        got_a, got_c = harness.step([(c, 1), (a, 1)])[::-1]
        assert max_diff(a_ref[pos:pos + 1], got_a) <= TOL, f"a at {pos}"
        assert max_diff(c_ref[pos:pos + 1], got_c) <= TOL, f"c at {pos}"


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
