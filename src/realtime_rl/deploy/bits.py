"""Vectorized bit coding for the delta codec: Rice codes, raw bit fields and varints, all in numpy.

A Rice code with parameter k writes v >= 0 as q = v >> k in unary (q ones, then a zero) followed by
the low k bits of v. For geometrically distributed values (the gaps between changed elements, the
size of a move in rounding steps) it comes within a few percent of the entropy, and unlike an
arithmetic coder it encodes and decodes with whole-array operations: the unary parts of every code
go to one bit stream and the low bits to another, so decoding finds all the unary terminators with
one `flatnonzero` and reads the low bits with one reshape per segment.

A *segment* is a run of values that share one k (for example the gaps of one exponent class).
`RiceWriter` collects segments; `rice_read` takes the same (count, k) list back and returns the values.
"""

from __future__ import annotations

import numpy as np

MAX_K = 40
"""Largest Rice parameter (values of up to 2^33 occur: moves of fp32 bit patterns)."""


def rice_cost(values: np.ndarray, k: int) -> int:
    """Bits the Rice code with parameter k spends on `values`."""
    return int((values >> np.uint64(k)).sum()) + values.size * (k + 1)


def best_rice_k(values: np.ndarray) -> tuple[int, int]:
    """(k, bits) of the cheapest Rice code for `values` (uint64), searched around log2 of the mean."""
    if values.size == 0:
        return 0, 0
    mean = float(values.mean())
    guess = int(np.log2(mean * 0.69 + 1e-12)) if mean >= 1.5 else 0
    best = None
    for k in range(max(0, guess - 1), min(MAX_K, guess + 2) + 1):
        cost = rice_cost(values, k)
        if best is None or cost < best[1]:
            best = (k, cost)
    assert best is not None
    return best


class RiceWriter:
    """Collects Rice-coded segments; `finish()` returns (unary bytes, low-bits bytes)."""

    def __init__(self) -> None:
        self._unary: list[np.ndarray] = []
        self._low: list[np.ndarray] = []

    def add(self, values: np.ndarray, k: int) -> None:
        values = np.asarray(values, dtype=np.uint64)
        if values.size == 0:
            return
        q = values >> np.uint64(k)
        assert int(q.max()) < 1 << 31, "Rice parameter far too small for these values"
        q = q.astype(np.int64)
        unary = np.ones(int(q.sum()) + q.size, dtype=np.uint8)
        unary[np.cumsum(q + 1) - 1] = 0
        self._unary.append(unary)
        if k:
            shifts = np.arange(k - 1, -1, -1, dtype=np.uint64)
            self._low.append(((values[:, None] >> shifts) & np.uint64(1)).astype(np.uint8).ravel())

    def finish(self) -> tuple[bytes, bytes]:
        def pack(parts: list[np.ndarray]) -> bytes:
            return np.packbits(np.concatenate(parts)).tobytes() if parts else b""
        return pack(self._unary), pack(self._low)


def rice_read(unary: bytes, low: bytes, segments: list[tuple[int, int]]) -> list[np.ndarray]:
    """Decode the (count, k) segments written by a RiceWriter; ValueError if the streams are short."""
    total = sum(n for n, _ in segments)
    bits = np.unpackbits(np.frombuffer(unary, dtype=np.uint8))
    ends = np.flatnonzero(bits == 0)[:total]
    if ends.size < total:
        raise ValueError("Rice unary stream is truncated")
    q_all = np.diff(ends, prepend=-1) - 1
    low_bits = np.unpackbits(np.frombuffer(low, dtype=np.uint8))
    need = sum(n * k for n, k in segments)
    if low_bits.size < need:
        raise ValueError("Rice low-bits stream is truncated")
    out, i, j = [], 0, 0
    for n, k in segments:
        v = q_all[i:i + n].astype(np.uint64) << np.uint64(k)
        if k and n:
            field = low_bits[j:j + n * k].reshape(n, k).astype(np.uint64)
            v |= (field << np.arange(k - 1, -1, -1, dtype=np.uint64)).sum(axis=1, dtype=np.uint64)
        out.append(v)
        i, j = i + n, j + n * k
    return out


def gaps(ranks: np.ndarray) -> np.ndarray:
    """Sorted distinct ranks -> the number of skipped elements before each (uint64)."""
    return (np.diff(ranks, prepend=-1) - 1).astype(np.uint64)


def ranks_from_gaps(g: np.ndarray) -> np.ndarray:
    return np.cumsum(g.astype(np.int64) + 1) - 1


def write_varint(out: bytearray, value: int) -> None:
    assert value >= 0
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


class Reader:
    """Reads varints, bytes and fixed fields from a payload; ValueError when it runs out."""

    def __init__(self, data: bytes | memoryview) -> None:
        self.data = memoryview(data)
        self.pos = 0

    def varint(self) -> int:
        value, shift = 0, 0
        while True:
            if self.pos >= len(self.data):
                raise ValueError("payload is truncated (in a varint)")
            byte = self.data[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7
            if shift > 63:
                raise ValueError("payload has a malformed varint")

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.data):
            have = len(self.data) - self.pos
            raise ValueError(f"payload is truncated: wanted {n} bytes at {self.pos}, have {have}")
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def byte(self) -> int:
        return self.take(1)[0]
