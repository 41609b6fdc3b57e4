"""Trainer to engine through the weight sync path: real AdamW steps published as deltas, applied to
a serving engine between decode steps; corrupt, truncated and missing versions never reach the
engine; a subscriber that fell behind catches up from a snapshot; the same over real HTTP and Ray."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F
import uvicorn

from realtime_rl.deploy import (
    FilesystemTransport, HttpTransport, TransportError, WeightPublisher, WeightSubscriber, WeightSyncError,
    create_weights_app,
)
from realtime_rl.engine import Engine, SamplingParams
from realtime_rl.model import Qwen3ForCausalLM
from tests.conftest import tiny_config


class Trainer:
    """A tiny Qwen3-MoE with fp32 master weights, stepped by AdamW on next-token loss."""

    def __init__(self, lr: float = 1e-4) -> None:
        self.model = Qwen3ForCausalLM(tiny_config(moe=True))
        self.model.reset_parameters(seed=0)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.gen = torch.Generator().manual_seed(0)

    def step(self) -> None:
        ids = torch.randint(0, self.model.config.vocab_size, (4, 17), generator=self.gen)
        logits = self.model(ids[:, :-1]).logits_BTV
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())


def serving_engine(trainer: Trainer) -> Engine:
    model = Qwen3ForCausalLM(trainer.model.config)
    model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in trainer.model.state_dict().items()})
    return Engine(model, max_batch=4, max_seq_len=64)


def assert_engine_serves(engine: Engine, trainer_params: dict[str, torch.Tensor]) -> None:
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, trainer_params[name].detach().to(torch.bfloat16).float()), name


def test_trainer_to_engine_swaps_between_decode_steps_with_requests_in_flight(tmp_path):
    trainer = Trainer()
    engine = serving_engine(trainer)
    transport = FilesystemTransport(tmp_path)
    publisher = WeightPublisher(transport, snapshot_every=5)
    subscriber = WeightSubscriber(transport, apply=engine.update_weights)
    publisher.publish(trainer.params(), 0)
    assert subscriber.poll() == 0 and subscriber.poll() is None
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for _ in range(2):
        engine.add_request([1, 2, 3, 4], params)
    for _ in range(4):
        engine.step()
    for version in (1, 2, 3):
        trainer.step()
        stats = publisher.publish(trainer.params(), version)
        assert stats.bytes_delta is not None and stats.ratio > 1.5
    assert subscriber.poll() == 3                  # three deltas, verified, handed to the engine
    finished = []
    while engine.has_work():
        finished += engine.step()
    assert engine.version == 3 and len(finished) == 2
    for out in finished:
        versions = out.samples[0].versions
        assert len(versions) == 12 and versions[0] == 0 and versions[-1] == 3   # frozen, not dropped
    assert_engine_serves(engine, trainer.params())


def publish_versions(tmp_path, n: int, **kwargs):
    trainer = Trainer()
    transport = FilesystemTransport(tmp_path)
    publisher = WeightPublisher(transport, **kwargs)
    for v in range(n):
        if v:
            trainer.step()
        publisher.publish(trainer.params(), v)
    return trainer, transport, publisher


@pytest.mark.parametrize("fault", ["flip", "truncate", "skip"])
def test_a_bad_or_missing_delta_never_reaches_the_engine(tmp_path, fault):
    trainer = Trainer()
    engine = serving_engine(trainer)
    transport = FilesystemTransport(tmp_path)
    publisher = WeightPublisher(transport, snapshot_every=100)
    subscriber = WeightSubscriber(transport, apply=engine.update_weights)
    publisher.publish(trainer.params(), 0)
    subscriber.poll()
    engine.step()
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    trainer.step()
    publisher.publish(trainer.params(), 1)
    path = transport.blob_path(1, "delta")
    data = bytearray(path.read_bytes())
    if fault == "flip":
        data[len(data) // 2] ^= 0x04
        path.write_bytes(bytes(data))
    elif fault == "truncate":
        path.write_bytes(bytes(data[: len(data) - 100]))
    else:
        transport.remove(1)
    trainer.step()
    publisher.publish(trainer.params(), 2)
    expected = {"flip": "checksum", "truncate": "checksum", "skip": "needs base version 1"}[fault]
    with pytest.raises(WeightSyncError, match=expected):
        subscriber.poll()
    engine.step()
    assert subscriber.version == 0 and engine.version == 0
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, before[name]), name          # the old weights keep serving
    out = engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert out[0].samples[0].versions == [0] * 4
    # a snapshot past the damage heals it
    trainer.step()
    publisher.snapshot_every = 1
    publisher.publish(trainer.params(), 3)
    assert subscriber.poll() == 3
    engine.step()
    assert_engine_serves(engine, trainer.params())


def test_a_subscriber_that_fell_behind_catches_up_from_the_last_snapshot(tmp_path):
    trainer, transport, publisher = publish_versions(tmp_path, 14, snapshot_every=4, keep_snapshots=1)
    assert sorted(transport.versions()) == [12, 13]          # older versions were pruned
    fetched = []
    original_fetch = transport.fetch
    transport.fetch = lambda v, kind: fetched.append((v, kind)) or original_fetch(v, kind)
    late = WeightSubscriber(transport)
    assert late.poll() == 13
    assert fetched == [(12, "snapshot"), (13, "delta")]
    assert late.state.digests == publisher.last.digests
    for name, t in late.state.tensors.items():
        assert torch.equal(t, trainer.params()[name].detach().to(torch.bfloat16)), name


def test_a_subscriber_prefers_the_chain_and_jumps_to_a_snapshot_when_it_is_too_long(tmp_path):
    trainer, transport, publisher = publish_versions(tmp_path, 3, snapshot_every=100)
    sub = WeightSubscriber(transport)
    assert sub.poll() == 2
    for v in range(3, 10):
        trainer.step()
        publisher.snapshot_every = 1 if v == 8 else 100
        publisher.publish(trainer.params(), v)
    fetched = []
    original_fetch = transport.fetch
    transport.fetch = lambda v, kind: fetched.append((v, kind)) or original_fetch(v, kind)
    sub.max_chain = 3
    assert sub.poll() == 9
    assert fetched == [(8, "snapshot"), (9, "delta")]
    assert sub.state.digests == publisher.last.digests


def test_a_subscriber_too_far_behind_with_no_snapshot_to_jump_to_follows_the_chain(tmp_path):
    """It gave up ("more than max_chain") and stayed on its version until the next snapshot."""
    trainer, transport, publisher = publish_versions(tmp_path, 3, snapshot_every=100)
    sub = WeightSubscriber(transport)
    assert sub.poll() == 2
    for v in range(3, 8):
        trainer.step()
        publisher.publish(trainer.params(), v)
    sub.max_chain = 3
    assert sub.poll() == 7 and sub.state.digests == publisher.last.digests


def test_a_subscriber_that_keeps_failing_backs_off(monkeypatch):
    class Failing:
        calls: list[float] = []

        def versions(self):
            Failing.calls.append(time.monotonic())
            raise TransportError("the store is down")

    stop = threading.Event()
    threading.Timer(1.6, stop.set).start()
    WeightSubscriber(Failing()).run(stop, interval_s=0.1)
    gaps = [b - a for a, b in zip(Failing.calls, Failing.calls[1:])]
    assert len(Failing.calls) <= 6 and all(later > earlier for earlier, later in zip(gaps, gaps[1:]))  # 0.2, 0.4, ...


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_over_real_http_publish_and_catch_up(tmp_path):
    store = FilesystemTransport(tmp_path)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_weights_app(store, write_token="t0ken"), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        url = f"http://127.0.0.1:{port}"
        trainer = Trainer()
        publisher = WeightPublisher(HttpTransport(url, token="t0ken", timeout_s=10), snapshot_every=3)
        subscriber = WeightSubscriber(HttpTransport(url, timeout_s=10))
        for v in range(5):
            if v:
                trainer.step()
            publisher.publish(trainer.params(), v)
            if v in (0, 4):
                assert subscriber.poll() == v
        assert subscriber.state.digests == publisher.last.digests
        assert sorted(store.versions()) == [0, 1, 2, 3, 4]
    finally:
        server.should_exit = True
        thread.join(10)


def test_through_ray_between_processes():
    ray = pytest.importorskip("ray", reason="ray is an optional extra")
    from realtime_rl.deploy import RayTransport

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        transport = RayTransport(name="sync-test", timeout_s=60)

        @ray.remote
        def train_and_publish(versions: int) -> bytes:
            trainer = Trainer()
            publisher = WeightPublisher(RayTransport(name="sync-test", timeout_s=60), snapshot_every=10)
            for v in range(versions):
                if v:
                    trainer.step()
                publisher.publish(trainer.params(), v)
            return publisher.last.digest

        digest = ray.get(train_and_publish.remote(3), timeout=120)   # a trainer in another process
        subscriber = WeightSubscriber(transport)
        assert subscriber.poll() == 2 and subscriber.state.digest == digest
        transport.close()
    finally:
        if started:
            ray.shutdown()


@pytest.mark.slow
def test_bench_delta_quick_writes_json(tmp_path):
    out = tmp_path / "delta.json"
    command = [sys.executable, "-m", "realtime_rl.cli", "bench", "delta", "--quick", "--json", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    m = json.loads(out.read_text())["metrics"]
    for key in ("changed_fraction", "ratio", "ratio_int32_bf16", "ratio_xor_zstd", "entropy_bound_ratio",
                "encode_gb_per_s", "decode_gb_per_s", "swap_pause_ms", "bytes_full", "bytes_delta"):
        assert m[key] > 0, key
    assert 0.001 < m["changed_fraction"] < 0.2
    assert m["ratio"] > m["ratio_xor_zstd"] > m["ratio_int32_bf16"]      # ours beats both peers' encodings
    assert m["ratio"] > m["entropy_bound_ratio"]                          # and the order-0 bound
    assert m["fraction_of_entropy_bound"] >= 0.8                          # near the exponent-context bound
    assert m["alt_ours_ratio"] == max(v for k, v in m.items() if k.startswith("alt_"))

    rl = m["rl_steps"]                                                   # real steps of our RL trainer
    assert rl["steps"] == 2 and rl["parameters"] > 0 and rl["lr"] > 0
    assert len(rl["reward_mean"]) == 2 and len(rl["published_bytes_delta"]) == 2
    for precision in ("bf16", "fp32"):
        assert rl[precision]["pairs"], precision
        assert all(0 < p["changed_fraction"] <= 1 for p in rl[precision]["pairs"])
        assert rl[precision]["ratio"] > 1 and rl[precision]["ratio_xor_zstd"] > 1
    bf16 = rl["bf16"]
    assert bf16["entropy_bound_ratio"] > 1 and bf16["entropy_bound_ratio_exponent"] > 1
    assert bf16["ratio"] > bf16["ratio_xor_zstd"] > bf16["ratio_int32_bf16"]
    assert bf16["changed_fraction"] < rl["fp32"]["changed_fraction"]    # bf16 rounding hides most fp32 moves
    published = dict(zip(range(1, 3), rl["published_bytes_delta"]))     # the trainer's own delta files
    assert all(published[p["version"]] == p["bytes_delta"] for p in rl["fp32"]["pairs"])


def test_a_restarted_publisher_resumes_with_deltas(tmp_path):
    trainer, transport, _ = publish_versions(tmp_path, 3, snapshot_every=10)
    restarted = WeightPublisher(transport, snapshot_every=10)
    assert restarted.resume() == 2
    trainer.step()
    stats = restarted.publish(trainer.params(), 3)
    assert stats.bytes_delta is not None and stats.bytes_snapshot is None   # a delta, not a second snapshot
    subscriber = WeightSubscriber(transport)
    assert subscriber.poll() == 3 and subscriber.state.digests == restarted.last.digests
    assert WeightPublisher(FilesystemTransport(tmp_path / "empty")).resume() is None


def test_a_rolled_back_policy_is_served_again_as_a_new_store_version(tmp_path):
    """Store versions only increase; a rollback publishes the old policy's weights as the next store version,
    labelled with the old policy version: the engine swaps them in, stamps new tokens with that version and
    reuses no prefix the newer weights computed. A restarted publisher keeps the label."""
    trainer = Trainer()
    v0 = {k: v.detach().clone() for k, v in trainer.params().items()}
    engine = serving_engine(trainer)
    transport = FilesystemTransport(tmp_path)
    publisher = WeightPublisher(transport, snapshot_every=10)
    subscriber = WeightSubscriber(transport, apply=engine.update_weights)
    publisher.publish(v0, 0)
    trainer.step()
    publisher.publish(trainer.params(), 1)
    subscriber.poll()
    engine.step()
    assert engine.version == 1
    prompt = [1, 2, 3, 4, 5, 6]
    engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    stats = publisher.publish(v0, 2, policy_version=0)  # the rollback: store version 2 is policy 0
    assert stats.bytes_delta is not None and publisher.last.serves == 0
    assert subscriber.poll() == 2 and subscriber.state.policy_version == 0
    hits = engine.prefix_hit_tokens
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert engine.version == 0 and set(out.samples[0].versions) == {0}
    assert engine.prefix_hit_tokens == hits  # version 1 computed the cached prompt: not reused under version 0
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, v0[name].to(torch.bfloat16).float()), name
    restarted = WeightPublisher(transport, snapshot_every=10)
    assert restarted.resume() == 2 and restarted.last.serves == 0
    with pytest.raises(ValueError, match="versions must increase"):
        publisher.publish(v0, 2, policy_version=0)
