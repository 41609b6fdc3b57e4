"""The weight delta codec: bit-exact on random and real changes, small on real ones, and every
integrity fault (flipped byte, truncation, wrong base, wrong order) rejected before it is applied."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from realtime_rl.deploy import (
    DeltaError, OutOfOrder, WeightState, decode, encode_delta, encode_snapshot, read_header,
)
from realtime_rl.deploy import delta
from realtime_rl.deploy import tensor_codec as tc
from realtime_rl.deploy.bits import RiceWriter, best_rice_k, rice_read
from realtime_rl.model import Qwen3ForCausalLM
from tests.conftest import tiny_config

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def bits(t: torch.Tensor) -> np.ndarray:
    return tc.bit_view(t).copy()


def assert_same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert np.array_equal(bits(a[name]), bits(b[name])), name


def roundtrip(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> bytes:
    base, target = WeightState.of(old, 3), WeightState.of(new, 4)
    blob = encode_delta(base, target)
    rebuilt = decode(blob, base)
    assert rebuilt.version == 4 and rebuilt.digests == target.digests
    assert_same_bits(rebuilt.tensors, new)
    assert_same_bits(decode(encode_snapshot(target)).tensors, new)
    return blob


def moved(t: torch.Tensor, index: np.ndarray, steps: np.ndarray) -> torch.Tensor:
    """`t` with the elements at `index` moved by `steps` rounding steps (ulps, in float order)."""
    b = bits(t)
    key = tc.ordered(b[index]).astype(np.int64) + steps
    info = np.iinfo(b.dtype)
    b[index] = tc.ordered(np.clip(key, info.min, info.max).astype(b.dtype))
    return torch.from_numpy(b).view(t.dtype).reshape(t.shape)


@st.composite
def changes(draw):
    """A random state (dtypes, shapes, scales) and a new version: sparse ulp moves, arbitrary bit
    patterns (NaN, inf, sign flips), dense changes, unchanged, added and reshaped tensors."""
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    old, new = {}, {}
    for i in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 40), min_size=0, max_size=3)))
        scale = draw(st.sampled_from([1e-3, 0.02, 1.0, 300.0]))
        t = (torch.from_numpy(rng.standard_normal(shape).astype(np.float32)) * scale).to(dtype)
        n = t.numel()
        kind = draw(st.sampled_from(["ulps", "ulps", "bits", "dense", "same", "new", "reshape"]))
        name = f"layer{i}.weight"
        if kind == "new":
            new[name] = t
            continue
        old[name] = t
        if kind == "same" or n == 0:
            new[name] = t.clone()
        elif kind == "reshape":
            new[name] = t.reshape(-1).clone()
        elif kind == "bits":
            b = bits(t)
            idx = rng.choice(n, size=draw(st.integers(1, n)), replace=False)
            b[idx] = rng.integers(np.iinfo(b.dtype).min, np.iinfo(b.dtype).max, size=idx.size, dtype=b.dtype)
            new[name] = torch.from_numpy(b).view(dtype).reshape(shape)
        else:
            fraction = 1.0 if kind == "dense" else draw(st.sampled_from([0.001, 0.01, 0.1, 0.3]))
            idx = np.flatnonzero(rng.random(n) < fraction)
            steps = rng.choice([-3, -2, -1, 1, 1, 2, 40], size=idx.size)
            new[name] = moved(t, idx, steps)
    return old, new


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes())
def test_random_changes_roundtrip_bit_exact(change):
    old, new = change
    roundtrip(old, new)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fraction", [0.0, 0.002, 0.01, 0.05, 0.5, 1.0])
def test_rounding_step_changes_roundtrip_and_pick_a_fitting_codec(dtype, fraction):
    rng = np.random.default_rng(0)
    t = (torch.randn(300, 257) * 0.02).to(dtype)
    idx = np.flatnonzero(rng.random(t.numel()) < fraction)
    new = moved(t, idx, rng.choice([-1, 1], size=idx.size))
    blob = roundtrip({"w": t}, {"w": new})
    codec = read_header(blob).tensors[0][3]
    expected = {0.0: tc.SAME, 0.002: tc.SPARSE, 0.01: tc.SPARSE, 0.05: tc.SPARSE}.get(fraction, tc.DENSE)
    assert codec == expected
    if 0 < fraction <= 0.01:
        # well under the peers' int32 index + value per changed element
        assert len(blob) < 0.5 * idx.size * (4 + t.element_size()) + 200


def test_rice_code_roundtrip_and_near_entropy_on_geometric_gaps():
    rng = np.random.default_rng(1)
    p = 0.01
    values = rng.geometric(p, size=20_000).astype(np.uint64) - 1
    k, cost = best_rice_k(values)
    entropy = -(p * np.log2(p) + (1 - p) * np.log2(1 - p)) / p * values.size
    assert cost < 1.03 * entropy
    writer = RiceWriter()
    writer.add(values, k)
    writer.add(np.array([0, 5, 1 << 33], dtype=np.uint64), 30)
    out = rice_read(*writer.finish(), [(values.size, k), (3, 30)])
    assert np.array_equal(out[0], values) and out[1].tolist() == [0, 5, 1 << 33]


def adamw_versions(lr: float, steps: int) -> list[dict[str, torch.Tensor]]:
    """bf16 views of fp32 master weights of a tiny Qwen3-MoE after real AdamW next-token steps."""
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_config(moe=True, initializer_range=0.02))
    model.reset_parameters(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    out = []
    for _ in range(steps + 1):
        out.append({n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()})
        ids = torch.randint(0, model.config.vocab_size, (4, 33))
        logits = model(ids[:, :-1]).logits_BTV
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return out


def test_real_adamw_steps_of_a_qwen3_model_roundtrip_and_beat_the_peers_encodings():
    versions = adamw_versions(lr=1e-6, steps=4)
    for old, new in zip(versions, versions[1:]):
        changed = sum(int((bits(old[n]) != bits(new[n])).sum()) for n in old)
        total = sum(t.numel() for t in old.values())
        assert 0.001 < changed / total < 0.2  # a real step changes some, not all, bf16 elements
        blob = roundtrip(old, new)
        int32_bf16 = changed * (4 + 2)
        assert len(blob) < 0.5 * int32_bf16


def test_header_names_versions_dtypes_shapes():
    a = {"x": torch.zeros(3, 4, dtype=torch.bfloat16), "y": torch.ones(5, dtype=torch.float32)}
    b = {"x": torch.ones(3, 4, dtype=torch.bfloat16), "y": torch.ones(5, dtype=torch.float32)}
    base, new = WeightState.of(a, 7), WeightState.of(b, 8)
    header = read_header(encode_delta(base, new))
    assert header.is_delta and (header.base_version, header.version) == (7, 8)
    assert header.base_digest == base.digest and header.state_digest == new.digest
    assert [(n, d, s, c) for n, d, s, c, _ in header.tensors] == [
        ("x", "bfloat16", (3, 4), tc.DENSE if header.tensors[0][3] == tc.DENSE else tc.RAW),
        ("y", "float32", (5,), tc.SAME)]
    snap = read_header(encode_snapshot(new))
    assert not snap.is_delta and snap.version == 8 and snap.base_digest == bytes(16)
    assert header.policy_version is None and decode(encode_delta(base, new), base).serves == 8
    relabelled = WeightState.of(a, 9, policy_version=7)  # v7's weights served again as store version 9
    state = decode(encode_delta(new, relabelled), new)
    assert (state.version, state.policy_version, state.serves) == (9, 7, 7)
    assert decode(encode_snapshot(relabelled)).serves == 7
    # A labelled blob is format 2 (a reader that cannot apply the label rejects it); unlabelled ones stay 1.
    assert encode_delta(new, relabelled)[4:6] == (2).to_bytes(2, "little")
    assert encode_delta(base, new)[4:6] == (1).to_bytes(2, "little")


@pytest.fixture(scope="module")
def real_pair():
    versions = adamw_versions(lr=1e-6, steps=2)
    base, new = WeightState.of(versions[1], 1), WeightState.of(versions[2], 2)
    return base, new, encode_delta(base, new)


def test_every_flipped_byte_is_rejected(real_pair):
    base, _, blob = real_pair
    rng = np.random.default_rng(0)
    for pos in list(rng.choice(len(blob), size=40, replace=False)) + [0, 5, 30, len(blob) - 1]:
        corrupt = bytearray(blob)
        corrupt[pos] ^= 1 << int(rng.integers(8))
        with pytest.raises(DeltaError):
            decode(bytes(corrupt), base)


def test_truncated_blobs_are_rejected(real_pair):
    base, _, blob = real_pair
    for cut in (0, 10, 60, len(blob) // 2, len(blob) - 1):
        with pytest.raises(DeltaError, match="short|checksum|truncated"):
            decode(blob[:cut], base)


def test_out_of_order_and_foreign_base_are_rejected(real_pair):
    base, new, blob = real_pair
    with pytest.raises(OutOfOrder, match="needs base version 1"):
        decode(blob, new)                        # a newer version
    with pytest.raises(OutOfOrder):
        decode(blob, None)
    other = WeightState.of({n: t + 1 for n, t in base.tensors.items()}, 1)
    with pytest.raises(OutOfOrder, match="other weights"):
        decode(blob, other)                      # same version number, different weights
    with pytest.raises(ValueError, match="forward"):
        encode_delta(new, base)


def test_an_unchanged_tensor_whose_base_has_the_same_bits_as_another_dtype_or_shape_is_rejected():
    """The digests hash bits only: a base holding an unchanged tensor's bytes as fp16 [4, 4] instead of bf16 [16]
    passes them, and the tensor came back reinterpreted under a state digest that matched."""
    w = torch.randn(16).to(torch.bfloat16)
    base = WeightState.of({"w": w, "b": torch.zeros(4)}, 1)
    blob = encode_delta(base, WeightState.of({"w": w, "b": torch.ones(4)}, 2))
    for other in (w.view(torch.float16).reshape(4, 4), w.reshape(4, 4)):
        with pytest.raises(DeltaError, match="w: marked unchanged"):
            decode(blob, WeightState.of({"w": other, "b": torch.zeros(4)}, 1))


def test_a_wrong_tensor_with_a_valid_trailer_fails_its_tensor_digest(real_pair):
    """Corruption before the trailer was computed (a codec bug, a bad disk at the publisher)."""
    base, _, blob = real_pair
    header = read_header(blob)
    start = header.payload_offset
    tampered = bytearray(blob[:-16])
    for i, (_, _, _, codec, length) in enumerate(header.tensors):
        if codec in (tc.SPARSE, tc.RAW) and length:
            off = start + sum(t[4] for t in header.tensors[:i])
            tampered[off + length - 1] ^= 0x80  # the first sign bit in the last byte, or a raw bit
            break
    tampered += hashlib.sha256(tampered).digest()[:16]
    with pytest.raises(DeltaError, match="fails its digest"):
        decode(bytes(tampered), base)


def test_a_header_with_a_negative_shape_is_a_delta_error():
    """A foreign or buggy writer's header, trailer intact: a torch error from reshape escaped the subscriber's
    fallback to a snapshot, which catches DeltaError."""
    blob = encode_snapshot(WeightState.of({"w": torch.ones(4)}, 1))
    fixed = delta._FIXED
    *head, header_len = fixed.unpack_from(blob)
    meta = json.loads(zstandard.ZstdDecompressor().decompress(blob[fixed.size:fixed.size + header_len]))
    meta["tensors"][0][2] = [-4]
    packed = zstandard.ZstdCompressor().compress(json.dumps(meta).encode())
    body = fixed.pack(*head, len(packed)) + packed + blob[fixed.size + header_len:-16]
    with pytest.raises(DeltaError, match="negative shape"):
        decode(body + hashlib.sha256(body).digest()[:16])


def test_non_float_tensors_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="bfloat16, float16 and float32"):
        WeightState.of({"steps": torch.zeros(3, dtype=torch.int64)}, 0)
