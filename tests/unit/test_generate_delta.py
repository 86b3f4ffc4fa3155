"""GenerateDelta.merged: consecutive deltas of one request as one (AsyncEngine hands a slow reader these)."""

from core.messages import GenerateDelta, TokenLogprob


def entry(token_id: int) -> TokenLogprob:
    return TokenLogprob(token_id, f"t{token_id}", -0.5 * token_id, [(token_id, f"t{token_id}", -0.5 * token_id)])


def test_merged_joins_tokens_text_and_logprobs_and_keeps_first_prompt_and_last_counters():
    first = GenerateDelta("r", [5], "Hel", None, 7, 3, 1, 0, "first turn", [1, 2, 3], [entry(5)],
                          [None, entry(2)], 0, "rep-0")
    middle = GenerateDelta("r", [6], "", None, 7, 3, 2, 0, "first turn", logprobs=[], replica_id="rep-0")
    last = GenerateDelta("r", [7], "lo", "stop", 7, 3, 3, 0, "first turn", logprobs=[entry(6), entry(7)],
                         num_reasoning_tokens=2, replica_id="rep-0")
    merged = GenerateDelta.merged([first, middle, last])
    assert merged.token_ids == [5, 6, 7] and merged.text == "Hello" and merged.finish_reason == "stop"
    assert [e.token_id for e in merged.logprobs] == [5, 6, 7]  # one to one with the text's tokens, in order
    assert merged.prompt_token_ids == [1, 2, 3] and merged.prompt_logprobs == first.prompt_logprobs
    assert (merged.num_generated_tokens, merged.num_reasoning_tokens, merged.num_cached_tokens) == (3, 2, 3)
    assert merged.replica_id == "rep-0" and merged.retention == "first turn"


def test_merged_without_logprobs_keeps_none_and_one_delta_is_itself():
    a, b = GenerateDelta("r", [1], "a"), GenerateDelta("r", [2], "b", "length", num_generated_tokens=2)
    merged = GenerateDelta.merged([a, b])
    assert merged.logprobs is None and merged.prompt_token_ids is None and merged.num_generated_tokens == 2
    assert GenerateDelta.merged([a]) is a


if __name__ == "__main__":
    import sys

    import pytest

    sys.exit(pytest.main([__file__, "-q"]))
