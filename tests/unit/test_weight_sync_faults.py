"""Weight sync when a step fails halfway: a publish that raised but landed anyway, a retry of it, and a poll
that verifies only part of the chain. Tiny tensors, a filesystem store; runs in about a second."""

from __future__ import annotations

import time

import pytest
import torch

from realtime_rl.deploy import (
    AlreadyPublished, FilesystemTransport, TransportError, WeightPublisher, WeightState, WeightSubscriber,
    WeightSyncError,
)
from realtime_rl.deploy.transports import filesystem


def weights(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.linspace(-1, 1, 64) * (1 + step / 8), "b": torch.full((8,), float(step))}


def bf16_state(step: int) -> WeightState:
    return WeightState.of({k: v.to(torch.bfloat16) for k, v in weights(step).items()}, step, workers=1)


def test_after_a_publish_that_timed_out_but_landed_every_subscriber_reaches_the_next_version(tmp_path,
                                                                                               monkeypatch):
    transport = FilesystemTransport(tmp_path, timeout_s=10)
    publisher = WeightPublisher(transport, snapshot_every=100, workers=1)
    behind, on_late = WeightSubscriber(transport, workers=1), WeightSubscriber(transport, workers=1)
    for v in (0, 1):
        publisher.publish(weights(v), v)
    assert behind.poll() == 1 and on_late.poll() == 1
    fsync_path = filesystem.fsync_path
    monkeypatch.setattr(filesystem, "fsync_path", lambda p: (time.sleep(0.3), fsync_path(p)))  # a slow NFS
    transport.timeout_s = 0.1
    with pytest.raises(TransportError, match="did not finish within"):
        publisher.publish(weights(2), 2)
    deadline = time.monotonic() + 10
    while 2 not in transport.versions():  # the writer thread goes on and renames version 2 into place
        assert time.monotonic() < deadline, "the timed-out publish never landed"
        time.sleep(0.05)
    monkeypatch.setattr(filesystem, "fsync_path", fsync_path)
    transport.timeout_s = 10
    assert on_late.poll() == 2  # a subscriber took the version its publisher counts as failed
    with pytest.raises(AlreadyPublished, match="version 2"):
        publisher.publish(weights(2), 2)  # the retry learns that it landed
    stats = publisher.publish(weights(3), 3)
    assert stats.bytes_snapshot is not None and stats.bytes_delta is not None
    for subscriber in (on_late, behind):  # a delta from 1 cannot move 2 on; the snapshot beside it does
        assert subscriber.poll() == 3 and subscriber.state.digests == publisher.last.digests
    assert publisher.publish(weights(4), 4).bytes_snapshot is None  # back to deltas once a publish succeeds
    assert on_late.poll() == 4


def test_a_publish_that_failed_without_landing_can_be_retried(tmp_path, monkeypatch):
    transport = FilesystemTransport(tmp_path)
    publisher = WeightPublisher(transport, snapshot_every=100, workers=1)
    subscriber = WeightSubscriber(transport, workers=1)
    publisher.publish(weights(0), 0)
    assert subscriber.poll() == 0
    publish = transport.publish

    def refuse(version, blobs):
        raise TransportError(f"publishing version {version}: connection refused")

    monkeypatch.setattr(transport, "publish", refuse)
    with pytest.raises(TransportError, match="connection refused"):
        publisher.publish(weights(1), 1)
    monkeypatch.setattr(transport, "publish", publish)
    stats = publisher.publish(weights(1), 1)
    assert stats.bytes_delta is not None and stats.bytes_snapshot is not None
    assert subscriber.poll() == 1 and subscriber.state.digests == publisher.last.digests


def test_a_poll_that_stops_partway_applies_the_furthest_verified_version_then_raises(tmp_path):
    transport = FilesystemTransport(tmp_path)
    publisher = WeightPublisher(transport, snapshot_every=100, workers=1)
    applied = []
    subscriber = WeightSubscriber(transport, apply=lambda state, version: applied.append(version), workers=1)
    publisher.publish(weights(0), 0)
    assert subscriber.poll() == 0
    for v in (1, 2, 3):
        publisher.publish(weights(v), v)
    path = transport.blob_path(2, "delta")
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x04
    path.write_bytes(bytes(blob))
    with pytest.raises(WeightSyncError, match="reached version 1, not 3.*delta 2 rejected"):
        subscriber.poll()
    assert applied == [0, 1] and subscriber.version == 1
    assert subscriber.state.digests == bf16_state(1).digests


def test_a_follower_survives_an_error_nobody_expected_and_catches_up(tmp_path, monkeypatch):
    import threading

    transport = FilesystemTransport(tmp_path, timeout_s=10)
    publisher = WeightPublisher(transport, snapshot_every=100, workers=1)
    applied: list[int] = []
    follower = WeightSubscriber(transport, apply=lambda state, version: applied.append(version), workers=1)
    publisher.publish(weights(0), 0)
    listing, failures = transport.versions, iter([RuntimeError("a bug in a listing"), KeyError("versions")])

    def flaky():
        error = next(failures, None)
        if error is not None:
            raise error
        return listing()

    monkeypatch.setattr(transport, "versions", flaky)
    stop = threading.Event()
    thread = threading.Thread(target=follower.run, args=(stop, 0.01), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not applied:
            assert thread.is_alive(), "the follower died on the error"
            assert time.monotonic() < deadline, "the follower never caught up"
            time.sleep(0.01)
        publisher.publish(weights(1), 1)
        while applied[-1] != 1:  # and it keeps following
            assert time.monotonic() < deadline, "the follower stopped following"
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join(timeout=10)
