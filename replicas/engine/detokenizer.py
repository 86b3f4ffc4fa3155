"""IncrementalDetokenizer: a request's generated ids -> text deltas, UTF-8 safe, with stop strings.

Text is decoded over a short window of ids (prefix_offset:), so a token that
depends on its left neighbour (a leading space, a multi-byte character split
across tokens) decodes right; a window ending in U+FFFD (an incomplete
character) waits for the next token. With stop strings, the last
len(longest stop) - 1 characters are held back until they can no longer start
a stop string; a stop string ends the text before it, and the request.
"""

from dataclasses import dataclass, field

# Ids of the prompt decoded before the first generated one, for left context.
NUM_CONTEXT_TOKENS = 5


@dataclass
class IncrementalDetokenizer:
    tokenizer: object
    prompt_token_ids: list[int]
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    text: str = ""  # decoded so far
    num_emitted_chars: int = 0
    stopped: bool = False

    def __post_init__(self):
        self._ids = list(self.prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._hold_back = max((len(s) for s in self.stop), default=1) - 1

    def add_tokens(self, token_ids: list[int], skip_text: bool = False) -> None:
        """Append generated ids; skip_text: the id ends the request (EOS or a stop token id), no text."""
        if skip_text or self.stopped:
            return
        for token_id in token_ids:
            self._ids.append(token_id)
            self._decode_step()
        self._check_stop()

    def _decode_step(self) -> None:
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)  # noqa: E731
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = decode(self._ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)

    def _check_stop(self) -> None:
        if not self.stop:
            return
        search_from = max(0, self.num_emitted_chars - self._hold_back)
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; holds back a possible stop-string start unless finished."""
        end = len(self.text) if finished or self.stopped else max(self.num_emitted_chars,
                                                                    len(self.text) - self._hold_back)
        delta = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return delta
