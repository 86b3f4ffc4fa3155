"""RequestOutput: one request's generated ids -> GenerateDeltas (text, logprobs, reasoning count).

The output stage beside the engine loop (as vLLM's output processor): the loop hands over each
kept token with its logprobs; this stage detokenizes, holds each token's TokenLogprob until the
detokenizer hands out that token's text, and drops the entries of tokens whose text never comes
back (the EOS / stop token id that ends the request, tokens a stop string cut). So a delta's
`logprobs` are one to one with the tokens of its `text`.

    ids      t0     t1     t2(EOS)        stop string none
    text     "Hi"   " !"   skipped
    logprobs [t0]   [t1]   []             -> 2 entries for 3 ids
"""

from collections import deque

from core.messages import GenerateDelta, TokenLogprob
from replicas.engine.detokenizer import IncrementalDetokenizer
from replicas.request.request import Request, RequestStatus
from replicas.sampling.logprobs import PositionLogprobs

REASONING_END_TAG = "</think>"


class TokenTexts:
    """Token id -> its text alone (decode([id]), special tokens spelled out), cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def entry(self, position: PositionLogprobs) -> TokenLogprob:
        return TokenLogprob(position.token_id, self(position.token_id), position.logprob,
                            [(t, self(t), lp) for t, lp in position.top])


def reasoning_end_token_id(tokenizer, tag: str = REASONING_END_TAG) -> int | None:
    """The id of the reasoning end tag when the vocabulary has it as one token, else None."""
    return tokenizer.get_vocab().get(tag)


class RequestOutput:
    def __init__(self, request: Request, tokenizer, texts: TokenTexts, reasoning_end_id: int | None):
        s = request.sampling
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, request.prompt_token_ids, stop=list(s.stop), skip_special_tokens=s.skip_special_tokens,
            spaces_between_special_tokens=s.spaces_between_special_tokens,
            include_stop_str_in_output=s.include_stop_str_in_output, min_tokens=s.min_tokens)
        self.texts = texts
        self.reasoning_end_id = reasoning_end_id
        self.pending: deque[TokenLogprob] = deque()  # entries of added tokens whose text is not out yet
        self.num_reasoning_tokens = 0

    def add_token(self, request: Request, token_id: int, logprob: PositionLogprobs | None) -> None:
        """The token the scheduler just appended to the request (its last)."""
        if self.num_reasoning_tokens == 0 and token_id == self.reasoning_end_id:
            self.num_reasoning_tokens = request.num_output_tokens
        # A stop token id ends the request without text, unless the request keeps stop strings.
        skip_text = (request.status == RequestStatus.FINISHED_STOPPED
                     and not request.sampling.include_stop_str_in_output)
        self.detokenizer.add_tokens([token_id], skip_text=skip_text)
        if logprob is not None and not skip_text:
            self.pending.append(self.texts.entry(logprob))

    def delta(self, request: Request, token_id: int) -> GenerateDelta:
        finished = request.status.is_finished
        text = self.detokenizer.take_delta(finished)
        num_released = self.detokenizer.take_released_tokens()
        delta = GenerateDelta(request.request_id, [token_id], text,
                              request.status.finish_reason if finished else None,
                              request.num_prompt_tokens, request.num_cached_tokens or 0, request.num_output_tokens,
                              request.num_retained_tokens, request.retention,
                              num_reasoning_tokens=self.num_reasoning_tokens)
        if request.sampling.logprobs is not None:
            delta.logprobs = [self.pending.popleft() for _ in range(num_released)]
        if request.num_output_tokens == 1:
            delta.prompt_token_ids = list(request.prompt_token_ids)
            if request.sampling.prompt_logprobs is not None:
                delta.prompt_logprobs = [None] + [self.texts.entry(p) for p in request.collected_prompt_logprobs]
        return delta
