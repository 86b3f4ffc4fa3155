"""A stream of requests each asking for the whole context is admitted without thrashing.

The pool holds 16 blocks of 4 tokens, so max_model_len is 64 and every request (40 prompt + 24 generated)
needs the whole pool. With 16-token prefill chunks a younger request is admitted beside its elder and
preempted when the elder's next block is missing; it then waits at the head of the queue, because its cached
prefix plus a chunk no longer fits beside the elder, until the elder finishes. So each request is preempted
at most once (num_preemptions <= requests - 1), wastes at most one chunk of prefill, and all complete with
the output they have alone.
"""

import pytest

from tests.engine.conftest import greedy, prompts, run_all

NUM_REQUESTS = 3
PROMPT_LEN = 40
CHUNK = 16


def whole_context_requests(max_model_len: int):
    return [greedy(f"r{i}", p, max_model_len - PROMPT_LEN, ignore_eos=True)
            for i, p in enumerate(prompts([PROMPT_LEN] * NUM_REQUESTS))]


def test_whole_context_requests_complete_with_bounded_preemption(make_engine):
    tight = make_engine(num_kv_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=CHUNK)
    assert tight.max_model_len == 64
    outputs = run_all(tight, whole_context_requests(tight.max_model_len))
    assert [len(ids) for ids in outputs.values()] == [64 - PROMPT_LEN] * NUM_REQUESTS
    assert 0 < tight.scheduler.num_preemptions <= NUM_REQUESTS - 1
    num_prompt_tokens = NUM_REQUESTS * PROMPT_LEN
    assert tight.stats.num_prompt_tokens_computed <= num_prompt_tokens + tight.scheduler.num_preemptions * CHUNK
    assert tight.block_pool.num_free_blocks == tight.block_pool.num_blocks
    whole_prefill = make_engine(num_kv_blocks=16, block_size=4, max_num_seqs=8)  # one request at a time
    assert run_all(whole_prefill, whole_context_requests(64)) == outputs
    assert whole_prefill.scheduler.num_preemptions == 0


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
