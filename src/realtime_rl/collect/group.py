"""Group commit: many concurrent writers of feedback events share one transaction and one fsync.

    committer = GroupCommitter(store)
    future = committer.submit(events)     # a concurrent.futures.Future[EventBatchResult]
    result = future.result(timeout=30)    # resolved only after the commit that holds the batch returned
    committer.close()                     # writes what was submitted, then stops

One thread takes every batch waiting in the queue (up to `max_group_events`) and writes them with one
`store.add_event_batches` call: one transaction, each batch atomic and idempotent on its own, one
fsync for all. There is no timer: while one commit is on disk, the next group gathers, so groups grow
with load and a lone request waits for no one. A future resolves after the commit returns, so an
acknowledged batch is durable. If the group's write fails, its batches are written one at a time, so a
batch the store refuses fails alone; after two failures in a row the rest get the exception untried (the
store itself is failing). Retrying is safe: event ids make writes idempotent. A batch whose future was
cancelled before its group started (the caller gave up) is not written.

`submit` refuses (QueueFull) when more than `max_queued_events` wait: the caller answers "retry later"
instead of buffering without bound.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from realtime_rl.collect.base import EventBatchResult, EventStore, FeedbackEvent

log = logging.getLogger(__name__)

_Item = tuple[list[FeedbackEvent], "Future[EventBatchResult]"]


class GroupCommitter:
    def __init__(self, store: EventStore, max_group_events: int = 20_000, max_queued_events: int = 500_000,
                 on_commit: Callable[[int, int, float], None] | None = None) -> None:
        """on_commit(batches, events, seconds) is called after every group commit (for metrics)."""
        self.store = store
        self.max_group_events = max_group_events
        self.max_queued_events = max_queued_events
        self.on_commit = on_commit
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._queued_events = 0
        self._count_lock = threading.Lock()
        self._closed = False
        self._closing = threading.Lock()  # a submit's check and put against close()'s: none lands after the stop
        self._thread = threading.Thread(target=self._run, name="rtrl-group-commit", daemon=True)
        self._thread.start()

    def submit(self, events: list[FeedbackEvent]) -> Future[EventBatchResult]:
        with self._closing:
            if self._closed:
                raise RuntimeError("the group committer is closed")
            with self._count_lock:
                if self._queued_events + len(events) > self.max_queued_events:
                    raise queue.Full(f"{self._queued_events} events already wait for the event store")
                self._queued_events += len(events)
            future: Future[EventBatchResult] = Future()
            self._queue.put((events, future))  # unbounded: never blocks
        return future

    def _run(self) -> None:
        stopping = False
        while not stopping:
            item = self._queue.get()
            if item is None:
                break
            group, size = [item], len(item[0])
            while size < self.max_group_events:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    break
                group.append(item)
                size += len(item[0])
            with self._count_lock:
                self._queued_events -= size
            self._commit([(events, f) for events, f in group if f.set_running_or_notify_cancel()])
        while True:  # a batch that raced with close(): refuse it rather than leave its caller waiting
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(RuntimeError("the group committer is closed"))

    def _commit(self, group: list[_Item]) -> None:
        if not group:
            return
        error = self._write(group)
        if error is None:
            return
        if len(group) == 1:
            log.error("commit of a batch of %d events failed: %r", len(group[0][0]), error)
            group[0][1].set_exception(error)
            return
        # One batch the store refuses (bad data) must not fail the others: write them one at a time. Two failures in
        # a row mean the store itself is failing (disk full, server gone): the rest hear that without more tries.
        log.warning("group commit of %d batches failed (%r); writing them one at a time", len(group), error)
        failed_in_a_row = 0
        for i, item in enumerate(group):
            if failed_in_a_row == 2:
                log.error("the event store fails every batch: %d batches not written: %r", len(group) - i, error)
                for _, future in group[i:]:
                    future.set_exception(error)
                return
            alone = self._write([item])
            if alone is not None:
                log.error("commit of a batch of %d events failed: %r", len(item[0]), alone)
                item[1].set_exception(alone)
                error = alone
            failed_in_a_row = failed_in_a_row + 1 if alone is not None else 0

    def _write(self, group: list[_Item]) -> Exception | None:
        """Write the group's batches in one call and resolve their futures; the exception, futures unresolved,
        if the store raised (a real boundary: disk full, server gone, data it refuses)."""
        start = time.perf_counter()
        try:
            results = self.store.add_event_batches([events for events, _ in group])
        except Exception as e:
            return e
        for (_, future), result in zip(group, results):
            future.set_result(result)
        if self.on_commit is not None:
            try:
                self.on_commit(len(group), sum(len(events) for events, _ in group), time.perf_counter() - start)
            except Exception:  # metrics must not stop the writer thread
                log.exception("on_commit failed")
        return None

    def close(self, timeout_s: float = 60.0) -> None:
        """Idempotent: stop taking batches, write those already submitted, stop the thread."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the group committer did not finish within {timeout_s} s")
