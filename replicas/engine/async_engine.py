"""AsyncEngine: the Engine's step loop on its own thread, with an asyncio face.

The event loop never touches the Engine: it posts adds and aborts to an inbox;
the step thread drains the inbox between steps, steps, and hands each step's
deltas back to the loop in one call. A caller that goes away (its generator
closed or cancelled) posts an abort, so its blocks are freed at the next step.
A structured request first awaits its grammar from the engine's grammar pool
(thread-safe; compiled off the step thread) and is posted only once it is ready,
so the running batch never waits on a compilation; a request whose grammar fails
mid-generation gets its error after its deltas so far.

A step that raises kills the step thread: every open stream, and every later
call, gets a RequestError 503 ("server_unavailable", retry) instead of a hang
or an internal error, and `is_healthy` turns false, so the replica's
check_health fails and Serve replaces the replica.

The step thread also builds the Engine and sets its torch thread count: every
parallel torch op of the replica runs on that one thread. OpenMP (libgomp) keeps
a worker pool per thread that runs parallel regions; once the pools' threads
outnumber the cores, its workers stop spinning between regions and each op pays
a wake-up (measured here, 2 cores, with the model loaded on one thread and stepped
on another: a bf16 decode matmul 110 vs 51 us; one stream 14 vs 30 tok/s, bench/engine/engine_stream.py).
"""

import asyncio
import collections
import concurrent.futures
import queue
import threading
import time
from typing import AsyncIterator, Callable, TypeVar

import torch

from core.messages import GenerateDelta, GenerateRequest, RequestError
from replicas.engine.engine import Engine

T = TypeVar("T")

STEP_TIMES_KEPT = 8192  # (deltas, seconds) of the latest steps: the engine's own pace, for benchmarks


class AsyncEngine:
    def __init__(self, build_engine: Callable[[], Engine], num_threads: int | None = None,
                 stream_interval: int = 1):
        """`build_engine` runs on the step thread, after torch.set_num_threads(num_threads) there; an
        error building it is raised here. `stream_interval`: while steps make at least that many tokens
        (as many streams decoding), each request's tokens go to its caller in deltas of that many (its
        first and last token at once), merged on the step thread; below it, token by token. Each delta
        that crosses to the event loop, Ray and HTTP costs CPU the engine's threads then lack."""
        self.engine: Engine | None = None
        self.stream_interval = stream_interval
        self._held: dict[str, list[GenerateDelta]] = {}  # step thread only: deltas not handed over yet
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.error: BaseException | None = None
        self.step_times: collections.deque[tuple[int, float]] = collections.deque(maxlen=STEP_TIMES_KEPT)
        self._stopped = False
        built = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(build_engine, num_threads, built),
                                        name="tether-engine", daemon=True)
        self._thread.start()
        built.wait()
        if self.engine is None:
            raise RuntimeError(f"the engine failed to start: {self.error!r}") from self.error

    @property
    def is_healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        if not self.is_healthy:
            raise engine_failed(self.error)
        self.engine.check_request(request)  # reads config only; raises RequestError before any state
        if request.images and self.engine.vision is not None:  # decoded and resized here, not on the step thread
            await asyncio.to_thread(lambda: [self.engine.vision.processed(image) for image in request.images])
        grammar = None
        if request.sampling.structured is not None:  # compiled on the grammar pool: the step loop never waits
            compiling = self.engine.grammars.submit(request.sampling.structured)
            # Shielded: a caller that goes away must not cancel a compilation other requests share.
            grammar = await asyncio.shield(asyncio.wrap_future(compiling))
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = (asyncio.get_running_loop(), stream)
        self._post(("add", (request, grammar)))
        finished = False
        try:
            if not self.is_healthy:  # it died after the check above; its failure may have missed this stream
                raise engine_failed(self.error)
            while not finished:
                ready = [await stream.get()]
                while not stream.empty():  # steps that ran while the caller was busy: one delta for them all
                    ready.append(stream.get_nowait())
                deltas = [item for item in ready if isinstance(item, GenerateDelta)]
                if deltas:
                    delta = GenerateDelta.merged(deltas)
                    finished = delta.finish_reason is not None
                    yield delta
                for item in ready:
                    if isinstance(item, BaseException):  # an engine failure comes after the deltas before it
                        raise item
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                self._post(("abort", request.request_id))

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Runs `fn(engine)` on the step thread between steps (the engine is not thread-safe) -> its result."""
        if not self.is_healthy:
            raise engine_failed(self.error)
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._post(("call", (fn, done)))
        return await asyncio.wrap_future(done)

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=5)
        if self.engine is not None:
            self.engine.grammars.shutdown()

    def _post(self, message) -> None:
        self._inbox.put(message)
        self._wakeup.set()

    # -- the step thread ------------------------------------------------------

    def _run(self, build_engine: Callable[[], Engine], num_threads: int | None, built: threading.Event) -> None:
        try:
            if num_threads is not None:
                torch.set_num_threads(num_threads)  # per thread under OpenMP: set where the ops run
            self.engine = build_engine()
        except BaseException as exc:
            self.error = exc
            return
        finally:
            built.set()
        try:
            while not self._stopped:
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                start = time.perf_counter()
                deltas = self.engine.step()
                self.step_times.append((len(deltas), time.perf_counter() - start))
                self._deliver(deltas)
                for request_id, error in self.engine.take_failures():
                    self._deliver_failure(request_id, error)
        except BaseException as exc:  # a bug in a step: fail every open stream, report unhealthy
            self.error = exc
            for request_id in list(self._streams):
                self._deliver_to(request_id, engine_failed(exc))
            raise

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self.engine.abort_request(payload)
                self._held.pop(payload, None)
            elif kind == "call":
                self._call(*payload)
            else:
                request, grammar = payload
                if request.request_id not in self._streams:  # its caller went away
                    continue
                try:
                    self.engine.add_request(request, grammar)
                except Exception as exc:
                    self._deliver_to(request.request_id, exc)

    def _call(self, fn: Callable[[Engine], object], done: concurrent.futures.Future) -> None:
        try:
            done.set_result(fn(self.engine))
        except Exception as exc:  # the caller's to handle; the step loop goes on
            done.set_exception(exc)

    def _deliver(self, deltas: list[GenerateDelta]) -> None:
        """One callback per event loop for the whole step, so every stream of the step wakes in the same
        loop iteration (a delta channel then sends them as one frame: replicas/delta_channel.py)."""
        due: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, GenerateDelta]]] = {}
        for delta in deltas:
            held = self._held.pop(delta.request_id, [])
            held.append(delta)
            entry = self._streams.get(delta.request_id)
            if entry is None:  # a caller gone (aborted) keeps nothing here
                continue
            if is_delivery_due(delta, len(deltas), self.stream_interval):
                loop, stream = entry
                due.setdefault(loop, []).append((stream, GenerateDelta.merged(held)))
            else:
                self._held[delta.request_id] = held
        for loop, puts in due.items():
            loop.call_soon_threadsafe(put_all, puts)

    def _deliver_failure(self, request_id: str, error: BaseException) -> None:
        """A request that failed mid-generation: its held deltas, then the error, which ends its stream."""
        held = self._held.pop(request_id, None)
        if held:
            self._deliver_to(request_id, GenerateDelta.merged(held))
        self._deliver_to(request_id, error)

    def _deliver_to(self, request_id: str, item) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, stream = entry
            loop.call_soon_threadsafe(stream.put_nowait, item)


def put_all(puts: list[tuple[asyncio.Queue, object]]) -> None:
    for stream, item in puts:
        stream.put_nowait(item)


def engine_failed(error: BaseException | None) -> RequestError:
    """What a caller of an engine whose step thread has stopped gets: a 503 to retry (elsewhere)."""
    why = f"its engine failed: {error!r}" if error is not None else "it is shutting down"
    return RequestError(f"the model replica cannot serve: {why}; retry the request", status_code=503,
                        type="server_unavailable")


def is_delivery_due(delta: GenerateDelta, num_step_deltas: int, stream_interval: int) -> bool:
    """Whether a request's held deltas go to its caller with this one: always below `stream_interval`
    deltas per step (few streams: token by token); else at its first token, its last, and every
    `stream_interval`-th."""
    return (num_step_deltas < stream_interval or delta.finish_reason is not None
            or delta.num_generated_tokens == 1 or delta.num_generated_tokens % stream_interval == 0)
