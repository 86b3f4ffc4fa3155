"""DeltaChannels: a replica's side of the per-step delta channel, one socket per calling ingress loop.

Through a Serve handle, every streamed delta is its own Ray stream item, pickled and sent, with the
bookkeeping of the handle, the replica wrapper and the core workers on both sides: per request, per step.
The channel sends one frame per engine step to each caller, carrying every delta of that step for every
request of that caller (docs/architecture.md, "The path of a streamed token"):

    step thread --(one callback per step)--> event loop: each request's generator gets its delta
        --> Outbox.send: buffered; the first send of the step schedules one flush after the others
        --> one frame: 4-byte little-endian length + pickle of [(request_id, GenerateDelta | RequestError)]

The handle call stays what routes, bounds (max_ongoing_requests) and cancels the request; it carries a
`ChannelTicket` and then nothing until the request ends. Order within a request is the socket's order.

Trust: the replica only writes frames; it reads one JSON line (the caller's key and the secret it was
offered over Ray), so nothing it receives is unpickled. The ingress unpickles only what comes from the
address Ray told it.
"""

import asyncio
import hmac
import json
import logging
import pickle
import secrets

from core.messages import ChannelOffer

logger = logging.getLogger("ray.serve")

HELLO_TIMEOUT_S = 5.0
MAX_HELLO_BYTES = 1024
MAX_UNSENT_BYTES = 64 * 1024 * 1024  # a caller that stops reading this far behind loses its channel


class Outbox:
    """One connected caller: the deltas of this loop iteration, flushed as one frame."""

    def __init__(self, writer: asyncio.StreamWriter, stats: dict[str, int]):
        self.writer = writer
        self.stats = stats  # the DeltaChannels' counters
        self.pending: list[tuple[str, object]] = []
        self.is_closed = False

    def send(self, request_id: str, item) -> None:
        if self.is_closed:
            return
        if not self.pending:  # after the other requests' deltas of this step, which are ready already
            asyncio.get_running_loop().call_soon(self._flush)
        self.pending.append((request_id, item))

    def _flush(self) -> None:
        items, self.pending = self.pending, []
        if self.is_closed or not items:
            return
        data = pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)
        self.writer.write(len(data).to_bytes(4, "little") + data)
        self.stats["num_channel_frames"] += 1
        self.stats["num_channel_items"] += len(items)
        if self.writer.transport.get_write_buffer_size() > MAX_UNSENT_BYTES:
            logger.warning("delta channel: the caller stopped reading; closing it")
            self.close()

    def close(self) -> None:
        self.is_closed = True
        self.writer.close()


class DeltaChannels:
    def __init__(self, replica_id: str, host: str):
        self.replica_id = replica_id
        self.host = host
        self.secret = secrets.token_hex(16)
        self.outboxes: dict[str, Outbox] = {}
        self.stats = {"num_channel_frames": 0, "num_channel_items": 0, "num_channel_connections": 0}
        self._server: asyncio.AbstractServer | None = None
        self._port = 0

    async def outbox_or_offer(self, key: str) -> Outbox | ChannelOffer | None:
        """The caller's connected outbox; else where to connect; None for a caller without a key."""
        if not key:
            return None
        outbox = self.outboxes.get(key)
        if outbox is not None and not outbox.is_closed:
            return outbox
        if self._server is None:  # started on the replica's event loop, at its first request
            self._server = await asyncio.start_server(self._accept, self.host, 0)
            self._port = self._server.sockets[0].getsockname()[1]
        return ChannelOffer(self.replica_id, self.host, self._port, self.secret)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        key, outbox = None, None
        try:
            line = await asyncio.wait_for(reader.readline(), HELLO_TIMEOUT_S)
            hello = json.loads(line[:MAX_HELLO_BYTES])
            if not hmac.compare_digest(str(hello.get("secret", "")), self.secret):
                raise ValueError("wrong secret")
            key = str(hello["key"])
            old = self.outboxes.get(key)
            if old is not None:
                old.close()
            self.outboxes[key] = outbox = Outbox(writer, self.stats)
            self.stats["num_channel_connections"] += 1
            while await reader.read(4096):  # the caller sends nothing more (discarded): EOF when it goes away
                pass
        except (asyncio.TimeoutError, ValueError, KeyError, TypeError, ConnectionError) as exc:
            logger.warning("delta channel: refused a connection (%r)", exc)
        finally:
            if outbox is not None and self.outboxes.get(key) is outbox:
                del self.outboxes[key]
            writer.close()

    def close(self) -> None:
        for outbox in list(self.outboxes.values()):
            outbox.close()
        self.outboxes.clear()
        if self._server is not None:
            self._server.close()
