"""The real Serve app: chat over HTTP, and every turn of a conversation on the replica that the pure
rendezvous function predicts for its route_key."""

import openai
import pytest

from core.hashing import rendezvous_owner, route_key
from serve_app.routes import REPLICA_HEADER
from tests.ray.conftest import MODEL, stats_of_each

SYSTEM = {"role": "system", "content": "You are terse."}


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def conversations_covering(replica_ids: list[str], per_replica: int = 2, label: str = "conversation") -> list[str]:
    """First user messages whose predicted owners cover every replica, `per_replica` each. `label` starts each
    text: conversations of one test share their first KV block (system prompt + label), and a block another
    test left cached on one replica would draw them all there (the router prefers a replica holding a prefix)."""
    chosen: dict[str, list[str]] = {rid: [] for rid in replica_ids}
    i = 0
    while any(len(v) < per_replica for v in chosen.values()):
        text = f"{label} {i}: tell me about the number {i}"
        key = route_key("", MODEL, messages=[SYSTEM, {"role": "user", "content": text}])
        owner = rendezvous_owner(key, replica_ids)
        if len(chosen[owner]) < per_replica:
            chosen[owner].append(text)
        i += 1
    return [text for texts in chosen.values() for text in texts]


def test_chat_over_http_streamed_and_not(serve_app):
    c = client(serve_app)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    plain = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    streamed = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                         stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)
    assert plain.usage.completion_tokens == 8 and text == plain.choices[0].message.content


def test_turns_land_on_the_predicted_replica(serve_app, replica_ids):
    assert len(replica_ids) == 2
    c = client(serve_app)
    served_by = set()
    for first in conversations_covering(replica_ids):
        messages = [SYSTEM, {"role": "user", "content": first}]
        predicted = rendezvous_owner(route_key("", MODEL, messages=messages), replica_ids)
        for turn in range(3):
            raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=6,
                                                              temperature=0)
            assert raw.headers[REPLICA_HEADER] == predicted, f"turn {turn} of {first!r}"
            served_by.add(raw.headers[REPLICA_HEADER])
            details = raw.parse().usage.prompt_tokens_details.to_dict()
            # Sticky routing is what lets turn 2 on find the ids its replica kept.
            assert details["retention"] == ("first turn" if turn == 0 else "retained")
            reply = raw.parse().choices[0].message.content
            messages = messages + [{"role": "assistant", "content": reply},
                                   {"role": "user", "content": f"and turn {turn + 2}?"}]
    assert served_by == set(replica_ids)  # both replicas served traffic


def test_n_fans_out_through_the_conversation_router(serve_app, replica_ids):
    # Calls gathered inside one HTTP request share Serve's internal request id: the router's fan-out
    # fix is what lets all three finish (the plain RequestRouter hands a replica to the first only).
    c = client(serve_app)
    messages = [SYSTEM, {"role": "user", "content": "fan-out check: name a fruit"}]
    one = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=5,
                                                      temperature=0, n=3, timeout=60)
    three = raw.parse()
    assert [ch.index for ch in three.choices] == [0, 1, 2]
    assert {ch.message.content for ch in three.choices} == {one.choices[0].message.content}
    assert three.usage.prompt_tokens == one.usage.prompt_tokens and three.usage.completion_tokens == 15
    predicted = rendezvous_owner(route_key("", MODEL, messages=messages), replica_ids)
    assert raw.headers[REPLICA_HEADER] == predicted  # all three where the prompt is cached
    streamed = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, n=3,
                                         stream=True, timeout=60)
    texts = {0: "", 1: "", 2: ""}
    for chunk in streamed:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
    assert set(texts.values()) == {one.choices[0].message.content}


def replica_counters(replica_ids: list[str], *names: str) -> dict[str, int]:
    stats = stats_of_each(replica_ids).values()
    return {name: sum(one[name] for one in stats) for name in names}


def test_streams_come_back_over_the_delta_channel_a_frame_per_step(serve_app, replica_ids):
    """8 streams of one conversation prefix, on one replica, come back over the fast path's delta channel:
    their deltas share frames (one per engine step), instead of one Ray stream item per delta each."""
    from concurrent.futures import ThreadPoolExecutor

    names = ("num_channel_frames", "num_channel_items")
    before = replica_counters(replica_ids, *names)
    c = client(serve_app)
    messages = [SYSTEM, {"role": "user", "content": "channel check: count to fifty"}]
    c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)  # the channel opens

    def stream(_):
        chunks = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(stream, range(8)))
    assert len(set(texts)) == 1 and texts[0]
    after = replica_counters(replica_ids, *names)
    frames, items = (after[n] - before[n] for n in names)
    assert items >= 8 * 2, (frames, items)  # every stream's deltas came over the channel (40 tokens each)
    assert frames * 2 <= items, (frames, items)  # coalesced: most frames carried several streams


def test_the_proxy_path_still_serves_the_same_app(serve_app, proxy_url):
    """Serve's proxy (the old path) reaches the same Ingress: the same greedy reply, streamed and not."""
    messages = [{"role": "user", "content": "proxy check: what is 2 + 2?"}]
    fast = client(serve_app).chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    old = client(proxy_url)
    plain = old.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    streamed = old.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)
    assert plain.choices[0].message.content == text == fast.choices[0].message.content


def test_bad_request_is_a_400_through_serve(serve_app):
    c = client(serve_app)
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1)
    assert err.value.body["param"] == "temperature"


def test_six_interleaved_conversations_stay_on_their_first_replica(serve_app, replica_ids):
    """6 conversations x 4 turns, each round's 6 requests sent at once: every turn lands where the
    conversation's first turn did, and turns 2+ are served from the ids that replica kept."""
    from concurrent.futures import ThreadPoolExecutor

    c = client(serve_app)
    histories = {first: [SYSTEM, {"role": "user", "content": first + " (interleaved)"}]
                 for first in conversations_covering(replica_ids, per_replica=3, label="interleaved talk")}
    first_replica: dict[str, str] = {}

    def turn(first: str, number: int) -> None:
        raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=histories[first], max_tokens=5,
                                                          temperature=0)
        served = raw.headers[REPLICA_HEADER]
        assert first_replica.setdefault(first, served) == served, f"turn {number} of {first!r} moved"
        usage = raw.parse().usage
        details = usage.prompt_tokens_details.to_dict()
        assert details["retention"] == ("first turn" if number == 0 else "retained")
        if number > 0:
            assert usage.prompt_tokens_details.cached_tokens > 0
        histories[first] = histories[first] + [{"role": "assistant", "content": raw.parse().choices[0].message.content},
                                               {"role": "user", "content": f"and then {number}?"}]

    with ThreadPoolExecutor(max_workers=6) as pool:
        for number in range(4):
            list(pool.map(lambda first: turn(first, number), list(histories)))
    assert set(first_replica.values()) == set(replica_ids)


def scrape(url: str) -> dict[tuple[str, str], float]:
    """{(metric name, replica tag): value summed over the other tags} from a Prometheus text page."""
    import re
    import urllib.request

    totals: dict[tuple[str, str], float] = {}
    for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
        match = re.match(r'^(ray_tether_\w+)\{(.*)\} (\S+)$', line)
        replica = match and re.search(r'(?:^|,)replica="([^"]*)"', match.group(2))
        if replica:
            key = (match.group(1), replica.group(1))
            totals[key] = totals.get(key, 0.0) + float(match.group(3))
    return totals


def test_routing_metrics_per_replica_on_the_ray_metrics_port(serve_app, replica_ids, metrics_url):
    """The router's predictions and each replica's delivered cached tokens, per replica, on Ray's port;
    they agree with what the replicas count themselves."""
    import time

    from ray import serve

    handle = serve.get_deployment_handle("ModelReplica", app_name="tether")
    names = ["ray_tether_router_requests_total", "ray_tether_router_predicted_cached_tokens_total",
             "ray_tether_replica_predicted_cached_tokens_total", "ray_tether_replica_delivered_cached_tokens_total",
             "ray_tether_replica_resident_bytes"]
    deadline = time.time() + 60  # Ray exports every few seconds
    while True:
        found = scrape(metrics_url)
        if all((name, rid) in found for name in names for rid in replica_ids) or time.time() > deadline:
            break
        time.sleep(2)
    missing = [(name, rid) for name in names for rid in replica_ids if (name, rid) not in found]
    assert not missing, f"not exported: {missing}"
    stats = {}
    for _ in range(50):  # keyless calls go to the least loaded replica: ask until both answered
        one = handle.engine_stats.remote().result()
        stats[one["replica_id"]] = one
        if len(stats) == len(replica_ids):
            break
    for rid in replica_ids:
        assert found[("ray_tether_replica_predicted_cached_tokens_total", rid)] > 0
        assert found[("ray_tether_replica_resident_bytes", rid)] > 10 * 2**20  # a Python process with torch
        # Predictions are whole blocks of a history the replica kept: what it delivers matches them.
        own = stats[rid]
        assert own["num_delivered_cached_tokens"] >= 0.9 * own["num_predicted_cached_tokens"] > 0


def ray_series(url: str, name: str, application: str) -> float:
    """The sum of one metric's series of `application` on a Prometheus text page."""
    import re
    import urllib.request

    total = 0.0
    for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
        match = re.match(rf'^{name}{{(.*)}} (\S+)$', line)
        if match and f'application="{application}"' in match.group(1):
            total += float(match.group(2))
    return total


def test_ingress_metrics_reach_the_ray_metrics_port(serve_app, metrics_url):
    """One scrape sees the ingress too: Ray's port counts what the Ingress's own registry counts."""
    import time
    import urllib.request

    c = client(serve_app)
    c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "count me"}], max_tokens=3)

    def own(name: str) -> float:
        page = urllib.request.urlopen(f"{serve_app}/metrics", timeout=5).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith(name + " "))

    deadline = time.time() + 60  # Ray exports every few seconds
    while True:
        expected = own("tether_completion_tokens_total")
        exported = ray_series(metrics_url, "ray_tether_completion_tokens_total", "tether")
        if exported == expected or time.time() > deadline:
            break
        time.sleep(2)
    assert exported == expected > 0
    assert ray_series(metrics_url, "ray_tether_time_to_first_token_seconds_count", "tether") > 0
    assert ray_series(metrics_url, "ray_tether_requests_total", "tether") > 0


def wait_for_replacement(victim: str, timeout_s: float = 60.0) -> None:
    """Until Serve runs 2 healthy ModelReplicas again, none of them the dead one (the handles' routers
    learn the new set from the controller)."""
    import time

    import ray
    from ray import serve

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        deployment = serve.status().applications["tether"].deployments["ModelReplica"]
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        if deployment.replica_states.get("RUNNING", 0) == 2 and not any(victim in n for n in names):
            time.sleep(1)
            return
        time.sleep(0.5)
    raise AssertionError("the dead replica was not replaced in time")


def test_a_replica_that_dies_fails_only_its_requests_cleanly(serve_app, replica_ids):
    """Last in this module: it kills a replica. The stream on it ends with an error event and [DONE];
    afterwards every conversation's next turn succeeds (re-prefilled on a live replica)."""
    import json

    import httpx
    import ray

    c = client(serve_app)
    conversations = conversations_covering(replica_ids, per_replica=1)
    histories = {}
    for first in conversations:
        messages = [SYSTEM, {"role": "user", "content": first}]
        reply = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
        histories[first] = messages + [{"role": "assistant", "content": reply.choices[0].message.content},
                                       {"role": "user", "content": "go on"}]
    doomed = conversations[0]
    body = {"model": MODEL, "messages": histories[doomed], "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=serve_app, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            victim = response.headers[REPLICA_HEADER]
            lines = response.iter_lines()
            seen = [next(lines) for _ in range(4)]
            ray.kill(ray.get_actor(f"SERVE_REPLICA::tether#ModelReplica#{victim}", namespace="serve"),
                     no_restart=True)
            events = [line.removeprefix("data: ") for line in [*seen, *lines] if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "went away" in error["message"]
    streamed = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-2])
    wait_for_replacement(victim)
    for first, messages in histories.items():  # every later turn succeeds, the doomed one included
        reply = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 4
        if first == doomed:  # re-prefilled elsewhere, the same greedy tokens as before the death
            text = reply.choices[0].message.content
            assert streamed.startswith(text) or text.startswith(streamed)


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
