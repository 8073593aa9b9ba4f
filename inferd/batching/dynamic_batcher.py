"""Triton's dynamic batcher for one model version, with ``count`` instances executing concurrently.

Requests wait in one FIFO queue. A free instance takes the oldest request and the following requests
whose inputs have the same names, dtypes and non-batch shapes, in arrival order, up to
``max_batch_size`` rows. It runs the batch at once when it has reached the largest
``preferred_batch_size`` (or ``max_batch_size``) or cannot grow; otherwise it waits until the oldest
request has queued for ``max_queue_delay_microseconds`` and then runs the largest preferred size it
can form, or everything it has. Rows are concatenated on the batch dimension and the outputs split
back in the same order, so each request gets exactly its rows.

``default_queue_policy``: ``max_queue_size`` bounds the waiting requests (one more is refused with
:class:`QueueFullError`); ``default_timeout_microseconds`` rejects a request that has waited longer
(:class:`QueueTimeoutError`); ``allow_timeout_override`` lets a request set its own timeout.

Without ``dynamic_batching`` every request runs alone (Triton's default scheduler).

Source: Triton Inference Server, docs/user_guide/model_configuration.md ("Dynamic Batcher") and
docs/user_guide/batcher.md.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from inferd.backends.base import Backend, BackendError, InvalidInputError
from inferd.batching.metrics import ModelMetrics


class QueueFullError(Exception):
    """The model's queue holds ``max_queue_size`` requests already (answer 503, retry later)."""


class QueueTimeoutError(Exception):
    """The request waited in the queue longer than its timeout."""


class BatcherClosedError(Exception):
    """The model version is unloading and takes no new requests."""


@dataclass
class _Pending:
    inputs: dict[str, np.ndarray]
    rows: int
    signature: tuple
    future: concurrent.futures.Future
    enqueued: float
    deadline: float | None
    taken: float = field(default=0.0)


class DynamicBatcher:
    """Queue and instances of one model version.

    Args:
        config: the model's validated ``ModelConfig``.
        instances: one backend per instance (``instance_group`` counts summed); each gets its own thread.
        metrics: where batch sizes, queue and compute times and outcomes are counted.
    """

    def __init__(self, config, instances: list[Backend], metrics: ModelMetrics) -> None:
        self.max_batch_size = config.max_batch_size
        self.batching = config.HasField("dynamic_batching")
        db = config.dynamic_batching
        self.preferred = sorted(set(db.preferred_batch_size))
        self.max_delay = db.max_queue_delay_microseconds / 1e6
        qp = db.default_queue_policy
        self.max_queue_size = qp.max_queue_size
        self.default_timeout = qp.default_timeout_microseconds / 1e6 or None
        self.allow_timeout_override = qp.allow_timeout_override
        self.instances = instances
        self.metrics = metrics
        self._queue: collections.deque[_Pending] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._busy = 0
        metrics.pending.set_function(lambda: len(self._queue))
        self._threads = [threading.Thread(target=self._worker, args=(inst,), daemon=True,
                                          name=f"inferd-{config.name}-{i}") for i, inst in enumerate(instances)]
        for t in self._threads:
            t.start()

    def submit(self, inputs: dict[str, np.ndarray], timeout_us: int | None = None) -> concurrent.futures.Future:
        """Queue one request (already validated against the config).

        Args:
            inputs: name -> array, batch-first when the model batches.
            timeout_us: the request's own queue timeout in microseconds; honoured only when the queue
                policy allows overrides.

        Returns:
            a future resolving to ``{output name: array}`` with this request's rows; cancel it to drop
            the request if it has not started.

        Raises:
            QueueFullError, BatcherClosedError.
        """
        rows = next(iter(inputs.values())).shape[0] if self.max_batch_size else 1
        signature = tuple(sorted((n, a.dtype.str, a.shape[1:] if self.max_batch_size else a.shape)
                                 for n, a in inputs.items()))
        now = time.monotonic()
        timeout = self.default_timeout
        if timeout_us is not None and self.allow_timeout_override:
            timeout = timeout_us / 1e6 or None
        p = _Pending(inputs, rows, signature, concurrent.futures.Future(), now,
                     now + timeout if timeout else None)
        with self._cond:
            if self._closed:
                raise BatcherClosedError("the model version is unloading")
            if self.max_queue_size and len(self._queue) >= self.max_queue_size:
                self.metrics.failure["rejected"].inc()
                raise QueueFullError(f"the model's queue is full ({self.max_queue_size} requests waiting)")
            self._queue.append(p)
            self._cond.notify()
        return p.future

    @property
    def queued(self) -> int:
        return len(self._queue)

    def close(self, timeout: float | None = 30.0) -> None:
        """Take no more requests, let the queued and running ones finish, stop the instances."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout)
        for inst in self.instances:
            inst.close()

    # -- the instance threads ------------------------------------------------------------------------

    def _worker(self, instance: Backend) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self._execute(instance, batch)

    def _next_batch(self) -> list[_Pending] | None:
        with self._cond:
            while True:
                now = time.monotonic()
                self._expire(now)
                if not self._queue:
                    if self._closed:
                        return None
                    self._cond.wait(self._next_deadline(now))
                    continue
                batch, wait = self._form(now)
                if wait is not None:
                    self._cond.wait(min(wait, self._next_deadline(now) or wait))
                    continue
                for p in batch:
                    self._queue.remove(p)
                live = [p for p in batch if p.future.set_running_or_notify_cancel()]
                self.metrics.failure["cancelled"].inc(len(batch) - len(live))
                batch = live
                if self._queue:
                    self._cond.notify()  # another instance may form the next batch
                if batch:
                    for p in batch:
                        p.taken = now
                        self.metrics.queue.observe(now - p.enqueued)
                    return batch

    def _form(self, now: float) -> tuple[list[_Pending], float | None]:
        """The batch to run now, or the seconds to wait for it to fill."""
        head = self._queue[0]
        if not self.batching or not self.max_batch_size:
            return [head], None
        target = self.preferred[-1] if self.preferred else self.max_batch_size
        batch, rows, full = [], 0, False
        for p in self._queue:
            if p.signature != head.signature:
                continue
            if rows + p.rows > self.max_batch_size:
                full = True
                break
            batch.append(p)
            rows += p.rows
            if rows >= target:
                full = True
                break
        if full or self._closed:
            return batch, None
        waited = now - head.enqueued
        if waited < self.max_delay:
            return batch, self.max_delay - waited
        if self.preferred:  # the delay is over: the largest preferred size the queue can form, else all
            cum = 0
            best = None
            for i, p in enumerate(batch):
                cum += p.rows
                if cum in self.preferred:
                    best = i + 1
            if best is not None:
                return batch[:best], None
        return batch, None

    def _expire(self, now: float) -> None:
        for p in [p for p in self._queue if p.deadline is not None and now >= p.deadline]:
            self._queue.remove(p)
            if p.future.set_running_or_notify_cancel():
                p.future.set_exception(QueueTimeoutError(
                    f"the request waited in the queue past its timeout ({(now - p.enqueued) * 1e3:.0f} ms)"))
                self.metrics.failure["timeout"].inc()

    def _next_deadline(self, now: float) -> float | None:
        deadlines = [p.deadline for p in self._queue if p.deadline is not None]
        return max(0.0, min(deadlines) - now) if deadlines else None

    def _execute(self, instance: Backend, batch: list[_Pending]) -> None:
        m = self.metrics
        if self.max_batch_size:
            names = batch[0].inputs.keys()
            inputs = ({n: batch[0].inputs[n] for n in names} if len(batch) == 1 else
                      {n: np.concatenate([p.inputs[n] for p in batch], axis=0) for n in names})
        else:
            inputs = batch[0].inputs
        rows = sum(p.rows for p in batch)
        start = time.monotonic()
        try:
            try:
                outputs = instance.execute(inputs)
            except InvalidInputError:
                if len(batch) == 1:
                    raise
                # One request's input is bad: run each alone, so only that one fails.
                for p in batch:
                    self._execute(instance, [p])
                return
            if self.max_batch_size:
                for name, arr in outputs.items():
                    if arr.ndim == 0 or arr.shape[0] != rows:
                        raise BackendError(f"output {name!r} has {arr.shape[0] if arr.ndim else 0} rows for a "
                                           f"batch of {rows}")
        except Exception as e:  # noqa: BLE001 - every request of the batch gets the error
            m.compute.observe(time.monotonic() - start)
            for p in batch:
                m.failure["backend"].inc()
                p.future.set_exception(e if isinstance(e, BackendError) else BackendError(f"inference failed: {e}"))
            return
        m.compute.observe(time.monotonic() - start)
        m.executions.inc()
        m.batch_size.observe(rows)
        m.inferences.inc(rows)
        offset = 0
        for p in batch:
            if self.max_batch_size:
                result = {n: np.ascontiguousarray(a[offset:offset + p.rows]) for n, a in outputs.items()}
            else:
                result = outputs
            offset += p.rows
            m.success.inc()
            p.future.set_result(result)
