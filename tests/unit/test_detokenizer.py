"""Incremental detokenization with SmolLM2's tokenizer: UTF-8 safe, equal to a whole decode,
stop strings found across token boundaries and never leaked."""

import pytest

from replicas.engine.detokenizer import IncrementalDetokenizer

TEXT = "Café 🙂 naïve — 東京 says: the END marker, then more text. 🎉🎉"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from replicas.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_dir)


def feed(detok, ids) -> list[str]:
    deltas = []
    for token_id in ids:
        detok.add_tokens([token_id])
        deltas.append(detok.take_delta(finished=False))
        if detok.stopped:
            break
    deltas.append(detok.take_delta(finished=True))
    return deltas


def test_one_token_at_a_time_equals_whole_decode(tokenizer):
    prompt = tokenizer.encode("Tell me:", add_special_tokens=False)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    deltas = feed(IncrementalDetokenizer(tokenizer, prompt), ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)  # no half characters handed out
    assert any(d == "" for d in deltas)  # some tokens were partial characters, held until complete


def test_stop_string_across_tokens_is_cut_and_never_leaked(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["END marker"])
    deltas = feed(detok, ids)
    assert detok.stopped
    assert "".join(deltas) == TEXT[:TEXT.index("END marker")]
    assert all("END" not in d for d in deltas)


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode("Hi<|im_end|>", add_special_tokens=False)
    assert "".join(feed(IncrementalDetokenizer(tokenizer, []), ids)) == "Hi"


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
