"""Each model family's published chat template on its tokenizer (testing/family_tokenizers.py): a three-turn
conversation renders with every control token one id, and what retention relies on from turn to turn.

Retention (replicas/engine/retention.py, serve_app/render.py):

    turn k    prompt P_k  ->  reply ids C_k  ->  kept K_k = P_k + C_k + rest of the turn terminator
    turn k+1  the ingress renders B_{k+1} (messages + C_k's text + the new user message) and finds the
              span of the new messages in it  ->  prompt P_{k+1} = K_k + B_{k+1}[span]

A prefix-stable template re-renders turn k as it was sent: B_k is a prefix of B_{k+1} and so is K_k, and
the spliced prompt equals the fresh render. A template that rewrites an earlier turn (Qwen3 drops the
think block, Mistral moves the system prompt) still gets a span, and the splice keeps what the model saw.
"""

import pytest

from replicas.engine.retention import rest_of_terminator
from testing.family_tokenizers import FAMILY_TOKENS, family_special_tokens, make_family_tokenizer

SYSTEM = "You are a terse geography tutor."
USERS = ["Name a river in Egypt.", "How long is it?", "Which sea does it reach?"]
ANSWERS = ["The Nile.", "About 6,650 km.", "The Mediterranean Sea."]
REASONING = ["One river is enough.", "Recall its length.", "It flows north."]

# What the generation prompt ends with: the model's reply starts right after it.
ASSISTANT_HEADER = {
    "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "qwen2": "<|im_start|>assistant\n",
    "qwen3": "<|im_start|>assistant\n",
    "qwen3_5": "<|im_start|>assistant\n<think>\n",  # thinking is on unless enable_thinking=False
    "mistral": "[/INST]",
    "gemma3": "<start_of_turn>model\n",
    "phi3": "<|assistant|>\n",
}
# Templates with no system turn of their own fold the system prompt into a user turn.
SYSTEM_FOLDED_INTO = {"gemma3": USERS[0], "mistral": USERS[-1]}


@pytest.fixture(scope="module")
def renderer(smollm2_dir, tmp_path_factory):
    """family -> serve_app's Renderer over that family's tokenizer (built once per module)."""
    from serve_app.render import Renderer

    root, made = tmp_path_factory.mktemp("families"), {}

    def get(family: str) -> Renderer:
        if family not in made:
            made[family] = Renderer(str(make_family_tokenizer(family, smollm2_dir, root / family)))
        return made[family]

    return get


def conversation(num_turns: int, system: bool = True, reply=lambda k: ANSWERS[k]) -> list[dict]:
    """num_turns user messages, each but the last answered."""
    messages = [{"role": "system", "content": SYSTEM}] if system else []
    for k in range(num_turns):
        messages.append({"role": "user", "content": USERS[k]})
        if k < num_turns - 1:
            messages.append({"role": "assistant", "content": reply(k)})
    return messages


@pytest.mark.parametrize("family", list(FAMILY_TOKENS))
def test_three_turns_render_with_one_id_per_special_token(renderer, family):
    r = renderer(family)
    tok, tokens = r.tokenizer, FAMILY_TOKENS[family]
    assert tok.eos_token == tokens["eos"] and tok.bos_token == tokens["bos"] and tok.pad_token == tokens["pad"]
    text = r.render_text(conversation(3))
    ids = r.encode(text)
    used = 0
    for token in family_special_tokens(family) + tokens["added"]:
        token_id = tok.convert_tokens_to_ids(token)
        assert tok.encode(token, add_special_tokens=False) == [token_id]
        assert ids.count(token_id) == text.count(token), token  # every occurrence in the render is that one id
        used += token in text
    assert used >= 2  # at least the turn delimiters
    header = r.encode(ASSISTANT_HEADER[family])
    assert text.endswith(ASSISTANT_HEADER[family]) and ids[-len(header):] == header
    assert all(m in text for m in USERS + ANSWERS[:2])
    assert text.count(SYSTEM) == 1
    if family in SYSTEM_FOLDED_INTO:
        assert SYSTEM + "\n\n" + SYSTEM_FOLDED_INTO[family] in text
    else:
        assert text.index(SYSTEM) < text.index(USERS[0])


def replies(style: str):
    """The reply text of turn k as the model wrote it (and as the client sends it back)."""
    return {
        "plain": lambda k: ANSWERS[k],
        "think": lambda k: f"<think>\n{REASONING[k]}\n</think>\n\n{ANSWERS[k]}",
        # Qwen3.5's generation prompt already opened <think>: the reply starts inside it.
        "think_opened": lambda k: f"{REASONING[k]}\n</think>\n\n{ANSWERS[k]}",
    }[style]


def converse(r, system: bool, style: str, kwargs: dict | None) -> list[dict]:
    """Three turns as the server runs them: the model's ids kept, the next prompt spliced from the render.

    Per turn transition: the renders B_k, B_{k+1}, the kept ids, the renderer's path and the prompt sent.
    The model's reply ids are its text encoded, then EOS (a model stops by emitting it).
    """
    reply = replies(style)
    messages = conversation(1, system)
    rendered = r.render_chat(messages, True, kwargs)
    prompt, (_, terminator) = rendered, r.turn_terminator()
    steps = []
    for k in range(2):
        generated = r.encode(reply(k)) + [r.tokenizer.eos_token_id]
        kept = prompt + generated + rest_of_terminator(prompt + generated, terminator)
        text_before = r.render_text(messages, True, kwargs)
        messages = messages + [{"role": "assistant", "content": reply(k)}, {"role": "user", "content": USERS[k + 1]}]
        render = r.render_turn(messages, True, kwargs, caller="test", model="family", retain=True)
        after = render.prompt_token_ids
        if render.retention == "span":
            start, end = render.new_turn_span
            next_prompt = kept + after[start:end]
        else:
            next_prompt = after
        steps.append({"text_before": text_before, "text_after": r.render_text(messages, True, kwargs),
                      "before": rendered, "after": after, "kept": kept, "path": render.retention,
                      "prompt": next_prompt})
        rendered, prompt = after, next_prompt
    return steps


# id, family, system message, reply style, chat_template_kwargs,
#   template: (B_k's text a prefix of B_{k+1}'s, B_k's ids a prefix of B_{k+1}'s),
#   retention: (kept ids a prefix of B_{k+1}, the renderer's path, spliced prompt == B_{k+1})
SCENARIOS = [
    # Text-stable, but SmolLM2's pre-tokenizer (GPT-2's) encodes the header's trailing "\n\n" as one token at the
    # end of B_k and as "\n", "\n" before the reply in B_{k+1}. Llama 3's own (\s*[\r\n]+) keeps it one token.
    ("llama3", "llama3", True, "plain", None, (True, False), (False, "span", False)),
    ("qwen2", "qwen2", True, "plain", None, (True, True), (True, "span", True)),
    ("qwen3-no-think", "qwen3", True, "plain", None, (True, True), (True, "span", True)),
    # Earlier turns re-render without their think block; the prompt B_k (ending "assistant\n") stays a prefix.
    ("qwen3-think", "qwen3", True, "think", None, (True, True), (False, "span", False)),
    # The generation prompt's empty think block is dropped from the turn once a user message follows it.
    ("qwen3-thinking-off", "qwen3", True, "plain", {"enable_thinking": False}, (False, False), (False, "span", False)),
    # The generation prompt opens <think>; the turn re-renders as "assistant\n" + answer.
    ("qwen3_5", "qwen3_5", True, "think_opened", None, (False, False), (False, "span", False)),
    ("qwen3_5-thinking-off", "qwen3_5", True, "plain", {"enable_thinking": False}, (False, False),
     (False, "span", False)),
    # The system prompt goes into the last user message: it leaves turn k when turn k+1 is added.
    ("mistral-system", "mistral", True, "plain", None, (False, False), (False, "span", False)),
    ("mistral", "mistral", False, "plain", None, (True, True), (True, "span", True)),
    ("gemma3", "gemma3", True, "plain", None, (True, True), (True, "span", True)),
    # Phi-3 ends a whole conversation with its eos, not a turn: the terminator is what comes before a next turn.
    ("phi3", "phi3", True, "plain", None, (True, True), (True, "span", True)),
]


@pytest.mark.parametrize("family,system,style,kwargs,template,_", [s[1:] for s in SCENARIOS],
                         ids=[s[0] for s in SCENARIOS])
def test_template_prefix_stability(renderer, family, system, style, kwargs, template, _):
    for step in converse(renderer(family), system, style, kwargs):
        is_text_prefix = step["text_after"].startswith(step["text_before"])
        is_token_prefix = step["after"][:len(step["before"])] == step["before"]
        assert (is_text_prefix, is_token_prefix) == template
        if is_text_prefix and not is_token_prefix:  # only the last token of B_k differs (the header's "\n\n")
            assert step["after"][:len(step["before"]) - 1] == step["before"][:-1]


@pytest.mark.parametrize("family,system,style,kwargs,retention", [(*s[1:5], s[6]) for s in SCENARIOS],
                         ids=[s[0] for s in SCENARIOS])
def test_retention_splice(renderer, family, system, style, kwargs, retention):
    for step in converse(renderer(family), system, style, kwargs):
        is_kept_prefix = step["after"][:len(step["kept"])] == step["kept"]
        assert (is_kept_prefix, step["path"], step["prompt"] == step["after"]) == retention
        if step["path"] == "span":  # the new messages' ids are the render's, after the kept ones
            num_new = len(step["prompt"]) - len(step["kept"])
            assert step["prompt"][-num_new:] == step["after"][-num_new:]


def test_qwen3_drops_the_think_block_of_earlier_turns(renderer):
    r = renderer("qwen3")
    steps = converse(r, True, "think", None)
    for k, step in enumerate(steps):
        assert ANSWERS[k] in step["text_after"] and REASONING[k] not in step["text_after"]
        assert f"<|im_start|>assistant\n{ANSWERS[k]}<|im_end|>\n" in step["text_after"]
        # What the model saw (its think block) is in the kept ids the next prompt starts with.
        assert REASONING[k] in r.tokenizer.decode(step["prompt"])
    last = r.tokenizer.decode(steps[-1]["prompt"])
    assert all(f"<think>\n{reasoning}\n</think>" in last for reasoning in REASONING[:2])
    # With the reasoning sent back as a field instead of inline, the template drops it the same way.
    with_field = conversation(2, reply=lambda k: ANSWERS[k])
    with_field[2]["reasoning_content"] = REASONING[0]
    assert r.render_text(with_field) == steps[0]["text_after"]


def test_qwen3_and_qwen3_5_drop_an_empty_or_opened_think_from_the_generation_prompt(renderer):
    off = converse(renderer("qwen3"), True, "plain", {"enable_thinking": False})[0]
    assert off["text_before"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert f"<|im_start|>assistant\n{ANSWERS[0]}<|im_end|>" in off["text_after"]
    opened = converse(renderer("qwen3_5"), True, "think_opened", None)[0]
    assert opened["text_before"].endswith("<|im_start|>assistant\n<think>\n")
    assert f"<|im_start|>assistant\n{ANSWERS[0]}<|im_end|>" in opened["text_after"]
    assert REASONING[0] not in opened["text_after"]


def test_mistral_moves_the_system_prompt_to_the_last_user_message(renderer):
    r = renderer("mistral")
    steps = converse(r, True, "plain", None)
    for k, step in enumerate(steps):
        assert f"[INST]{SYSTEM}\n\n{USERS[k]}[/INST]" in step["text_before"]
        assert f"[INST]{USERS[k]}[/INST]{ANSWERS[k]}</s>" in step["text_after"]
        assert f"[INST]{SYSTEM}\n\n{USERS[k + 1]}[/INST]" in step["text_after"]
        assert step["text_after"].count(SYSTEM) == 1
    # The spliced prompt keeps the system prompt where each turn had it: once per user turn so far.
    assert r.tokenizer.decode(steps[-1]["prompt"]).count(SYSTEM) == 3


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
