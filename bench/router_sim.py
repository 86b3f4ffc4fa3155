"""The conversation router at scale, in one process, no Ray cluster: decision time, memory, affinity, churn.

Drives the real `ConversationRouter.choose_replicas` / `on_request_routed` / `update_replicas` with stand-ins
for what Serve hands a router (`SimReplica` for a RunningReplica; real `PendingRequest`s and
`GenerateRequest`s). Each replica reports what it holds as `ModelReplica.record_routing_stats` does: the short
history keys of its retained conversations (its share of `--conversations`) and the short hashes of the KV
blocks in its pool (`--pool-blocks`) and host tier (`--tier-blocks`): the shared system prompt's blocks, then
the newest conversations' blocks. Only `--decisions` conversations are tracked end to end (their ids, keys and
block hashes are real); the others are their replicas' random 64-bit short hashes, which is all a router sees.

1. place: router A routes each tracked conversation's first turn (the rendezvous step); the replica it picks
   holds the conversation from then on;
2. next turns: router B (another ingress: the reports only) routes each tracked conversation's next turn;
3. reports change: as `--report-period` and `--rate` make them, while B routes another next turn of each;
   then one Serve broadcast (every replica's report, unpickled) is measured;
4. leave: `--leave` of the replicas go at once; router B routes every next turn again.
Garbage collection stays on, as in a router process. Memory is the process's RSS growth.
"""

import argparse
import asyncio
import gc
import hashlib
import os
import pickle
import random
import time
from collections import Counter

BLOCK_SIZE = 16
NUM_SYSTEM_BLOCKS = 4  # the system prompt every conversation starts with
NUM_FIRST_TURN_TOKENS = 60
NUM_NEW_TURN_TOKENS = 80
MIN_HISTORY_TOKENS, MAX_HISTORY_TOKENS = 1024, 4096
MAX_ONGOING = 64
CONTROL_LOOP_S = 0.1  # Serve's controller loop (RAY_SERVE_CONTROL_LOOP_INTERVAL_S): at most one broadcast each
QUICK = {"replicas": 16, "conversations": 8000, "decisions": 1000}


class SimReplica:
    """What a router reads of a Serve RunningReplica, as properties like Serve's (each read is a call)."""

    def __init__(self, replica_id, load: int):
        self._replica_id = replica_id
        self.report: dict = {}  # what `record_routing_stats` returned last
        self.node_id, self.availability_zone, self.multiplexed_model_ids = "", None, set()
        self.load = load

    replica_id = property(lambda self: self._replica_id)
    max_ongoing_requests = property(lambda self: MAX_ONGOING)
    routing_stats = property(lambda self: self.report)

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.load


class Conversation:
    """A tracked conversation: its keys and, from the replica's view, the ids it holds."""

    def __init__(self, index: int, rng: random.Random):
        self.route_key = hashlib.blake2b(f"sim/route/{index}".encode(), digest_size=16).hexdigest()
        self.history_key = hashlib.blake2b(f"sim/history/{index}".encode(), digest_size=16).hexdigest()
        self.num_history_tokens = rng.randint(MIN_HISTORY_TOKENS, MAX_HISTORY_TOKENS)
        self.first_token_id = 100_000 + index * (MAX_HISTORY_TOKENS + NUM_NEW_TURN_TOKENS)
        self.holder = ""

    def history_ids(self) -> list[int]:
        own = self.num_history_tokens - NUM_SYSTEM_BLOCKS * BLOCK_SIZE
        return system_ids() + list(range(self.first_token_id, self.first_token_id + own))

    def first_turn(self, turn: int):
        ids = system_ids() + list(range(self.first_token_id, self.first_token_id + NUM_FIRST_TURN_TOKENS))
        return make_request(f"{self.route_key}-{turn}", ids, self.route_key)

    def next_turn(self, turn: int):
        history = self.history_ids()
        ids = history + [7] * NUM_NEW_TURN_TOKENS
        return make_request(f"{self.route_key}-{turn}", ids, self.route_key, self.history_key,
                            (len(history), len(ids)))


def system_ids() -> list[int]:
    return list(range(1, NUM_SYSTEM_BLOCKS * BLOCK_SIZE + 1))


def make_request(request_id: str, ids: list[int], key: str, history: str | None = None, span=None):
    from core.messages import GenerateRequest, SamplingParams

    return GenerateRequest(request_id, ids, SamplingParams(), route_key=key, history_key=history,
                           new_turn_span=span)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def random_hashes(rng, count: int) -> list[int]:
    """Stand-ins for short hashes (signed 64-bit ints) of blocks and history keys nobody routes here."""
    import numpy as np

    return np.random.default_rng(rng.getrandbits(32)).integers(-(1 << 63), (1 << 63) - 1, count).tolist()


def build_reports(replicas, tracked, args, rng) -> None:
    """Each replica's routing stats: its conversations' short history keys; its pool's then its tier's
    blocks: the system prompt's, then the newest conversations' (the tracked ones among them by real hash)."""
    from core.hashing import block_hashes, short_hash

    by_holder: dict[str, list[Conversation]] = {}
    for conversation in tracked:
        by_holder.setdefault(conversation.holder, []).append(conversation)
    num_held = args.conversations // len(replicas)
    num_window = args.pool_blocks + args.tier_blocks
    mean_blocks = (MIN_HISTORY_TOKENS + MAX_HISTORY_TOKENS) / 2 / BLOCK_SIZE
    in_window = min(1.0, num_window / (num_held * mean_blocks))  # a conversation's chance of blocks held
    system = [short_hash(h) for h in block_hashes(system_ids(), BLOCK_SIZE)]
    for replica in replicas:
        mine = by_holder.get(replica.replica_id.unique_id, [])
        keys = [short_hash(c.history_key) for c in mine] + random_hashes(rng, max(0, num_held - len(mine)))
        blocks = list(system)
        for conversation in mine:
            if rng.random() < in_window:
                history = [short_hash(h) for h in block_hashes(conversation.history_ids(), BLOCK_SIZE)]
                blocks += history[NUM_SYSTEM_BLOCKS:]
        blocks = (blocks + random_hashes(rng, max(0, num_window - len(blocks))))[:num_window]
        replica.report = {"num_running": 0, "num_waiting": 0, "blocks": blocks[:args.pool_blocks],
                          "tier_blocks": blocks[args.pool_blocks:], "conversations": keys}


def landed(router, replicas_by_id, rank) -> str:
    """The replica a rank sends to: the lowest cached queue length, the first of equals (as Serve picks)."""
    def load(replica_id):
        queue_len = router.replica_queue_len_cache.get(replicas_by_id[replica_id].replica_id)
        return MAX_ONGOING if queue_len is None else queue_len
    return min(rank, key=load)


async def route(router, replicas, replicas_by_id, request, timings: list, record_timings: list | None = None):
    """One decision through the real router, timed; then the acceptance, as Serve reports it."""
    from ray.serve._private.common import RequestMetadata
    from ray.serve._private.request_router.common import PendingRequest

    pending = PendingRequest(args=[request], kwargs={},
                             metadata=RequestMetadata(request_id=request.request_id, internal_request_id="sim"))
    start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
    ranks = await router.choose_replicas(replicas, pending)
    timings.append((time.perf_counter_ns() - start, time.thread_time_ns() - start_cpu))
    chosen = landed(router, replicas_by_id, [r.replica_id.unique_id for r in ranks[0]])
    start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
    router.on_request_routed(pending, replicas_by_id[chosen].replica_id, None)
    if record_timings is not None:
        record_timings.append((time.perf_counter_ns() - start, time.thread_time_ns() - start_cpu))
    return chosen


def make_router(replicas) -> tuple:
    """A router as Serve starts one (its first `update_replicas` hands it every replica and report), and the
    seconds that first update took."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from cache_router.router import ConversationRouter

    router = ConversationRouter(DeploymentID(name="ModelReplica", app_name="sim"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(block_size=BLOCK_SIZE)
    start = time.perf_counter()
    router.update_replicas(replicas)
    first_update_s = time.perf_counter() - start
    for replica in replicas:
        router.replica_queue_len_cache.update(replica.replica_id, replica.load)
    return router, first_update_s


async def simulate(args) -> dict:
    from ray.serve._private.common import DeploymentID, ReplicaID

    rng = random.Random(args.seed)
    deployment = DeploymentID(name="ModelReplica", app_name="sim")
    ids = sorted({"".join(rng.choices("abcdefghijklmnopqrstuvwxyz0123456789", k=8)) for _ in range(args.replicas)})
    replicas = [SimReplica(ReplicaID(rid, deployment), rng.randint(0, 4)) for rid in ids]
    by_id = {r.replica_id.unique_id: r for r in replicas}
    tracked = [Conversation(i, rng) for i in range(min(args.decisions, args.conversations))]
    results = {"replicas": len(replicas), "conversations": args.conversations, "decisions": len(tracked),
               "load_average": os.getloadavg()[0]}
    pauses, rss = PauseClock(), [rss_bytes()]
    build_reports(replicas, tracked, args, rng)  # the other conversations only: nobody holds a tracked one yet
    rss.append(rss_bytes())
    (placer, _), first = make_router(replicas), []  # 1. place
    rss.append(rss_bytes())
    for conversation in tracked:
        conversation.holder = await route(placer, replicas, by_id, conversation.first_turn(0), first)
    del placer
    build_reports(replicas, tracked, args, rng)
    router, results["ingest_all_reports_s"] = make_router(replicas)  # 2. next turns
    results["report_kib"] = len(pickle.dumps(replicas[0].report)) / 1024
    rss.append(rss_bytes())
    following, records, chosen = [], [], {}
    for conversation in rng.sample(tracked, len(tracked)):
        chosen[conversation] = await route(router, replicas, by_id, conversation.next_turn(2), following, records)
    rss.append(rss_bytes())
    results["affinity"] = sum(chosen[c] == c.holder for c in tracked) / len(tracked)
    results.update(timing_stats("first", first), **timing_stats("next", following), **timing_stats("record", records))
    results.update(memory_stats(rss, args.conversations))
    results.update(await refresh_reports(router, replicas, by_id, tracked, args, rng))
    results.update(await serve_broadcast(router, replicas, by_id, tracked[0], args, rng))
    results.update(await leave(router, replicas, by_id, tracked, args.leave, rng))
    results.update(pauses.stop(), load_average_end=os.getloadavg()[0])
    return results


async def refresh_reports(router, replicas, by_id, tracked, args, rng) -> dict:
    """Next turns while the reports change as in a deployment: at `--rate` decisions per second and one report
    per replica per `--report-period`, every k-th decision follows a new report of one replica, with `--churn`
    of its blocks and conversations new (the others' conversations; the tracked ones stay), handed over as
    Serve does (`update_replicas`, timed apart: it is event-loop time the decisions queue behind)."""
    every = max(1, round(args.rate * args.report_period / len(replicas)))
    timings, updates = [], []
    for i, conversation in enumerate(tracked):
        if i % every == 0:
            replica = replicas[i // every % len(replicas)]
            replica.report = {**replica.report, **{name: churned(replica.report[name], args.churn, rng)
                                                   for name in ("blocks", "conversations")}}
            start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
            router.update_replicas(replicas)
            updates.append((time.perf_counter_ns() - start, time.thread_time_ns() - start_cpu))
        await route(router, replicas, by_id, conversation.next_turn(4), timings)
    update_cpu_ms = sum(t[1] for t in updates) / len(updates) / 1e6
    return {"refresh_every": every, "update_cpu_ms": update_cpu_ms,
            "update_cores": update_cpu_ms / 1e3 * len(replicas) / args.report_period,
            **timing_stats("refresh", timings), **timing_stats("update", updates)}


async def serve_broadcast(router, replicas, by_id, conversation, args, rng) -> dict:
    """One Serve broadcast, measured once: when any replica's routing stats change, the controller sends every
    router the whole list of RunningReplicaInfos, each replica's report in it, at most once per control loop
    (`broadcast_running_replicas_if_changed` in Ray Serve's deployment_state.py): the reports due in
    that time changed, all of them new objects after unpickling."""
    num_changed = max(1, round(len(replicas) * CONTROL_LOOP_S / args.report_period))
    for replica in replicas[:num_changed]:
        replica.report = {**replica.report, "blocks": churned(replica.report["blocks"], args.churn, rng)}
    payload = pickle.dumps([replica.report for replica in replicas])
    start = time.perf_counter()
    reports = pickle.loads(payload)
    unpickle_s = time.perf_counter() - start
    for replica, report in zip(replicas, reports):
        replica.report = report
    start = time.perf_counter()
    router.update_replicas(replicas)
    update_s = time.perf_counter() - start
    after = []  # the decision that follows (a router that takes reports in there pays for them then)
    await route(router, replicas, by_id, conversation.next_turn(5), after)
    return {"broadcast_changed": num_changed, "broadcast_mib": len(payload) / (1 << 20),
            "broadcast_unpickle_ms": unpickle_s * 1e3, "broadcast_update_ms": update_s * 1e3,
            "broadcast_next_ms": after[0][0] / 1e6,
            "broadcast_cores": (unpickle_s + update_s + after[0][0] / 1e9) / CONTROL_LOOP_S}


def churned(hashes: list[int], churn: float, rng) -> list[int]:
    """The list with its last `churn` share replaced by new hashes (the system prompt and tracked ones lead)."""
    num_new = int(len(hashes) * churn)
    return hashes[:len(hashes) - num_new] + random_hashes(rng, num_new)


async def leave(router, replicas, by_id, tracked, fraction: float, rng) -> dict:
    """`fraction` of the replicas go at once; every tracked conversation's next turn is routed again."""
    from core.hashing import rendezvous_rank

    gone = set(rng.sample(sorted(by_id), round(fraction * len(replicas))))
    survivors = [r for r in replicas if r.replica_id.unique_id not in gone]
    start = time.perf_counter()
    router.update_replicas(survivors)
    update_ms = (time.perf_counter() - start) * 1e3
    all_ids = sorted(by_id)
    stayed, moved_to, on_next_choice, timings = 0, Counter(), 0, []
    for conversation in tracked:
        chosen = await route(router, survivors, by_id, conversation.next_turn(3), timings)
        if conversation.holder in gone:
            moved_to[chosen] += 1
            rank = [rid for rid in rendezvous_rank(conversation.route_key, all_ids) if rid not in gone]
            on_next_choice += chosen == rank[0]
        else:
            stayed += chosen == conversation.holder
    num_moved = sum(moved_to.values())
    return {"num_left": len(gone), "num_survivors": len(survivors), "leave_update_ms": update_ms,
            "on_holder_after_leave": stayed / len(tracked), "moved": num_moved / len(tracked),
            "survivors_stayed": stayed / (len(tracked) - num_moved),
            "moved_spread": len(moved_to), "moved_max_share": max(moved_to.values(), default=0) / max(1, num_moved),
            "moved_on_next_choice": on_next_choice / max(1, num_moved),
            **timing_stats("leave", timings)}


def timing_stats(name: str, timings_ns: list) -> dict:
    """Wall-clock p50 / p99 / max and thread CPU time p50 / p99 (ms) of (wall, cpu) pairs in ns."""
    from bench.common import percentile

    wall, cpu = [t[0] / 1e6 for t in timings_ns], [t[1] / 1e6 for t in timings_ns]
    return {f"{name}_ms": (percentile(wall, 0.5), percentile(wall, 0.99), max(wall)),
            f"{name}_cpu_ms": (percentile(cpu, 0.5), percentile(cpu, 0.99))}


class PauseClock:
    """Garbage-collector pauses while installed: full (generation 2) collections and the longest pause."""

    def __init__(self):
        self.num_full, self.longest_ms, self._start = 0, 0.0, 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        self.longest_ms = max(self.longest_ms, (time.perf_counter() - self._start) * 1e3)
        self.num_full += info["generation"] == 2

    def stop(self) -> dict:
        gc.callbacks.remove(self._on_gc)
        return {"gc_num_full": self.num_full, "gc_longest_ms": self.longest_ms}


def memory_stats(rss: list[int], num_conversations: int) -> dict:
    """RSS growth: Serve's reports (the routing stats it hands the router) and the knowledge built from them
    (router A's, every replica's report taken in); the router's own routing records (router B's next turns)."""
    before, reports, knowledge, before_routed, routed = rss
    mib = 1 << 20
    return {"reports_mib": (reports - before) / mib, "knowledge_mib": (knowledge - reports) / mib,
            "routed_mib": (routed - before_routed) / mib,
            "bytes_per_conversation": (knowledge - before) / num_conversations,
            "bytes_per_conversation_all": (knowledge - before + routed - before_routed) / num_conversations}


def table(r: dict, args) -> str:
    def ms(name: str) -> str:
        wall, cpu = r[f"{name}_ms"], r[f"{name}_cpu_ms"]
        return "{:.3f} / {:.3f} / {:.3f} ms (CPU {:.3f} / {:.3f})".format(*wall, *cpu)

    rows = [
        ("replicas / live conversations / tracked conversations",
         f"{r['replicas']} / {r['conversations']:,} / {r['decisions']:,}"),
        ("reported blocks per replica (pool + tier)", f"{args.pool_blocks:,} + {args.tier_blocks:,}"),
        ("first turn decision p50 / p99 / max (CPU p50 / p99)", ms("first")),
        ("next turn decision p50 / p99 / max (CPU p50 / p99)", ms("next")),
        ("on_request_routed p50 / p99 / max (CPU p50 / p99)", ms("record")),
        ("taking in every report (the router's first update_replicas)", f"{r['ingest_all_reports_s']:.2f} s"),
        (f"next turn, reports changing ({args.churn:.0%} new; one every {r['refresh_every']} decisions)",
         ms("refresh")),
        ("update_replicas with one new report / CPU for all reports at the period",
         f"{ms('update')} / {r['update_cores']:.2f} cores"),
        ("one report pickled / one Serve broadcast (every report; those due in 0.1 s changed)",
         f"{r['report_kib']:.0f} KiB / {r['broadcast_mib']:.1f} MiB ({r['broadcast_changed']} changed)"),
        ("a broadcast's unpickling / update_replicas / next decision; at one per control loop: in, CPU",
         f"{r['broadcast_unpickle_ms']:.0f} / {r['broadcast_update_ms']:.0f} / {r['broadcast_next_ms']:.1f} ms; "
         f"{r['broadcast_mib'] / CONTROL_LOOP_S:.0f} MiB/s, {r['broadcast_cores']:.1f} cores"),
        ("router memory: reports / knowledge / own routing records",
         f"{r['reports_mib']:.0f} / {r['knowledge_mib']:.0f} / {r['routed_mib']:.0f} MiB"),
        ("router memory per live conversation: reports + knowledge / with own records",
         f"{r['bytes_per_conversation']:.0f} B / {r['bytes_per_conversation_all']:.0f} B"),
        ("garbage collections: full ones / longest pause", f"{r['gc_num_full']} / {r['gc_longest_ms']:.0f} ms"),
        ("load average (1 min) at start / end", f"{r['load_average']:.2f} / {r['load_average_end']:.2f}"),
        ("affinity: next turns on the conversation's replica", f"{r['affinity']:.4f}"),
        (f"leave: {r['num_left']} replicas at once, next turn still on its replica",
         f"{r['on_holder_after_leave']:.4f}"),
        ("leave: conversations on survivors that stayed", f"{r['survivors_stayed']:.4f}"),
        ("leave: conversations moved / on their rendezvous next choice",
         f"{r['moved']:.4f} / {r['moved_on_next_choice']:.4f}"),
        ("leave: survivors receiving moved ones / most one receives",
         f"{r['moved_spread']} of {r['num_survivors']} / {r['moved_max_share']:.2%} (even: {1 / r['num_survivors']:.2%})"),
        ("decision after the leave p50 / p99 / max (CPU p50 / p99)", ms("leave")),
        ("leave: update_replicas (the knowledge forgets the replicas gone)", f"{r['leave_update_ms']:.0f} ms"),
    ]
    return "\n".join(["| measure | value |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in rows])


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=256)
    parser.add_argument("--conversations", type=int, default=1_000_000, help="live conversations, all replicas")
    parser.add_argument("--decisions", type=int, default=20_000, help="tracked conversations: next turns timed")
    parser.add_argument("--leave", type=float, default=0.1, help="share of the replicas that leave at once")
    parser.add_argument("--pool-blocks", type=int, default=32768, help="KV pool blocks each replica reports")
    parser.add_argument("--tier-blocks", type=int, default=0, help="host-tier blocks each replica reports")
    parser.add_argument("--report-period", type=float, default=2.0, help="s between a replica's reports")
    parser.add_argument("--rate", type=float, default=500.0, help="decisions per second this router serves")
    parser.add_argument("--churn", type=float, default=0.05, help="share of a report new since the last one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help=f"a small run: {QUICK}")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
        args.pool_blocks = min(args.pool_blocks, 2048)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    results = asyncio.run(simulate(args))
    print(table(results, args))
    if args.json:
        from bench.common import write_json

        write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
