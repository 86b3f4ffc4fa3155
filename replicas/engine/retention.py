"""Retention: a chat turn's prompt built from the ids the replica kept, and the finished turn kept in turn.

    turn k   prompt P_k (rendered or retained)  ->  reply C_k  ->  keep P_k + C_k + terminator
             under history_key(messages_k + [assistant: text of C_k])
    turn k+1 the ingress sends the whole render B, the span of the new messages in B, and
             history_key(messages up to the last assistant) -> prompt = kept ids + B[span]

Never silently degraded: a miss, an opt-out or a prompt that no longer fits falls
back to the whole render B and says which path it took.
"""

from core.hashing import canonical_message, extend_history_key
from core.messages import GenerateRequest
from core.reasoning import ThinkState, split_reasoning
from core.tool_calls.reader import ToolCallReader
from replicas.cache.retained import RetainedStore


class Retention:
    def __init__(self, enabled: bool, max_tokens: int):
        self.enabled = enabled
        self.store = RetainedStore(max_tokens)

    def resolve(self, request: GenerateRequest, max_model_len: int) -> tuple[list[int], int, str]:
        """-> (prompt ids, how many came from a retained conversation, the path taken)."""
        ids = list(request.prompt_token_ids)
        if not self.enabled or request.retention == "off":
            return ids, 0, "off"
        if request.sampling.prompt_logprobs is not None:  # the logprobs are of the prompt the ingress rendered
            return ids, 0, "off: prompt_logprobs needs every prompt position"
        if request.history_key is None or request.new_turn_span is None:
            return ids, 0, request.retention  # first turn, or the ingress's fallback reason
        kept = self.store.get(request.history_key, request.caller)
        if kept is None:
            return ids, 0, "miss"
        start, end = request.new_turn_span
        spliced = kept + ids[start:end]
        if len(spliced) >= max_model_len:
            return ids, 0, "fallback: the retained conversation no longer fits the context"
        return spliced, len(kept), "retained"

    def record(self, request: GenerateRequest, token_ids: list[int], reply_text: str) -> None:
        """Keeps a finished turn's ids (prompt + generated + the rest of the turn terminator)."""
        if not self.enabled or request.retention == "off" or request.conversation_key is None:
            return
        kept = token_ids + rest_of_terminator(token_ids, request.turn_terminator_ids)
        for reply in reply_messages(reply_text, request.reasoning, request.tool_reader):
            self.store.put(extend_history_key(request.conversation_key, reply), request.caller, kept)


def reply_messages(reply_text: str, reasoning_state: str | None,
                   tool_reader: ToolCallReader | None = None) -> list[dict]:
    """The assistant messages a client may send back for this reply, as the ingress formatted it: reasoning
    split off (kept as reasoning_content, and dropped: most clients drop it; each form a key of the same ids),
    tool calls parsed out of the content by the same parser (canonical_message keys them by name and
    arguments as parsed JSON, so a client that re-serialises them still matches)."""
    reasoning, content = None, reply_text
    if reasoning_state is not None:
        reasoning, content = split_reasoning(reply_text, ThinkState(reasoning_state))
    message = {"role": "assistant", "content": content}
    if tool_reader is not None and content is not None:
        content, tool_calls = tool_reader.parse(content)
        message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
    plain = canonical_message(message)
    return [plain] if reasoning is None else [plain, {**plain, "reasoning_content": reasoning}]


def rest_of_terminator(token_ids: list[int], terminator: list[int]) -> list[int]:
    """The part of the template's turn terminator the ids do not already end with (no doubled EOS).

    [.., 'Paris', '.', EOS] with terminator [EOS, '\\n'] -> ['\\n'];  [.., 'Paris'] -> [EOS, '\\n']
    """
    for overlap in range(min(len(terminator), len(token_ids)), 0, -1):
        if token_ids[-overlap:] == terminator[:overlap]:
            return terminator[overlap:]
    return list(terminator)
