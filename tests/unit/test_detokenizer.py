"""Incremental detokenization with SmolLM2's tokenizer: UTF-8 safe, equal to a whole decode,
stop strings found across token boundaries and never leaked."""

import pytest

from replicas.engine.detokenizer import IncrementalDetokenizer

TEXT = "Café 🙂 naïve — 東京 says: the END marker, then more text. 🎉🎉"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from core.tokenizer import load_tokenizer

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


def test_released_tokens_follow_the_text_handed_out(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    text, released = "", 0
    for token_id in ids:
        detok.add_tokens([token_id])
        text += detok.take_delta(finished=False)
        released += detok.take_released_tokens()
        assert tokenizer.decode(ids[:released]) == text  # a partial character's ids wait for the rest
    assert released < len(ids) or text == TEXT
    detok.take_delta(finished=True)
    assert released + detok.take_released_tokens() == len(ids)


def test_a_stop_string_cut_releases_only_tokens_before_it(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["END marker"])
    feed(detok, ids)
    released = detok.take_released_tokens()
    returned = TEXT[:TEXT.index("END marker")]  # "... the "; the id " END" gave its space to it
    assert tokenizer.decode(ids[:released - 1]) == returned[:-1]
    assert tokenizer.decode(ids[:released]) == returned + "END"  # a straddling id counts as returned


def test_include_stop_str_in_output_ends_after_the_stop_string(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["END marker", "naïve"], include_stop_str_in_output=True)
    assert "".join(feed(detok, ids)) == TEXT[:TEXT.index("naïve") + len("naïve")]  # the first in the text wins


def test_min_tokens_holds_back_stop_strings(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    k = next(k for k in range(len(ids)) if "END marker" in tokenizer.decode(ids[:k]))  # the id completing it
    at = IncrementalDetokenizer(tokenizer, [], stop=["END marker"], min_tokens=k)
    assert "".join(feed(at, ids)) == TEXT[:TEXT.index("END marker")]
    # One id later the stop string already lies in text from before min_tokens: it never ends the request.
    after = IncrementalDetokenizer(tokenizer, [], stop=["END marker"], min_tokens=k + 1)
    assert "".join(feed(after, ids)) == TEXT and not after.stopped


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
