"""ChannelClient: the ingress's side of the delta channels (replicas/delta_channel.py), one per event loop.

Each request registers an inbox before its handle call; a pump task reads the call itself:
- a `ChannelOffer` (the replica has no channel from this loop yet): connect in the background, once per
  replica; this request's deltas still come on the call, and the pump puts them into the inbox;
- a `ChannelTicket`: the deltas come over the replica's channel, whose reader puts them into the inbox;
- an error on the call (the replica died, backpressure): into the inbox, after what came before it.
A channel that closes (its replica died) ends every request ticketed on it with the same 503 as a
call that fails. So `stream` reads one inbox whichever way the deltas travel.
"""

import asyncio
import json
import logging
import pickle
import uuid
from typing import AsyncIterator

from core.messages import ChannelOffer, ChannelTicket, GenerateDelta, RequestError

logger = logging.getLogger("ray.serve")

CONNECT_TIMEOUT_S = 5.0
_ENDED = object()  # the call ended without an error (its deltas, if any, are already in the inbox)


def replica_gone() -> RequestError:
    return RequestError("the model replica serving this request went away; retry the request",
                        status_code=503, type="server_unavailable")


class ChannelClient:
    def __init__(self):
        self.key = uuid.uuid4().hex  # the replicas know this loop's channel by it
        self.inboxes: dict[str, asyncio.Queue] = {}
        self.ticketed: dict[str, str] = {}  # request id -> the replica whose channel carries it
        self.links: dict[str, asyncio.Task] = {}  # replica id -> its reader task (connecting or connected)

    async def stream(self, request_id: str, inbox: asyncio.Queue, call) -> AsyncIterator[GenerateDelta]:
        """The request's deltas, in order, until its last; raises what ended it otherwise. `call`: the
        started handle call (a DeploymentResponseGenerator); the caller cancels it afterwards."""
        pump = asyncio.create_task(self._pump(request_id, inbox, call))
        try:
            while True:
                item = await inbox.get()
                if item is _ENDED:
                    if request_id in self.ticketed:  # the deltas are still on their way over the channel
                        continue
                    raise replica_gone()  # ended before its last delta: not a complete answer
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            pump.cancel()
            self.inboxes.pop(request_id, None)
            self.ticketed.pop(request_id, None)

    def expect(self, request_id: str) -> asyncio.Queue:
        inbox: asyncio.Queue = asyncio.Queue()
        self.inboxes[request_id] = inbox
        return inbox

    async def _pump(self, request_id: str, inbox: asyncio.Queue, call) -> None:
        try:
            async for item in call:
                if isinstance(item, ChannelTicket):
                    self.ticketed[request_id] = item.replica_id
                    if item.replica_id not in self.links:  # its channel closed before the ticket came
                        inbox.put_nowait(replica_gone())
                elif isinstance(item, ChannelOffer):
                    self.connect(item)
                else:
                    inbox.put_nowait(item)
            inbox.put_nowait(_ENDED)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            inbox.put_nowait(exc)

    def connect(self, offer: ChannelOffer) -> None:
        if offer.replica_id not in self.links:
            self.links[offer.replica_id] = asyncio.create_task(self._read(offer))

    async def _read(self, offer: ChannelOffer) -> None:
        writer = None
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(offer.host, offer.port),
                                                    CONNECT_TIMEOUT_S)
            writer.write(json.dumps({"key": self.key, "secret": offer.secret}).encode() + b"\n")
            while True:
                size = int.from_bytes(await reader.readexactly(4), "little")
                for request_id, item in pickle.loads(await reader.readexactly(size)):
                    inbox = self.inboxes.get(request_id)
                    if inbox is not None:
                        inbox.put_nowait(item)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, asyncio.TimeoutError) as exc:
            logger.info("delta channel to replica %s closed (%r)", offer.replica_id, exc)
        finally:
            self.links.pop(offer.replica_id, None)
            if writer is not None:
                writer.close()
            for request_id, replica_id in list(self.ticketed.items()):
                if replica_id == offer.replica_id and request_id in self.inboxes:
                    self.inboxes[request_id].put_nowait(replica_gone())

    def close(self) -> None:
        for task in self.links.values():
            task.cancel()
