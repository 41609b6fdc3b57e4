"""The engine's decode step in static shapes, replayed from CUDA graphs on a GPU.

    graphs = DecodeGraphs(engine._last_logits, max_batch=96, max_seq_len=4096, scratch_slot=96, device=device)
    logits_BV, routing_BTLK = graphs.run(tokens, positions, slots)   # host lists, one entry per row

A small model's decode step on a GPU is bound by kernel launches, not arithmetic: the eager step of the
default base model launches a few hundred kernels whatever its batch (~10 ms on an H200, BENCHMARKS.md,
engine), so an agent episode's hundreds of decode steps take seconds of launches. A CUDA graph replays
the whole step's kernels with one launch. A graph fixes its shapes and its memory, so the step here runs in
static shapes: the batch padded to a bucket (1, 2, 4, 8, 12, 16, 24, 32, 48, ... up to max_batch), every row
reading its slot's keys/values gathered up to a key-length bucket (powers of two from 64 to max_seq_len)
with keys past its own position masked, as the engine's gathered decode does. Padding rows feed token 0
at position 0 of a scratch slot no sequence holds (the KV cache has one slot more than the engine's
batch), so they write only there and attend to one finite key; their outputs are dropped.

One graph per (batch bucket, length bucket), captured the first time a step needs it (a warm-up run, then
the capture; milliseconds each) into one shared memory pool, and replayed from then on: the step's
inputs are copied into the graph's static input tensor in one host-to-device copy. The weights are read
where they lie, so a hot swap must copy new weights into the live tensors (engine.py does, with graphs
on) instead of pointing the parameters at new ones.

On a CPU (tests) the same static-shape step runs eagerly, which checks the padding and the buckets
against the engine's other decode paths; there is nothing to replay.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger(__name__)

DecodeForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor | None]]
"""(ids [B, 1], positions [B, 1], slots [B], key length) -> (logits [B, V], routing [B, 1, L, k] or None)."""

MIN_LENGTH_BUCKET = 64


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 12, then each power of two from 16 and one and a half times it (16, 24, 32, 48, 64, 96, ...),
    and max_batch itself: padding wastes at most a third of a step's rows past 8."""
    sizes, power = [1, 2, 4, 8, 12], 16
    while power < max_batch:
        sizes += [power, power * 3 // 2]
        power *= 2
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def length_bucket(length: int, max_seq_len: int) -> int:
    """The key length a step of this longest prefix reads: the next power of two (at least 64), at most
    max_seq_len."""
    return min(max_seq_len, max(MIN_LENGTH_BUCKET, 1 << (length - 1).bit_length()))


class DecodeGraphs:
    def __init__(self, forward: DecodeForward, *, max_batch: int, max_seq_len: int, scratch_slot: int,
                 device: torch.device) -> None:
        self.forward = forward
        self.max_seq_len = max_seq_len
        self.scratch_slot = scratch_slot
        self.device = device
        self.capture = device.type == "cuda"
        self.buckets = batch_buckets(max_batch)
        # Rows of the static input: token ids, positions, slots. Graphs read views of it, so one copy a step
        # fills the inputs of whichever graph runs.
        self.inputs_3B = torch.zeros(3, self.buckets[-1], dtype=torch.long, device=device)
        self._host_3B = torch.zeros(3, self.buckets[-1], dtype=torch.long, pin_memory=self.capture)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.replays = 0
        self.capture_error: str | None = None
        """Why a capture failed (an operation of the step that a graph cannot hold): the step then runs eagerly,
        in the same static shapes."""

    def run(self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int]
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step of len(tokens) rows: each row's logits [B, V] and routing [B, 1, L, k] (or None),
        views of the graph's outputs, valid until the next run."""
        rows = len(tokens)
        bucket = next(b for b in self.buckets if b >= rows)
        length = length_bucket(max(positions) + 1, self.max_seq_len)
        host = self._host_3B
        host[:, :rows] = torch.tensor((tokens, positions, slots))
        host[:2, rows:bucket] = 0
        host[2, rows:bucket] = self.scratch_slot
        self.inputs_3B[:, :bucket].copy_(host[:, :bucket], non_blocking=self.capture)
        if not self.capture:
            logits_BV, routing = self._step(bucket, length)
        else:
            graph = self.graphs.get((bucket, length))
            if graph is None:
                try:
                    graph = self.graphs[(bucket, length)] = self._capture(bucket, length, rows)
                except RuntimeError as e:  # the warm-up ran: this step's keys/values are written
                    log.warning("decode runs without CUDA graphs: capturing one failed: %s", e)
                    self.capture, self.capture_error = False, f"{type(e).__name__}: {e}"[:500]
                    self.graphs.clear()
                    return self.run(tokens, positions, slots)
            graph[0].replay()
            self.replays += 1
            logits_BV, routing = graph[1]
        return logits_BV[:rows], None if routing is None else routing[:rows]

    def _step(self, bucket: int, length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        inputs = self.inputs_3B[:, :bucket]
        return self.forward(inputs[0, :, None], inputs[1, :, None], inputs[2], length)

    def _capture(self, bucket: int, length: int, rows: int
                 ) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor | None]]:
        # The warm-up runs the step for real (lazy initialisation, library workspaces) on a side stream, as
        # capture wants; the step's real rows are in the inputs already, so it writes their keys/values exactly
        # as the replay will (same values, same places). The capture itself runs no kernel.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step(bucket, length)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of the process (a worker staging new weights on the GPU) may go on
        # calling CUDA while this thread captures.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            outputs = self._step(bucket, length)
        log.debug("captured the decode graph of %d rows (%d real) x %d keys", bucket, rows, length)
        return graph, outputs
