"""Asynchronous front of the engine: a background thread runs ``LLMEngine.step()`` in a loop while the
asyncio server adds requests, streams their outputs and aborts them.

Channels: requests and aborts go to the engine thread through a thread-safe queue; outputs come back to
each request's ``asyncio.Queue`` through ``loop.call_soon_threadsafe``. Torch releases the GIL inside its
kernels, so the HTTP event loop keeps answering while a step runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Callable

from inferd.engine.llm_engine import LLMEngine, RequestOutput
from inferd.engine.sampling_params import SamplingParams
from inferd.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError

logger = logging.getLogger("inferd.engine")


class AsyncLLMEngine:
    """Runs an :class:`LLMEngine` on its own thread.

    Args:
        engine: a loaded engine; this object owns it from now on.
        idle_task: called once, on the engine thread, the first time the engine is idle after it has finished (or
            aborted) a request; for background work the first requests should not compete with (on two cores, a
            thread importing a module takes a core that a step's threads need: the server's first answer came
            0.15-0.7 s later while transformers' chat template renderer was imported beside it). It must
            return at once (start a thread of its own); an exception it raises is logged and ignored.

    Attributes:
        max_waiting: the most requests that may wait to be scheduled (load shedding); None = no bound.
        retry_after_s: the Retry-After (seconds) of a request refused by that bound.
        input_guard: an object with ``check(text) -> rule name | None`` run on every prompt, or None.
    """

    def __init__(self, engine: LLMEngine, idle_task: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self._idle_task = idle_task
        self._finished_one = False
        self.max_waiting: int | None = None
        self.retry_after_s = 1
        self.input_guard = None
        self._seqs: dict[str, object] = {}  # live requests' Sequence objects, for num_waiting
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self.dead: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="inferd-engine", daemon=True)
        self._thread.start()
        # The waiting gauge counts the requests accepted while a step runs, which reach the scheduler after it.
        ref = weakref.ref(self)
        engine.metrics.waiting.labels(engine.model_name).set_function(
            lambda: 0 if (a := ref()) is None else a._num_waiting_all())

    def _num_waiting_all(self) -> int:
        """The scheduler's waiting requests and those accepted but not yet handed to it."""
        seqs = self.engine.seqs
        return len(self.engine.scheduler.waiting) + sum(
            1 for rid, s in list(self._seqs.items()) if s.scheduled_time is None and rid not in seqs)

    @property
    def num_waiting(self) -> int:
        """Requests added and not yet scheduled (queued, including those preempted before their first
        step)."""
        return sum(1 for s in list(self._seqs.values()) if s.scheduled_time is None)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, announce: bool = False) -> AsyncIterator[RequestOutput | None]:
        """Add a request and yield its outputs as they come; closing the iterator early (a client that
        went away) aborts the request and frees its KV blocks. With ``announce``, first yield None once the
        request is accepted and queued (so that a streaming response can start before its first token).

        Args:
            priority: scheduling class; waiting requests of a higher class are scheduled first.

        Raises:
            InvalidRequestError: the request is invalid, or the input guard refused its prompt (raised
                before anything is yielded).
            EngineOverloadedError: ``max_waiting`` requests are already waiting.
            EngineDeadError: the engine thread has stopped.
        """
        if self.dead is not None:
            raise EngineDeadError("the engine has stopped") from self.dead
        seq = self.engine.make_sequence(request_id, prompt_token_ids, params)
        seq.priority = priority
        if self.input_guard is not None:
            with self.engine.tokenizer_lock:
                text = self.engine.tokenizer.decode(prompt_token_ids)
            rule = self.input_guard.check(text)
            if rule is not None:
                raise InvalidRequestError(f"the prompt was refused by the input guard (rule {rule!r})", "prompt")
        if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
            raise EngineOverloadedError(f"model {self.engine.model_name!r} has {self.max_waiting} requests "
                                        "waiting already; retry later", self.retry_after_s)
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._seqs[request_id] = seq
        self._commands.put(("add", seq))
        self._wake.set()
        finished = False
        try:
            if announce:
                yield None
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            self._seqs.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe); its blocks are freed before the next step."""
        self._commands.put(("abort", request_id))
        self._wake.set()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the event loop is closed
                pass

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd == "add":
                if arg.request_id not in self._streams:  # the client left before it was added
                    continue
                try:
                    self.engine.add_sequence(arg)
                except Exception as e:  # noqa: BLE001 - reported to that request only
                    self._deliver(arg.request_id, e)
            else:
                self.engine.abort(arg)
                self._finished_one = True  # a first request given up counts as done for the idle task

    def _run_idle_task(self) -> None:
        task, self._idle_task = self._idle_task, None
        try:
            task()
        except Exception:  # noqa: BLE001 - background work; the engine goes on without it
            logger.exception("the engine's idle task failed")

    def _loop(self) -> None:
        try:
            while not self._stopped:
                self._drain_commands()
                if not self.engine.has_unfinished():
                    if self._finished_one and self._idle_task is not None:
                        self._run_idle_task()
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._finished_one |= out.finished
                    self._deliver(out.request_id, out)
        except BaseException as e:  # pragma: no cover - a bug in the engine
            logger.exception("engine loop stopped")
            self.dead = e
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError("the engine stopped: see the server log"))
