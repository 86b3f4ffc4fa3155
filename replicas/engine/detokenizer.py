"""IncrementalDetokenizer: a request's generated ids -> text deltas, UTF-8 safe, with stop strings.

Text is decoded over a short window of ids (prefix_offset:), so a token that
depends on its left neighbour (a leading space, a multi-byte character split
across tokens) decodes right; a window ending in U+FFFD (an incomplete
character) waits for the next token. With stop strings, the last
len(longest stop) - 1 characters are held back until they can no longer start
a stop string; a stop string ends the text before it (or after it, with
include_stop_str_in_output), and the request.

Stop strings are looked for only once `min_tokens` ids have been added, and only
where they end in text that arrived from then on (vLLM's window): text produced
before min_tokens never ends the request later.

Each added id's text is tracked as a character span, so the caller learns how
many ids' text has been handed out (`take_released_tokens`): an id is released
with the delta that completes its text, and an id whose text a stop string cut
is never released. This is what keeps logprobs one to one with the text.

Decoding options are the request's: skip_special_tokens, and spaces_between_special_tokens,
which slow (Python) tokenizers honour; fast tokenizers accept it and ignore it (they
never put spaces between special tokens).
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
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    text: str = ""  # decoded so far
    num_emitted_chars: int = 0
    num_tokens: int = 0  # generated ids added (text skipped or not)
    stopped: bool = False

    def __post_init__(self):
        context = self.prompt_token_ids[-NUM_CONTEXT_TOKENS:]
        # An image's tokens lie past the vocabulary (replicas/request/images.py): context starts after them.
        num_vocab = len(self.tokenizer)
        last_image = max((i for i, t in enumerate(context) if t >= num_vocab), default=-1)
        self._ids = list(context[last_image + 1:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._hold_back = max((len(s) for s in self.stop), default=1) - 1
        self._token_starts: list[int] = []  # per added id: len(text) when it was added
        self._token_ends: list[int] = []  # per added id whose text has arrived: len(text) then
        self._num_released = 0
        self._num_taken = 0

    def add_tokens(self, token_ids: list[int], skip_text: bool = False) -> None:
        """Append generated ids; skip_text: the id ends the request (EOS or a stop token id), no text."""
        if self.stopped:
            return
        self.num_tokens += len(token_ids)
        if skip_text:
            return
        text_before = len(self.text)
        for token_id in token_ids:
            self._token_starts.append(len(self.text))
            self._ids.append(token_id)
            self._decode_step()
        if self.num_tokens >= self.min_tokens:
            self._check_stop(text_before)

    def _decode_step(self) -> None:
        decode = lambda ids: self.tokenizer.decode(  # noqa: E731
            ids, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens)
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = decode(self._ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            # Every id waiting for its text (a partial character, a skipped special token) ends here.
            self._token_ends += [len(self.text)] * (len(self._token_starts) - len(self._token_ends))

    def _check_stop(self, text_before: int) -> None:
        # A match must end in the text this call added: start > text_before - len(s).
        hits = [(i, i + len(s)) for s in self.stop
                if (i := self.text.find(s, max(0, text_before - len(s) + 1))) >= 0]
        if hits:
            start, end = min(hits)
            self.text = self.text[:end if self.include_stop_str_in_output else start]
            self.stopped = True

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; holds back a possible stop-string start unless finished."""
        end = len(self.text) if finished or self.stopped else max(self.num_emitted_chars,
                                                                    len(self.text) - self._hold_back)
        delta = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        self._release(finished)
        return delta

    def _release(self, finished: bool) -> None:
        if self.stopped:  # ids with text before the cut; those after it were never returned
            self._num_released = max(self._num_released, sum(1 for s in self._token_starts if s < len(self.text)))
        elif finished:
            self._num_released = len(self._token_starts)
        else:
            while (self._num_released < len(self._token_ends)
                   and self._token_ends[self._num_released] <= self.num_emitted_chars):
                self._num_released += 1

    def take_released_tokens(self) -> int:
        """How many more added ids (in order) have had their text handed out since the last call."""
        n = self._num_released - self._num_taken
        self._num_taken = self._num_released
        return n
