"""Lossless weight deltas and snapshots: the wire format, chained by version and checked end to end.

    base = WeightState.of(tensors_v11, version=11)          # digests every tensor once
    new = WeightState.of(tensors_v12, version=12)
    blob = encode_delta(base, new)                          # ~1/130 of the bf16 bytes at ~2% changed
    assert decode(blob, base).digests == new.digests        # bit-exact, verified tensor by tensor
    snap = encode_snapshot(new)                             # full weights; decode(snap) needs no base

A blob (all integers little-endian):

    offset  size  field
    0       4     magic b"RTWS"
    4       2     format version (1; 2 when the header carries a policy_version)
    6       1     kind: 0 snapshot, 1 delta
    7       1     reserved, 0
    8       8     version (u64)
    16      8     base version (u64; equals version in a snapshot)
    24      16    digest of the base state (zeros in a snapshot)
    40      16    digest of the state this blob rebuilds
    56      4     header length H (u32)
    60      H     zstd-compressed JSON {"tensors": [[name, dtype, shape, codec, payload bytes], ...],
                  "policy_version": N (optional)}
    60+H    16*T  digest of every rebuilt tensor, in header order
    ...           tensor payloads, in header order (codecs: tensor_codec.py)
    end-16  16    digest of everything before it

A digest is the first 16 bytes of SHA-256: of a tensor's bytes (C order, little-endian) for a tensor,
of the names and tensor digests for a state. The trailer rejects a truncated or altered blob before
any decoding; the base digest rejects a delta applied to the wrong weights; the tensor digests
prove the rebuilt weights bit-exact. Every failure raises DeltaError and leaves the base untouched:
decoding writes new arrays and shares only the tensors a delta leaves unchanged.

`version` orders the store: it only increases, and a delta goes from one version to a later one.
`policy_version` names the policy these weights are, where that differs from `version`: a live version
rolled back in the registry is served again by publishing its weights as a new store version labelled
with its own policy version (the subscriber hands the label to the engine, which stamps it on tokens).

Not here: which blobs exist and where (transports/), the snapshot-every-N policy (sync.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from realtime_rl.deploy import tensor_codec as tc

MAGIC = b"RTWS"
FORMAT_VERSION = 1
FORMAT_LABELLED = 2
"""Written when the header carries a policy_version, so that a reader too old to apply the label rejects the
blob instead of stamping the store version on tokens."""
SNAPSHOT, DELTA = 0, 1
DIGEST_BYTES = 16
_FIXED = struct.Struct("<4sHBBQQ16s16sI")
WORKERS = min(4, os.cpu_count() or 1)


class DeltaError(ValueError):
    """A blob that is corrupt, truncated, out of order or for other base weights: it was not applied."""


class OutOfOrder(DeltaError):
    """A sound delta whose base is not the given state (another version, or other weights)."""


def tensor_digest(t: torch.Tensor) -> bytes:
    return hashlib.sha256(tc.bit_view(t)).digest()[:DIGEST_BYTES]


def state_digest(digests: Mapping[str, bytes]) -> bytes:
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(name.encode())
        h.update(b"\0")
        h.update(digests[name])
    return h.digest()[:DIGEST_BYTES]


def _map(fn, items: list, workers: int) -> list:
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(workers) as pool:  # numpy, hashlib and zstd release the GIL
        return list(pool.map(fn, items))


@dataclass(frozen=True)
class WeightState:
    """One version of the published weights and the digest of every tensor.

    Tensors are CPU, contiguous and never modified in place (states share unchanged tensors). `of`
    does not copy CPU tensors: pass tensors nothing will modify (the publisher passes copies).
    """

    version: int
    tensors: dict[str, torch.Tensor]
    digests: dict[str, bytes]
    policy_version: int | None = None
    """The policy these weights are, when not `version` (a rollback re-published under a new store version)."""

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor], version: int, workers: int = WORKERS,
           policy_version: int | None = None) -> WeightState:
        if version < 0 or (policy_version is not None and policy_version < 0):
            raise ValueError(f"versions must be >= 0, got {version} (policy version {policy_version})")
        owned = {}
        for name, t in tensors.items():
            tc.float_format(t.dtype)
            owned[name] = t.detach().cpu().contiguous()
        digests = _map(tensor_digest, list(owned.values()), workers)
        return cls(version, owned, dict(zip(owned, digests)), policy_version)

    @property
    def serves(self) -> int:
        """The policy version to stamp on what these weights generate."""
        return self.version if self.policy_version is None else self.policy_version

    @property
    def digest(self) -> bytes:
        return state_digest(self.digests)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class BlobHeader:
    kind: int
    version: int
    base_version: int
    base_digest: bytes
    state_digest: bytes
    tensors: list[tuple[str, str, tuple[int, ...], int, int]]
    """(name, dtype, shape, codec, payload length) in payload order."""
    digests: list[bytes]
    payload_offset: int
    policy_version: int | None = None

    @property
    def is_delta(self) -> bool:
        return self.kind == DELTA


def _pack(kind: int, state: WeightState, base: WeightState | None, entries: list,
          payloads: list[bytes]) -> bytes:
    meta: dict = {"tensors": entries}
    if state.policy_version is not None:
        meta["policy_version"] = state.policy_version
    header = zstandard.ZstdCompressor(level=19).compress(json.dumps(meta).encode())
    fmt = FORMAT_VERSION if state.policy_version is None else FORMAT_LABELLED
    fixed = _FIXED.pack(MAGIC, fmt, kind, 0, state.version,
                        base.version if base is not None else state.version,
                        base.digest if base is not None else bytes(DIGEST_BYTES), state.digest, len(header))
    body = b"".join([fixed, header, *(state.digests[e[0]] for e in entries), *payloads])
    return body + hashlib.sha256(body).digest()[:DIGEST_BYTES]


def encode_snapshot(state: WeightState) -> bytes:
    entries, payloads = [], []
    for name, t in state.tensors.items():
        payloads.append(tc.bit_view(t).tobytes())
        entries.append([name, tc.float_format(t.dtype).name, list(t.shape), tc.RAW, len(payloads[-1])])
    return _pack(SNAPSHOT, state, None, entries, payloads)


def encode_delta(base: WeightState, state: WeightState, workers: int = WORKERS) -> bytes:
    """The delta that rebuilds `state` from `base`; tensors new to `base` or reshaped travel raw."""
    if state.version <= base.version:
        raise ValueError(f"a delta goes forward: base version {base.version}, new version {state.version}")

    def one(name: str) -> tuple[int, bytes]:
        t = state.tensors[name]
        fmt = tc.float_format(t.dtype)
        old = base.tensors.get(name)
        if old is None or old.dtype != t.dtype or old.shape != t.shape:
            return tc.RAW, tc.bit_view(t).tobytes()
        if base.digests[name] == state.digests[name]:
            return tc.SAME, b""
        return tc.encode_change(tc.bit_view(old), tc.bit_view(t), fmt)

    names = list(state.tensors)
    coded = _map(one, names, workers)
    entries = [[n, tc.float_format(state.tensors[n].dtype).name, list(state.tensors[n].shape), codec, len(p)]
               for n, (codec, p) in zip(names, coded)]
    return _pack(DELTA, state, base, entries, [p for _, p in coded])


def read_header(blob: bytes | memoryview) -> BlobHeader:
    """Check the framing and the trailer digest, then parse the header; DeltaError if anything is off."""
    blob = memoryview(blob)
    if len(blob) < _FIXED.size + DIGEST_BYTES:
        raise DeltaError(f"blob of {len(blob)} bytes is too short to be a weight blob (truncated?)")
    magic, fmt_version, kind, _, version, base_version, base_dig, state_dig, header_len = \
        _FIXED.unpack_from(blob)
    if magic != MAGIC:
        raise DeltaError(f"not a weight blob: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if fmt_version not in (FORMAT_VERSION, FORMAT_LABELLED):
        raise DeltaError(f"weight blob format {fmt_version}; this reader knows formats {FORMAT_VERSION} and "
                         f"{FORMAT_LABELLED}")
    if hashlib.sha256(blob[:-DIGEST_BYTES]).digest()[:DIGEST_BYTES] != bytes(blob[-DIGEST_BYTES:]):
        raise DeltaError(f"weight blob for version {version} fails its checksum: "
                         "truncated or altered in transit")
    if kind not in (SNAPSHOT, DELTA):
        raise DeltaError(f"unknown blob kind {kind}")
    try:
        start = _FIXED.size
        meta = json.loads(zstandard.ZstdDecompressor().decompress(bytes(blob[start:start + header_len])))
        tensors = [(str(n), str(d), tuple(int(s) for s in shape), int(c), int(ln))
                   for n, d, shape, c, ln in meta["tensors"]]
        policy_version = None if meta.get("policy_version") is None else int(meta["policy_version"])
    except (zstandard.ZstdError, ValueError, KeyError, TypeError) as exc:
        raise DeltaError(f"weight blob header does not parse: {exc}") from exc
    if any(min((*shape, length)) < 0 for _, _, shape, _, length in tensors):  # a writer's bug, not a torch error
        raise DeltaError("weight blob header names a negative shape or length")
    at = start + header_len
    digests = [bytes(blob[at + i * DIGEST_BYTES: at + (i + 1) * DIGEST_BYTES]) for i in range(len(tensors))]
    payload_offset = at + len(tensors) * DIGEST_BYTES
    if payload_offset + sum(t[4] for t in tensors) + DIGEST_BYTES != len(blob):
        raise DeltaError("weight blob length does not match its header")
    return BlobHeader(kind, version, base_version, bytes(base_dig), bytes(state_dig), tensors, digests,
                      payload_offset, policy_version)


def decode(blob: bytes | memoryview, base: WeightState | None = None, workers: int = WORKERS) -> WeightState:
    """Rebuild the state a blob describes (a delta needs its base) and verify every tensor's digest."""
    blob = memoryview(blob)
    header = read_header(blob)
    if header.is_delta:
        step = f"delta {header.base_version}->{header.version}"
        if base is None:
            raise OutOfOrder(f"{step} needs base version {header.base_version}")
        if base.version != header.base_version:
            raise OutOfOrder(f"out of order: {step} needs base version {header.base_version}, "
                             f"the live weights are version {base.version}")
        if base.digest != header.base_digest:
            raise OutOfOrder(f"{step} was made from other weights than the live version {base.version} "
                             "(base digest differs)")
    jobs, offset = [], header.payload_offset
    for (name, dtype, shape, codec, length), digest in zip(header.tensors, header.digests):
        jobs.append((name, dtype, shape, codec, blob[offset:offset + length], digest))
        offset += length

    def one(job) -> tuple[torch.Tensor, bytes]:
        name, dtype, shape, codec, payload, digest = job
        if dtype not in tc.FORMATS:
            raise DeltaError(f"{name}: unknown dtype {dtype}")
        fmt = tc.FORMATS[dtype]
        old = base.tensors.get(name) if header.is_delta and base is not None else None
        if codec == tc.SAME:
            # the digests hash bits only: the same bytes as another dtype or shape would pass them
            if (old is None or base is None or base.digests[name] != digest or len(payload)
                    or old.dtype != fmt.torch_dtype or tuple(old.shape) != shape):
                raise DeltaError(f"{name}: marked unchanged but the base differs")
            return old, digest
        if old is not None and (old.dtype != fmt.torch_dtype or tuple(old.shape) != shape):
            old = None
        numel = int(np.prod(shape, dtype=np.int64))
        try:
            bits = tc.decode_change(codec, payload, tc.bit_view(old) if old is not None else None, fmt, numel)
        except ValueError as exc:
            raise DeltaError(f"{name}: {exc}") from exc
        if hashlib.sha256(bits).digest()[:DIGEST_BYTES] != digest:
            raise DeltaError(f"{name}: rebuilt tensor fails its digest (version {header.version})")
        t = torch.from_numpy(bits).view(fmt.torch_dtype).reshape(shape)
        return t, digest

    results = _map(one, jobs, workers)
    tensors = {job[0]: t for job, (t, _) in zip(jobs, results)}
    digests = {job[0]: d for job, (_, d) in zip(jobs, results)}
    if state_digest(digests) != header.state_digest:
        raise DeltaError(f"version {header.version}: state digest differs from the header")
    return WeightState(header.version, tensors, digests, header.policy_version)
