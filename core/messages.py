"""The typed contract across the Serve handle, ingress <-> ModelReplica.

Plain dataclasses (pickled by Ray), no pydantic: validation happened at the
ingress; these carry already-valid values.

A `ModelReplica.generate(request)` call yields `GenerateDelta`s:
- every delta carries the token ids and text produced since the previous one;
- exactly one delta has `finish_reason` set, and it is the last;
- usage counts (`num_prompt_tokens`, `num_cached_tokens`, `num_generated_tokens`)
  are cumulative and exact on every delta.
A request the replica cannot serve raises `RequestError` before the first delta (an invalid
structured-output spec included); a grammar that refuses a token mid-generation ends its request
with a `RequestError` (500) after the deltas so far.
"""

from dataclasses import dataclass, field

from core.tool_calls.reader import ToolCallReader


@dataclass(slots=True)
class StructuredSpec:
    """A constraint on the generated text, enforced token by token by the replica's grammar stage
    (replicas/sampling/grammar.py, xgrammar). Built by the ingress; compiled and checked by the replica,
    which refuses an invalid one with RequestError(400, param=self.param) before the first delta.

    kind         text holds
    json_schema  the JSON schema, serialized (json.dumps)
    json_object  nothing (any JSON object: the schema {"type": "object"})
    regex        the pattern (xgrammar's regex: ECMAScript-like, anchored at both ends)
    choice       nothing; `choices` holds the exact strings, one of which is the whole output
    grammar      an EBNF grammar (xgrammar / GBNF syntax) whose start rule is `root`
    structural_tag  xgrammar's structural tag, serialized: {"type": "structural_tag", "format": {...}}
                 (tags, sequences, triggered tags, JSON schemas inside them: tool-call formats)
    """

    kind: str  # one of STRUCTURED_KINDS
    text: str = ""
    choices: list[str] = field(default_factory=list)
    # The grammar applies only after these ids appear in the output (e.g. the ids of "</think>"): the tokens
    # up to and including them are free. None: it applies from the first generated token.
    start_after: list[int] | None = None
    # JSON kinds: whitespace between tokens. False: the compact form (", " and ": "), which also keeps a
    # small model from looping on whitespace.
    any_whitespace: bool = False
    param: str = "response_format"  # the request field an error names

    def cache_key(self) -> tuple:
        """What the compiled grammar depends on (start_after and param do not change it)."""
        return self.kind, self.text, tuple(self.choices), self.any_whitespace


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None  # per-request generator: same seed, same output, whatever the batch
    max_tokens: int | None = None  # None: the rest of the context
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Logits processors, applied in this order to a float32 copy, only for rows that ask:
    repetition_penalty: float = 1.0  # prompt + generated, HF semantics (> 0; 1 = off)
    presence_penalty: float = 0.0  # generated tokens
    frequency_penalty: float = 0.0  # generated tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # clamped to [-100, 100]
    min_tokens: int = 0  # no EOS / stop token id / stop string before this many generated tokens
    min_p: float = 0.0
    # Structured output: the grammar's mask applies before the processors above (so logprobs see it).
    structured: StructuredSpec | None = None
    # Logprobs: None = none; k = the chosen token's logprob + the k most likely (0..20).
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # needs logits at prompt positions: bypasses prefix cache and retention
    # Detokenization.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    @property
    def is_greedy(self) -> bool:
        # vLLM's _SAMPLING_EPS: float32 logits / 1e-45 are inf, and softmax(inf) is NaN (found by
        # bench/reliability/fuzz.py)
        return self.temperature < 1e-5


@dataclass(slots=True)
class ImageInput:
    """One image of a chat request, as the ingress checked it (serve_app/images.py): the encoded bytes (PNG,
    JPEG or WebP, decoded once there to check them), the size it decoded to, and its identity, which keys
    the block hashes and the encoder cache (two images of the same size never share a block)."""
    data: bytes
    width: int
    height: int
    digest: str  # sha256 of `data`, hex


@dataclass(slots=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # Who asked (API key digest, else `user`, else ""): namespaces per-caller state.
    caller: str = ""
    # Routing hint: the conversation's key (core.hashing.route_key).
    route_key: str | None = None
    # Retained conversations (chat only): prompt_token_ids is the whole render; when the replica holds
    # ids for `history_key`, the prompt becomes those ids + prompt_token_ids[new_turn_span[0]:new_turn_span[1]].
    history_key: str | None = None
    new_turn_span: tuple[int, int] | None = None
    # Key of this request's messages; the finished turn is stored under it extended by the reply.
    conversation_key: str | None = None
    turn_terminator_ids: list[int] = field(default_factory=list)  # what the template writes after a reply
    retention: str = "off"  # the ingress's verdict: "off", "first turn", "span", "fallback: <why>"
    # Chat replies split at <think>…</think>: the ThinkState the reply starts in (core/reasoning.py), so the
    # retained turn is keyed by the parts the client received; None: not split.
    reasoning: str | None = None
    # Chat requests with tools (tool_choice not "none"): how the ingress reads the reply for tool calls
    # (core/tool_calls/reader.py), so the retained turn is keyed by the calls the client received.
    tool_reader: ToolCallReader | None = None
    # Chat images, in the order of their placeholders (replicas/request/images.py expands them).
    images: list[ImageInput] = field(default_factory=list)
    # Recurrent checkpoints (a later step).
    checkpoint_positions: list[int] = field(default_factory=list)
    # Written by the router (cache_router/router.py): prompt tokens it expects each replica to serve
    # from cache, and the policy step that chose; the replica reports predicted vs delivered.
    predicted_cached_tokens: dict[str, int] = field(default_factory=dict)
    route_reason: str = ""
    delta_channel: str = ""  # the calling ingress loop's channel key ("": deltas come back on the call itself)


@dataclass(slots=True)
class TokenLogprob:
    """One position: the token there, its logprob (logit - logsumexp over the whole vocabulary, after the
    logits processors, before temperature) and the most likely alternatives, most likely first."""

    token_id: int
    token: str  # the token's text as the tokenizer spells it alone
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (token_id, token, logprob)


@dataclass(slots=True)
class GenerateDelta:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | None while running
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    num_retained_tokens: int = 0  # prompt tokens that came from a retained conversation
    retention: str = "off"  # which path the prompt took: "retained", "miss", "first turn", "off", "fallback: ..."
    prompt_token_ids: list[int] | None = None  # the ids the model saw; on the first delta only
    # With SamplingParams.logprobs: one entry per token of the returned text in this delta (none for an
    # EOS / stop token id that ends the request, or for tokens cut with a stop string).
    logprobs: list[TokenLogprob] | None = None
    # With prompt_logprobs, on the first delta: one entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_reasoning_tokens: int = 0  # generated tokens up to and including the reasoning end tag
    replica_id: str = ""

    @classmethod
    def merged(cls, deltas: list["GenerateDelta"]) -> "GenerateDelta":
        """Consecutive deltas of one request as one: ids, text and logprobs joined; the counters and the
        finish reason of the last; the first delta's prompt fields."""
        if len(deltas) == 1:
            return deltas[0]
        first, last = deltas[0], deltas[-1]
        logprobs = None if all(d.logprobs is None for d in deltas) else [e for d in deltas for e in d.logprobs or []]
        return cls(last.request_id, [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas),
                   last.finish_reason, last.num_prompt_tokens, last.num_cached_tokens, last.num_generated_tokens,
                   last.num_retained_tokens, last.retention, first.prompt_token_ids, logprobs, first.prompt_logprobs,
                   last.num_reasoning_tokens, last.replica_id)


@dataclass(slots=True)
class ChannelOffer:
    """Yielded by `generate` before its first delta when the caller's `delta_channel` is not connected to
    this replica: where to connect (replicas/delta_channel.py). The secret travels only over Ray."""
    replica_id: str
    host: str
    port: int
    secret: str


@dataclass(slots=True)
class ChannelTicket:
    """Yielded by `generate` as its only item when this request's deltas (and a mid-generation error) go
    over the caller's connected delta channel; the call then ends when the request does."""
    replica_id: str


class RequestError(Exception):
    """A request the server refuses, as the HTTP status and OpenAI error body it becomes."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.type = type
        self.code = code

    def __reduce__(self):
        # Keeps the fields when Ray pickles the exception across the handle.
        return (RequestError, (self.message, self.status_code, self.param, self.type, self.code))

    def to_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


def as_request_error(exc: BaseException) -> RequestError | None:
    """The RequestError inside `exc`, also when Ray wrapped it in a RayTaskError."""
    seen = 0
    while exc is not None and seen < 4:
        if isinstance(exc, RequestError):
            return RequestError(exc.message, exc.status_code, exc.param, exc.type, exc.code)
        exc = getattr(exc, "cause", None) or exc.__cause__
        seen += 1
    return None
