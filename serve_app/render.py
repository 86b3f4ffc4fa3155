"""Renderer: the one place a request becomes token ids, through the model's own tokenizer and chat template."""

from replicas.messages import RequestError
from replicas.tokenizer import load_tokenizer


class Renderer:
    def __init__(self, model_dir: str):
        self.tokenizer = load_tokenizer(model_dir)
        if not getattr(self.tokenizer, "chat_template", None):
            self.tokenizer.chat_template = None  # chat requests will answer 400

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template_kwargs: dict | None = None) -> list[int]:
        if not self.tokenizer.chat_template:
            raise RequestError("this model has no chat template; use /v1/completions", param="messages")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}))
        except Exception as exc:  # the template's own checks (roles, alternation) raise here
            raise RequestError(f"the chat template rejected the messages: {exc}", param="messages") from exc
        # The template wrote the special tokens already: encode without adding more.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        return self.tokenizer.encode(prompt, add_special_tokens=True)
