"""The gateway's weight follower: a version that fails to apply is retried, and the follower keeps going."""

from __future__ import annotations

import time

import torch

from realtime_rl.deploy import FilesystemTransport, WeightPublisher
from realtime_rl.serve.app import follow_weights


def test_a_version_that_fails_to_apply_is_retried_and_the_follower_keeps_following(tmp_path):
    publisher = WeightPublisher(FilesystemTransport(tmp_path), dtype=None)
    publisher.publish({"w": torch.zeros(4)}, 1)
    applied: list[int] = []

    def apply(state: dict[str, torch.Tensor], version: int) -> None:
        applied.append(version)
        if len(applied) == 1:  # staging the first version runs out of memory, say
            raise RuntimeError("CUDA out of memory")

    close = follow_weights(str(tmp_path), 0.02, apply, "test-follower")
    try:
        deadline = time.monotonic() + 30
        while applied[-1:] != [1] or len(applied) < 2:
            assert time.monotonic() < deadline, f"version 1 was not retried: {applied}"
            time.sleep(0.02)
        publisher.publish({"w": torch.ones(4)}, 2)
        while applied[-1] != 2:
            assert time.monotonic() < deadline, f"the follower stopped after a failed apply: {applied}"
            time.sleep(0.02)
    finally:
        close()
    assert applied[:2] == [1, 1]
