"""Chat prompts as token ids, the way the ingress renders a one-message chat (tests and bench share it)."""


def chat_ids(tokenizer, text: str) -> list[int]:
    """The prompt ids of a one-message chat, generation prompt included (a Hugging Face tokenizer)."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)
