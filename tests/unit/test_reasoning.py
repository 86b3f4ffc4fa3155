"""The reasoning split (core/reasoning.py, serve_app/reasoning.py): whole replies, the same replies streamed
in every two-piece cut (a tag split at each character) and one character at a time, the prompt's three states,
the grammar's start, and the retained turn's keys."""

import pytest

from replicas.engine.retention import reply_messages
from serve_app.reasoning import ReasoningParser, ReasoningSplitter, ThinkState, prompt_state, split, template_thinks
from testing.family_tokenizers import TEMPLATE_DIR

OPEN, MODEL, CLOSED = ThinkState.OPEN, ThinkState.MODEL, ThinkState.CLOSED

# (reply, state, reasoning, content)
CASES = [
    ("<think>x</think>y", MODEL, "x", "y"),
    ("<think>\nlet me see\n</think>\n\nThe answer.", MODEL, "let me see", "The answer."),  # Qwen3's own form
    ("\n<think>a\n\nb</think>\n  c\n", MODEL, "a\n\nb", "  c\n"),  # only newlines go, inner ones stay
    ("plain answer", MODEL, None, "plain answer"),
    ("  plain <think>x</think>", MODEL, None, "  plain <think>x</think>"),  # a tag after the start is text
    ("<thin", MODEL, None, "<thin"),  # a tag that never completed
    ("<think>cut short\n", MODEL, "cut short\n", None),  # ended inside reasoning: all reasoning
    ("<think>x</think>", MODEL, "x", None),
    ("x\n</think>\n\ny", OPEN, "x", "y"),  # Qwen3.5: the prompt opened <think>
    ("<think>x</think>y", OPEN, "x", "y"),  # a model that opens it again
    ("x </th ink</think>y </think> z", OPEN, "x </th ink", "y </think> z"),
    ("still thinking\n\n", OPEN, "still thinking\n\n", None),
    ("\n\n", OPEN, None, None),
    ("", OPEN, None, None),
    ("<think>x</think>y", CLOSED, None, "<think>x</think>y"),  # enable_thinking false: as generated
    ("\n\ny", CLOSED, None, "\n\ny"),
]


def stream(pieces: list[str], state: ThinkState) -> tuple[str, str]:
    splitter, reasoning, content = ReasoningSplitter(state), "", ""
    for piece in pieces:
        r, c = splitter.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("text,state,reasoning,content", CASES, ids=[f"{s.value}:{t!r}" for t, s, *_ in CASES])
def test_split_whole_reply(text, state, reasoning, content):
    assert split(text, state) == (reasoning, content)


@pytest.mark.parametrize("text,state,reasoning,content", CASES, ids=[f"{s.value}:{t!r}" for t, s, *_ in CASES])
def test_streamed_in_any_cut_equals_the_whole_split(text, state, reasoning, content):
    for cut in range(len(text) + 1):
        assert stream([text[:cut], text[cut:]], state) == (reasoning or "", content or ""), cut
    assert stream(list(text), state) == (reasoning or "", content or "")


def test_streaming_holds_back_only_a_possible_tag():
    splitter = ReasoningSplitter(OPEN)
    assert splitter.feed("\nabc\n") == ("abc", "")  # leading newline dropped, trailing one held
    assert splitter.feed("</th") == ("", "")  # '\n</th' may be the end tag
    assert splitter.feed("ank") == ("\n</thank", "")  # it was not
    assert splitter.feed("</think>\n") == ("", "")
    assert splitter.feed("\nHi") == ("", "Hi")
    assert splitter.feed("</think>") == ("", "</think>")  # content passes through untouched
    assert splitter.finish() == ("", "")


def test_model_state_decides_at_the_first_text():
    splitter = ReasoningSplitter(MODEL)
    assert splitter.feed(" \n") == ("", "")
    assert splitter.feed("<th") == ("", "")
    assert splitter.feed("e") == ("", " \n<the")  # not <think>: content, whitespace included


@pytest.mark.parametrize("prompt,state", [
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n", OPEN),  # Qwen3.5
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", CLOSED),  # enable_thinking false
    ("<|im_start|>user\nwhat is <think>?<|im_end|>\n<|im_start|>assistant\n", MODEL),  # a quoted tag is no tag
    ("<|im_start|>assistant\n<think>\nx\n</think>\n\ny<|im_end|>\n<|im_start|>assistant\n", MODEL),
])
def test_prompt_state_from_the_generation_prompt(prompt, state):
    assert prompt_state(prompt) is state


def test_continued_message_ends_inside_its_reasoning():
    assert prompt_state("<|im_start|>assistant\n<think>\nhmm", continued=True) is OPEN
    assert prompt_state("<|im_start|>assistant\n<think>\nx</think>\n\nThe", continued=True) is MODEL


class FakeTokenizer:
    """Text <-> one id per character, `</think>` one id: enough for the parser's decode / encode."""

    def __init__(self, chat_template: str | None):
        self.chat_template = chat_template

    def encode(self, text, add_special_tokens=False):
        return [9000] if text == "</think>" else [ord(ch) for ch in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join("</think>" if i == 9000 else chr(i) for i in ids)


@pytest.mark.parametrize("mode,template,enabled", [
    ("auto", "{{ '<think>\\n' }}", True), ("auto", "{{ messages }}", False), ("auto", None, False),
    ("think", None, True), ("none", "{{ '<think>' }}", False)])
def test_which_deployments_split(mode, template, enabled):
    parser = ReasoningParser(mode, FakeTokenizer(template))
    assert parser.is_enabled is enabled
    assert (parser.state([ord(c) for c in "assistant\n"]) is None) is not enabled


def test_template_thinks_looks_into_named_templates():
    assert template_thinks({"default": "x", "tool_use": "<think>"}) and not template_thinks({"default": "x"})


def test_grammar_starts_after_the_end_tag_unless_the_prompt_closed_thinking():
    parser = ReasoningParser("auto", FakeTokenizer("<think>"))
    ids = lambda text: parser.tokenizer.encode(text)  # noqa: E731
    assert parser.grammar_start_after(ids("<|im_start|>assistant\n<think>\n")) == [9000]  # open
    assert parser.grammar_start_after(ids("<|im_start|>assistant\n")) == [9000]  # the model will open it
    closed = ids("<|im_start|>assistant\n<think>\n\n") + [9000] + ids("\n\n")
    assert parser.grammar_start_after(closed) is None  # from the first token
    assert ReasoningParser("none", FakeTokenizer("<think>")).grammar_start_after(ids("<think>\n")) is None


def test_grammar_start_after_with_a_real_tokenizer(tiny_family):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_family("qwen3")), local_files_only=True)
    parser = ReasoningParser("auto", tok)
    end_id = tok.convert_tokens_to_ids("</think>")
    messages = [{"role": "user", "content": "hi"}]

    def prompt(**kwargs):
        return tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs),
                          add_special_tokens=False)

    assert parser.is_enabled and parser.state(prompt()) is MODEL
    assert parser.grammar_start_after(prompt()) == [end_id]
    assert parser.state(prompt(enable_thinking=False)) is CLOSED
    assert parser.grammar_start_after(prompt(enable_thinking=False)) is None
    qwen3_5 = prompt(chat_template=(TEMPLATE_DIR / "qwen3_5.jinja").read_text())  # Qwen3.5 opens <think>
    assert parser.state(qwen3_5) is OPEN and parser.grammar_start_after(qwen3_5) == [end_id]


def test_retained_turn_keys_are_what_the_client_may_send_back():
    assert reply_messages("<think>x</think>y", None) == [{"role": "assistant", "content": "<think>x</think>y"}]
    assert reply_messages("<think>x</think>y", "model") == [
        {"role": "assistant", "content": "y"}, {"role": "assistant", "content": "y", "reasoning_content": "x"}]
    assert reply_messages("plain", "model") == [{"role": "assistant", "content": "plain"}]
    assert reply_messages("cut", "open") == [{"role": "assistant"}, {"role": "assistant", "reasoning_content": "cut"}]


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
