"""The delta channel over a real loopback socket: a replica's DeltaChannels and an ingress's ChannelClient.

One frame per loop iteration for every request of a caller, each request's deltas in order, a wrong
secret refused, and a channel that closes ends the requests it carried with a 503, never a partial
answer taken for a whole one. The handle call is stood in for by an async generator of what a
ModelReplica.generate call yields (a ticket, an offer, inline deltas)."""

import asyncio

import pytest

from core.messages import ChannelOffer, ChannelTicket, GenerateDelta, RequestError
from replicas.delta_channel import DeltaChannels, Outbox
from serve_app.channel_client import ChannelClient

REPLICA = "replica-a"


def delta(request_id: str, n: int, last: bool = False) -> GenerateDelta:
    return GenerateDelta(request_id, [n], f" t{n}", "length" if last else None, num_generated_tokens=n)


async def connected(channels: DeltaChannels, client: ChannelClient) -> Outbox:
    offer = await channels.outbox_or_offer(client.key)
    assert isinstance(offer, ChannelOffer) and offer.replica_id == REPLICA
    client.connect(offer)
    for _ in range(200):
        outbox = await channels.outbox_or_offer(client.key)
        if isinstance(outbox, Outbox):
            return outbox
        await asyncio.sleep(0.01)
    raise AssertionError("the channel never connected")


async def ticketed_call():
    yield ChannelTicket(REPLICA)


async def drain(stream) -> list:
    return [item async for item in stream]


def test_one_frame_per_loop_iteration_carries_every_request_in_order():
    async def run():
        channels, client = DeltaChannels(REPLICA, "127.0.0.1"), ChannelClient()
        outbox = await connected(channels, client)
        ids = ["a", "b", "c"]
        streams = [client.stream(rid, client.expect(rid), ticketed_call()) for rid in ids]
        readers = [asyncio.create_task(drain(s)) for s in streams]
        await asyncio.sleep(0.05)  # the pumps have taken their tickets
        for step in range(1, 5):  # one "engine step": every request's delta in one loop iteration
            for rid in ids:
                outbox.send(rid, delta(rid, step, last=step == 4))
            await asyncio.sleep(0.01)
        results = await asyncio.wait_for(asyncio.gather(*readers), 5)
        assert channels.stats["num_channel_frames"] == 4 and channels.stats["num_channel_items"] == 12
        for rid, got in zip(ids, results):
            assert [d.token_ids for d in got] == [[1], [2], [3], [4]] and got[-1].finish_reason == "length"
        channels.close()
        client.close()

    asyncio.run(run())


def test_a_request_error_travels_after_the_deltas_before_it():
    async def run():
        channels, client = DeltaChannels(REPLICA, "127.0.0.1"), ChannelClient()
        outbox = await connected(channels, client)
        stream = client.stream("x", client.expect("x"), ticketed_call())
        got = []

        async def read():
            async for item in stream:
                got.append(item)

        reader = asyncio.create_task(read())
        await asyncio.sleep(0.05)
        outbox.send("x", delta("x", 1))
        outbox.send("x", RequestError("the grammar refused a token", status_code=500))
        with pytest.raises(RequestError, match="grammar refused"):
            await asyncio.wait_for(reader, 5)
        assert [d.token_ids for d in got] == [[1]]
        channels.close()

    asyncio.run(run())


def test_a_closed_channel_ends_its_requests_with_a_503():
    async def run():
        channels, client = DeltaChannels(REPLICA, "127.0.0.1"), ChannelClient()
        outbox = await connected(channels, client)
        stream = client.stream("y", client.expect("y"), ticketed_call())
        reader = asyncio.create_task(drain(stream))
        await asyncio.sleep(0.05)
        outbox.send("y", delta("y", 1))
        await asyncio.sleep(0.05)
        channels.close()  # the replica went away before the request's last delta
        with pytest.raises(RequestError) as gone:
            await asyncio.wait_for(reader, 5)
        assert gone.value.status_code == 503 and "went away" in gone.value.message

    asyncio.run(run())


def test_inline_deltas_and_an_offer_come_through_the_call_itself():
    async def run():
        channels, client = DeltaChannels(REPLICA, "127.0.0.1"), ChannelClient()
        offer = await channels.outbox_or_offer(client.key)

        async def inline_call():
            yield offer
            yield delta("z", 1)
            yield delta("z", 2, last=True)

        got = await asyncio.wait_for(drain(client.stream("z", client.expect("z"), inline_call())), 5)
        assert [d.token_ids for d in got] == [[1], [2]]
        for _ in range(200):  # the offer made the client connect, for the next requests
            if isinstance(await channels.outbox_or_offer(client.key), Outbox):
                break
            await asyncio.sleep(0.01)
        assert channels.stats["num_channel_connections"] == 1
        channels.close()

    asyncio.run(run())


def test_a_call_that_ends_early_is_a_503_not_a_short_answer():
    async def run():
        client = ChannelClient()

        async def cut_call():
            yield delta("w", 1)

        with pytest.raises(RequestError) as gone:
            await asyncio.wait_for(drain(client.stream("w", client.expect("w"), cut_call())), 5)
        assert gone.value.status_code == 503

    asyncio.run(run())


def test_a_wrong_secret_is_refused():
    async def run():
        channels = DeltaChannels(REPLICA, "127.0.0.1")
        offer = await channels.outbox_or_offer("caller")
        reader, writer = await asyncio.open_connection(offer.host, offer.port)
        writer.write(b'{"key": "caller", "secret": "guess"}\n')
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed on us
        assert "caller" not in channels.outboxes and channels.stats["num_channel_connections"] == 0
        channels.close()

    asyncio.run(run())
