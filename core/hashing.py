"""Prefix hashing and routing keys: pure functions, no Ray, shared by the ingress and the replicas.

Contract (the router and the replicas must hash identically, in every process):
- every digest is blake2b(digest_size=16) over a stable byte encoding — token ids as
  int64 little-endian, messages as sorted-key compact ASCII JSON — never Python's hash();
- `block_hashes` is chained: block i's hash covers blocks 0..i, and only full blocks
  are hashed, so the hashes of a prefix are a prefix of the hashes;
- `route_key` keeps a conversation on one replica across turns: caller, model and the
  messages up to and including the first user message (a shared system prompt alone
  never decides it);
- `history_key` names a conversation's exact history, chained per message so that a
  new turn extends the previous key by one step;
- `rendezvous_rank` orders replicas by highest random weight: removing a replica only
  moves the keys it owned (`rendezvous_order` is its sort key);
- `short_hash` is the compact form replicas report what they hold in (block hashes,
  history keys): the first 8 bytes as an int (`short_hashes`: of many digests at once).
"""

import array
import hashlib
import json
import struct
import sys
from collections.abc import Callable, Mapping, Sequence

DIGEST_SIZE = 16
_ROOT = bytes(DIGEST_SIZE)  # the parent of block 0 when no parent is given
_BLAKE2B = hashlib.blake2b(digest_size=DIGEST_SIZE)  # hot paths copy it: cheaper than a new one
_BIG_ENDIAN_U64 = struct.Struct(">Q")
# The message fields that decide how a message renders; anything else is ignored.
_MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id",
                   "reasoning", "reasoning_content")


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    for part in parts:
        h.update(part)
    return h.digest()


def _ids_bytes(token_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}q", *token_ids)


def _json_bytes(obj) -> bytes:
    # ASCII output: deterministic, and lone surrogates cannot break the encoding.
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def block_hashes(token_ids: Sequence[int], block_size: int,
                 parent: bytes | None = None) -> list[bytes]:
    """Chained hashes of the full blocks of `token_ids`: h_i = H(h_{i-1} || ids of block i).

    `parent` is the hash of the block before `token_ids[0]` (None: the start of a
    sequence). A trailing partial block is not hashed.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_full_tokens = len(token_ids) // block_size * block_size
    packed = memoryview(_ids_bytes(token_ids[:num_full_tokens]))  # packed once: 8 bytes per id
    block_bytes = 8 * block_size
    hashes: list[bytes] = []
    prev = _ROOT if parent is None else parent
    for start in range(0, len(packed), block_bytes):
        h = _BLAKE2B.copy()
        h.update(prev)
        h.update(packed[start:start + block_bytes])
        prev = h.digest()
        hashes.append(prev)
    return hashes


def short_hash(digest: bytes | str) -> int:
    """The first 8 bytes of a digest (bytes, or its hex) as a signed int: what replicas report."""
    raw = bytes.fromhex(digest[:16]) if isinstance(digest, str) else digest[:8]
    return int.from_bytes(raw, "little", signed=True)


def short_hashes(digests: Sequence[bytes]) -> list[int]:
    """`short_hash` of each of these digests (DIGEST_SIZE bytes each), in one pass."""
    packed = b"".join(digests)
    if len(packed) != DIGEST_SIZE * len(digests):
        raise ValueError(f"short_hashes takes {DIGEST_SIZE}-byte digests")
    words = array.array("q", packed)  # two signed 64-bit words per digest: the first is its short hash
    if sys.byteorder == "big":
        words.byteswap()
    return words[::DIGEST_SIZE // 8].tolist()


def prefix_hash(token_ids: Sequence[int]) -> bytes:
    """Hash of exactly `token_ids` (length included), for checkpoints that end inside a block."""
    return _digest(b"prefix", struct.pack("<q", len(token_ids)), _ids_bytes(token_ids))


def _canonical_part(part):
    """A content part as what renders: a text part becomes its text, any other part
    (image, audio, ...) keeps its type and payload, so two different images never hash alike."""
    if isinstance(part, str):
        return part
    if isinstance(part, Mapping) and part.get("type", "text") == "text" and "text" in part:
        return part["text"]
    return part


def canonical_tool_call(call: Mapping) -> dict:
    """A tool call as what the model wrote: its function's name and arguments, the arguments as parsed JSON
    (a client that re-serialises them with other spacing or key order still matches; text that is not JSON
    stays text). The call's `id` and `type` are the server's, not the model's: left out (a client may keep
    or rewrite them). Idempotent: the result keeps OpenAI's shape, {"function": {"name", "arguments"}}."""
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return {"function": {"name": function.get("name"), "arguments": arguments}}


def canonical_message(msg: Mapping) -> dict:
    """The fields of a chat message that decide its render, top-level None values dropped.

    String content stays a string; a list of content parts becomes a list of the
    parts' text (non-text parts kept whole, see `_canonical_part`). Tool calls become
    `canonical_tool_call`s, and an assistant turn with tool calls and empty content has no
    content (clients send "" or null alike). Other nested values are kept as sent: a
    difference there can only cost a cache miss, never a wrong hit.
    """
    out = {}
    for key in _MESSAGE_FIELDS:
        value = msg.get(key)
        if value is None:
            continue
        if key == "content" and not isinstance(value, str):
            value = [_canonical_part(p) for p in value]
        elif key == "tool_calls":
            value = [canonical_tool_call(call) for call in value]
        out[key] = value
    if out.get("tool_calls") and out.get("content") in ("", []):
        del out["content"]
    if not out.get("tool_calls"):
        out.pop("tool_calls", None)
    return out


def _routed_messages(messages: Sequence[Mapping]) -> list[Mapping]:
    """Messages up to and including the first user message; all of them if there is none."""
    for i, msg in enumerate(messages):
        if msg.get("role") == "user":
            return list(messages[:i + 1])
    return list(messages)


def route_key(caller: str, model: str, messages: list[dict] | None = None,
              token_ids: Sequence[int] | None = None, block_size: int = 16,
              num_route_blocks: int = 4) -> str:
    """The conversation's routing key (hex). Exactly one of `messages` / `token_ids`.

    Messages: caller, model and the canonical messages up to the first user message.
    Token ids: caller, model and the chained hash of the first `num_route_blocks`
    full blocks (all ids when the prompt is shorter than one block).
    """
    if (messages is None) == (token_ids is None):
        raise ValueError("route_key takes exactly one of messages / token_ids")
    if messages is not None:
        routed = [canonical_message(m) for m in _routed_messages(messages)]
        return _digest(_json_bytes(["route/messages", caller, model, routed])).hex()
    if num_route_blocks <= 0:
        raise ValueError(f"num_route_blocks must be positive, got {num_route_blocks}")
    head = token_ids[:block_size * num_route_blocks]
    hashes = block_hashes(head, block_size)
    ids_hash = hashes[-1] if hashes else prefix_hash(head)
    return _digest(_json_bytes(["route/token_ids", caller, model]), ids_hash).hex()


def extend_history_key(key: str, message: Mapping) -> str:
    """The history key of `history + [message]`, given the key of `history`."""
    return _digest(bytes.fromhex(key), _json_bytes(canonical_message(message))).hex()


def history_key(caller: str, model: str, template_options: Mapping | None,
                messages: Sequence[Mapping]) -> str:
    """Chained digest of caller, model, template options and every canonical message (hex).

    `history_key(..., msgs[:k+1]) == extend_history_key(history_key(..., msgs[:k]), msgs[k])`.
    """
    options = dict(template_options or {})  # None values kept: a template may tell them apart
    key = _digest(_json_bytes(["history", caller, model, options])).hex()
    for message in messages:
        key = extend_history_key(key, message)
    return key


def rendezvous_order(key: str) -> Callable[[str], tuple[int, str]]:
    """The sort key of replica ids for `key`: (-score, id), score = the first 8 bytes (big-endian) of
    H(key || NUL || id); the NUL separator keeps (key, id) pairs unambiguous."""
    keyed = _BLAKE2B.copy()
    keyed.update(key.encode("utf-8") + b"\x00")  # once per key, not once per replica

    def order(replica_id: str) -> tuple[int, str]:
        h = keyed.copy()
        h.update(replica_id.encode("utf-8"))
        return -_BIG_ENDIAN_U64.unpack_from(h.digest())[0], replica_id

    return order


def rendezvous_rank(key: str, replica_ids: Sequence[str]) -> list[str]:
    """Replica ids by highest-random-weight score H(key, id), best first; ties by id."""
    return sorted(replica_ids, key=rendezvous_order(key))


def rendezvous_owner(key: str, replica_ids: Sequence[str]) -> str:
    """The replica that owns `key` among `replica_ids` (the first of `rendezvous_rank`)."""
    if not replica_ids:
        raise ValueError("rendezvous_owner needs at least one replica id")
    return min(replica_ids, key=rendezvous_order(key))
