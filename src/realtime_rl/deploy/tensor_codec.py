"""Lossless codecs for one tensor's change between two versions, on its raw bit patterns.

After an RL step in bf16 most elements keep their exact bits and the changed ones move by one or a
few rounding steps (ulps). How likely an element is to change is known to the decoder from the base
alone: an optimizer step moves every weight by about the same absolute amount, and the rounding step
of a float is set by its exponent, so an element whose exponent is one lower changes about twice as
often. The sparse codec uses that:

1. Elements are grouped into up to 6 classes of contiguous exponent ranges of the *base* value
   (boundaries chosen per tensor by a small dynamic program over the exponent histogram; stored).
2. Within a class, the changed elements' ranks are gap-coded with a Rice code whose parameter suits
   that class's rate (bits.py).
3. A move is the difference of the two bit patterns in float order (an involution maps bits to an
   integer that increases with the value, so +1 is one ulp up, across zero too): a sign bit, and
   |move| - 1 coded per class either as Rice values or, when nearly all moves are one ulp, as the
   gap-coded ranks of the larger moves plus their sizes; the encoder keeps the cheaper.

Heavily changed tensors use the dense codec (the ordered difference of every element, zig-zagged,
split into byte planes and compressed with zstd) or the raw new bytes, whichever is smallest.
Codecs: SAME (no change, empty payload), RAW, SPARSE, DENSE.

Not here: context from earlier versions (the previous move's sign predicts this one's through Adam's
momentum; an entropy estimate puts the gain at about 5%, not worth a chain-dependent decoder).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from realtime_rl.deploy.bits import (
    MAX_K, Reader, RiceWriter, best_rice_k, gaps, ranks_from_gaps, rice_read, write_varint,
)

SAME, RAW, SPARSE, DENSE = 0, 1, 2, 3
CODEC_NAMES = {SAME: "same", RAW: "raw", SPARSE: "sparse", DENSE: "dense"}
MAX_CLASSES = 6
CLASS_TABLE_BITS = 40
"""What one exponent class costs in the per-tensor table (the class DP charges it)."""
SPARSE_MAX_FRACTION = 0.5
DENSE_MIN_FRACTION = 0.2
ZSTD_LEVEL = 3


@dataclass(frozen=True)
class FloatFormat:
    name: str
    torch_dtype: torch.dtype
    int_dtype: type[np.signedinteger]
    mantissa_bits: int
    exponent_bits: int

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits


FORMATS = {f.name: f for f in (
    FloatFormat("bfloat16", torch.bfloat16, np.int16, 7, 8),
    FloatFormat("float16", torch.float16, np.int16, 10, 5),
    FloatFormat("float32", torch.float32, np.int32, 23, 8),
)}
FORMAT_OF = {f.torch_dtype: f for f in FORMATS.values()}


def float_format(dtype: torch.dtype) -> FloatFormat:
    if dtype not in FORMAT_OF:
        raise ValueError(f"weight sync carries bfloat16, float16 and float32 tensors, not {dtype}")
    return FORMAT_OF[dtype]


def bit_view(t: torch.Tensor) -> np.ndarray:
    """The tensor's bit patterns as a flat signed-integer numpy array (no copy for contiguous CPU tensors)."""
    fmt = float_format(t.dtype)
    view_dtype = torch.int16 if fmt.bits == 16 else torch.int32
    return t.detach().cpu().contiguous().reshape(-1).view(view_dtype).numpy()


def ordered(bits: np.ndarray) -> np.ndarray:
    """Bit patterns -> integers in float order (an involution: ordered(ordered(x)) == x)."""
    nbits = bits.dtype.itemsize * 8
    return bits ^ ((bits >> (nbits - 1)) & bits.dtype.type((1 << (nbits - 1)) - 1))


def _exponents(bits: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    e = (bits >> fmt.mantissa_bits) & ((1 << fmt.exponent_bits) - 1)
    return e.astype(np.uint8)


def _entropy_bits(n: np.ndarray, c: np.ndarray) -> np.ndarray:
    """n * H(c / n) in bits, elementwise (0 where n == 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(n > 0, c / np.maximum(n, 1), 0.0)
        h = -(np.where(p > 0, p * np.log2(p), 0.0) + np.where(p < 1, (1 - p) * np.log2(1 - p), 0.0))
    return n * h


def choose_classes(count_all: np.ndarray, count_changed: np.ndarray,
                   max_classes: int = MAX_CLASSES) -> list[int]:
    """Lower exponent bounds of classes 1..K-1 minimizing the mask's entropy plus the table cost."""
    present = np.flatnonzero(count_all)
    m = present.size
    if m <= 1:
        return []
    N = np.concatenate([[0], np.cumsum(count_all[present])]).astype(np.float64)
    C = np.concatenate([[0], np.cumsum(count_changed[present])]).astype(np.float64)
    # cost[i, j]: one class holding present exponents i..j-1 (i < j)
    i, j = np.meshgrid(np.arange(m + 1), np.arange(m + 1), indexing="ij")
    cost = np.where(i < j, _entropy_bits(N[j] - N[i], C[j] - C[i]) + CLASS_TABLE_BITS, np.inf)
    best = [cost[0]]  # best[k][j]: first j exponents in k + 1 classes
    choice = []
    for _ in range(1, min(max_classes, m)):
        total = best[-1][:, None] + cost
        choice.append(np.argmin(total, axis=0))
        best.append(total[choice[-1], np.arange(m + 1)])
    k = int(np.argmin([b[m] for b in best]))
    bounds, j = [], m
    for kk in range(k, 0, -1):
        j = int(choice[kk - 1][j])
        bounds.append(int(present[j]))
    return sorted(bounds)


def _class_members(e: np.ndarray, bounds: list[int], c: int) -> np.ndarray:
    lo = bounds[c - 1] if c > 0 else None
    hi = bounds[c] if c < len(bounds) else None
    if lo is None and hi is None:
        return np.arange(e.size)
    if lo is None:
        return np.flatnonzero(e < hi)
    if hi is None:
        return np.flatnonzero(e >= lo)
    return np.flatnonzero((e >= lo) & (e < hi))


# ---------------------------------------------------------------------------------------------- sparse
# Payload: u8 K, K-1 varint class bounds; per class varint count (+ u8 Rice k of its gaps when > 0);
# per non-empty class a magnitude mode (below); varint lengths of the four Rice streams (positions
# unary/low, magnitudes unary/low), the streams, then one sign bit per change (class order, rank order).

def _adaptive_ks(a: int, e: np.ndarray) -> np.ndarray:
    """Rice parameter of each move: one exponent lower doubles the expected move in ulps."""
    return np.clip(a - e.astype(np.int64), 0, MAX_K)


def _by_k(ks: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Stream order of values with per-value Rice parameters: (order, [(count, k), ...])."""
    order = np.argsort(ks, kind="stable")
    values, counts = np.unique(ks, return_counts=True)
    return order, [(int(n), int(k)) for k, n in zip(values, counts)]


def _magnitude_code(mag: np.ndarray, e: np.ndarray) -> tuple[bytes, list[tuple[np.ndarray, int]]]:
    """The cheapest code of one class's |move| - 1: (table bytes, Rice segments in stream order).

    mode 0: every move is one ulp. mode 1: Rice with k = a - exponent (clipped), so that the tiny
    weights of a merged class, which move by many ulps, get wide codes and the rest narrow ones.
    mode 2: the ranks of the moves larger than one ulp, gap-coded, then Rice(|move| - 2) of those.
    """
    big = np.flatnonzero(mag)
    if big.size == 0:
        return b"\x00", []
    center = int(np.median(e.astype(np.int64) + np.log2(mag.astype(np.float64) * 0.69 + 1.0)))
    best_a, cost1 = 0, None
    for a in range(max(0, center - 2), center + 3):
        ks = _adaptive_ks(a, e).astype(np.uint64)
        cost = int((mag >> ks).sum()) + int(ks.sum()) + mag.size
        if cost1 is None or cost < cost1:
            best_a, cost1 = a, cost
    g = gaps(big)
    kg, cost_g = best_rice_k(g)
    kv, cost_v = best_rice_k(mag[big] - np.uint64(1))
    assert cost1 is not None
    if cost1 <= cost_g + cost_v + 16:
        table = bytearray([1])
        write_varint(table, best_a)
        order, segments = _by_k(_adaptive_ks(best_a, e))
        ordered_mag, out, i = mag[order], [], 0
        for n, k in segments:
            out.append((ordered_mag[i:i + n], k))
            i += n
        return bytes(table), out
    table = bytearray([2])
    write_varint(table, big.size)
    table += bytes([kg, kv])
    return bytes(table), [(g, kg), (mag[big] - np.uint64(1), kv)]


def _encode_sparse(base: np.ndarray, new: np.ndarray, changed: np.ndarray, fmt: FloatFormat,
                   max_classes: int = MAX_CLASSES) -> bytes:
    e = _exponents(base, fmt)
    e_changed = e[changed]
    size = 1 << fmt.exponent_bits
    bounds = choose_classes(np.bincount(e, minlength=size), np.bincount(e_changed, minlength=size),
                            max_classes)
    cls_changed = np.searchsorted(np.asarray(bounds, dtype=np.int64), e_changed, side="right")
    table = bytearray([len(bounds) + 1])
    for b in bounds:
        write_varint(table, b)
    positions, magnitudes, signs = RiceWriter(), RiceWriter(), []
    magnitude_table = bytearray()
    for c in range(len(bounds) + 1):
        in_class = cls_changed == c
        chosen = changed[in_class]
        write_varint(table, chosen.size)
        if chosen.size == 0:
            continue
        g = gaps(np.searchsorted(_class_members(e, bounds, c), chosen))
        k, _ = best_rice_k(g)
        positions.add(g, k)
        table.append(k)
        move = ordered(new[chosen]).astype(np.int64) - ordered(base[chosen]).astype(np.int64)
        signs.append(move > 0)
        mode_table, segments = _magnitude_code((np.abs(move) - 1).astype(np.uint64), e_changed[in_class])
        magnitude_table += mode_table
        for values, k in segments:
            magnitudes.add(values, k)
    streams = [*positions.finish(), *magnitudes.finish()]
    out = table + magnitude_table
    for stream in streams:
        write_varint(out, len(stream))
    for stream in streams:
        out += stream
    out += np.packbits(np.concatenate(signs)).tobytes()
    return bytes(out)


def _decode_sparse(payload: memoryview, base: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    r = Reader(payload)
    num_classes = r.byte()
    if not 1 <= num_classes <= MAX_CLASSES:
        raise ValueError(f"sparse payload has {num_classes} classes")
    bounds = [r.varint() for _ in range(num_classes - 1)]
    counts, position_segments = [], []
    for _ in range(num_classes):
        counts.append(r.varint())
        if counts[-1]:
            position_segments.append((counts[-1], r.byte()))
    modes = []
    for n in counts:
        if n == 0:
            continue
        mode = r.byte()
        if mode == 0:
            modes.append((0, 0, 0, 0))
        elif mode == 1:
            modes.append((1, r.varint(), 0, 0))
        elif mode == 2:
            nb = r.varint()
            if nb > n or nb == 0:
                raise ValueError("sparse payload: bad count of large moves")
            modes.append((2, nb, r.byte(), r.byte()))
        else:
            raise ValueError(f"sparse payload: unknown magnitude mode {mode}")
    lengths = [r.varint() for _ in range(4)]
    streams = [r.take(n) for n in lengths]
    total = sum(counts)
    signs = np.unpackbits(np.frombuffer(r.take((total + 7) // 8), dtype=np.uint8))[:total].astype(bool)
    if r.pos != len(payload):
        raise ValueError("sparse payload has trailing bytes")
    e = _exponents(base, fmt)
    gap_lists = iter(rice_read(streams[0], streams[1], position_segments))
    positions, magnitude_segments, plans = [], [], []
    for c, n in enumerate(counts):
        if n == 0:
            continue
        ranks = ranks_from_gaps(next(gap_lists))
        members = _class_members(e, bounds, c)
        if ranks[-1] >= members.size:
            raise ValueError("sparse payload points past the end of an exponent class")
        positions.append(members[ranks])
    for pos, (mode, a_or_nb, kg, kv) in zip(positions, modes):
        if mode == 1:
            order, segments = _by_k(_adaptive_ks(a_or_nb, e[pos]))
            plans.append((mode, order, len(segments)))
            magnitude_segments += segments
        elif mode == 2:
            plans.append((mode, None, 2))
            magnitude_segments += [(a_or_nb, kg), (a_or_nb, kv)]
        else:
            plans.append((mode, None, 0))
    values = iter(rice_read(streams[2], streams[3], magnitude_segments))
    mags = []
    for pos, (mode, order, num_segments) in zip(positions, plans):
        mag = np.zeros(pos.size, dtype=np.uint64)
        if mode == 1:
            mag[order] = np.concatenate([next(values) for _ in range(num_segments)])
        elif mode == 2:
            big = ranks_from_gaps(next(values))
            if big[-1] >= pos.size:
                raise ValueError("sparse payload: a large move points past its class")
            mag[big] = next(values) + np.uint64(1)
        mags.append(mag)
    new = base.copy()
    if total:
        pos = np.concatenate(positions)
        move = np.concatenate(mags).astype(np.int64) + 1
        key = ordered(base[pos]).astype(np.int64) + np.where(signs, move, -move)
        new[pos] = ordered(key.astype(base.dtype))
    return new


# ---------------------------------------------------------------------------------------------- dense

def _zigzag(x: np.ndarray) -> np.ndarray:
    nbits = x.dtype.itemsize * 8
    unsigned = np.dtype(f"u{x.dtype.itemsize}")
    return ((x << 1) ^ (x >> (nbits - 1))).view(unsigned)


def _unzigzag(z: np.ndarray, signed: np.dtype) -> np.ndarray:
    return ((z >> 1) ^ (np.zeros_like(z) - (z & 1))).view(signed)


def _encode_dense(base: np.ndarray, new: np.ndarray) -> bytes:
    move = ordered(new) - ordered(base)  # wraps modulo 2^bits: still invertible
    planes = _zigzag(move).view(np.uint8).reshape(-1, move.dtype.itemsize).T
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(np.ascontiguousarray(planes).tobytes())


def _decode_dense(payload: memoryview, base: np.ndarray) -> np.ndarray:
    width = base.dtype.itemsize
    try:
        raw = zstandard.ZstdDecompressor().decompress(bytes(payload), max_output_size=base.size * width)
    except zstandard.ZstdError as exc:
        raise ValueError(f"dense payload does not decompress: {exc}") from exc
    if len(raw) != base.size * width:
        raise ValueError("dense payload has the wrong length")
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(width, -1)
    z = np.ascontiguousarray(planes.T).view(np.dtype(f"u{width}")).reshape(-1)
    return ordered(ordered(base) + _unzigzag(z, base.dtype))


# ---------------------------------------------------------------------------------------------- api

def encode_change(base: np.ndarray, new: np.ndarray, fmt: FloatFormat,
                  max_classes: int = MAX_CLASSES) -> tuple[int, bytes]:
    """(codec, payload) of the smallest lossless encoding of `new` given `base` (same bit-view arrays).

    max_classes=1 turns the exponent context off (the benchmark's ablation).
    """
    assert base.shape == new.shape and base.dtype == new.dtype
    changed = np.flatnonzero(base != new)
    if changed.size == 0:
        return SAME, b""
    best = (RAW, new.tobytes())
    fraction = changed.size / new.size
    if fraction <= SPARSE_MAX_FRACTION:
        payload = _encode_sparse(base, new, changed, fmt, max_classes)
        if len(payload) < len(best[1]):
            best = (SPARSE, payload)
    if fraction >= DENSE_MIN_FRACTION:
        payload = _encode_dense(base, new)
        if len(payload) < len(best[1]):
            best = (DENSE, payload)
    return best


def decode_change(codec: int, payload: memoryview, base: np.ndarray | None, fmt: FloatFormat,
                  numel: int) -> np.ndarray:
    """The new bit-view array; ValueError on a malformed payload (a digest check follows anyway)."""
    int_dtype = np.dtype(fmt.int_dtype)
    if codec == RAW:
        if len(payload) != numel * int_dtype.itemsize:
            raise ValueError(f"raw payload has {len(payload)} bytes, expected {numel * int_dtype.itemsize}")
        return np.frombuffer(payload, dtype=int_dtype).copy()
    if base is None:
        raise ValueError(f"a {CODEC_NAMES.get(codec, codec)} tensor needs its base")
    if codec == SAME:
        if len(payload):
            raise ValueError("an unchanged tensor carries a payload")
        return base
    if codec == SPARSE:
        return _decode_sparse(payload, base, fmt)
    if codec == DENSE:
        return _decode_dense(payload, base)
    raise ValueError(f"unknown tensor codec {codec}")
