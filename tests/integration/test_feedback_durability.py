"""An acknowledged feedback event is on disk: `rtrl serve` (a real subprocess on 127.0.0.1) takes batches
from several client threads, is SIGKILLed mid-stream, and the store, opened afterwards, holds every
event the clients saw acknowledged (HTTP 200), exactly once. The gateway then restarts on the same store
and the clients re-send what was never acknowledged: every event sent is stored exactly once. Run on
SQLite and on Postgres."""

from __future__ import annotations

import threading
import time
from collections import Counter

import httpx
import pytest

from realtime_rl.bench.ingest import Gateway, batch_body, tiny_checkpoint
from realtime_rl.collect import open_event_store
from tests.stores import BACKENDS, store_location


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


def stored_ids(run_dir, location) -> Counter:
    with open_event_store(run_dir, location) as store:
        return Counter(e.event_id for e in store.list_events(limit=1_000_000))


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_acknowledged_event_survives_a_sigkill_under_load(backend, checkpoint, tmp_path):
    run_dir = tmp_path / "run"
    with store_location(backend, run_dir) as location:
        gateway = Gateway(checkpoint, run_dir, location)
        gateway.start()
        acked: set[str] = set()
        unacked: list[tuple[list[str], bytes]] = []  # batches whose answer never came
        errors: list[str] = []
        lock = threading.Lock()
        json_type = {"Content-Type": "application/json"}

        def client(c: int) -> None:
            with httpx.Client(base_url=gateway.url, headers=gateway.headers, timeout=30) as http:
                for i in range(100_000):
                    ids, body = batch_body(f"k{c}-{i}", 40)
                    try:
                        r = http.post("/v1/feedback", content=body, headers=json_type)
                        if r.status_code != 200:
                            errors.append(f"{r.status_code} {r.text[:200]}")
                            return
                        if i % 5 == 0:  # a retry of an acknowledged batch: duplicates, not new rows
                            again = http.post("/v1/feedback", content=body, headers=json_type)
                            if again.status_code != 200 or again.json()["stored"] != 0:
                                errors.append(f"retry: {again.status_code} {again.text[:200]}")
                    except httpx.TransportError:  # the gateway died under this request
                        with lock:
                            unacked.append((ids, body))
                        return
                    with lock:
                        acked.update(ids)

        threads = [threading.Thread(target=client, args=(c,)) for c in range(6)]
        try:
            for t in threads:
                t.start()
            deadline = time.monotonic() + 60
            while len(acked) < 3000 and time.monotonic() < deadline:
                time.sleep(0.02)
            gateway.kill()  # SIGKILL while the clients keep sending
            for t in threads:
                t.join(60)
        finally:
            gateway.kill()
        assert not any(t.is_alive() for t in threads) and not errors, errors
        assert len(acked) >= 3000 and unacked, "the kill must land while requests are in flight"

        after_kill = stored_ids(run_dir, location)
        assert not acked - after_kill.keys(), f"{len(acked - after_kill.keys())} acknowledged events were lost"
        assert max(after_kill.values()) == 1
        sent = acked | {i for ids, _ in unacked for i in ids}
        assert after_kill.keys() <= sent

        with gateway:  # restarted on the same store; the clients re-send what was never acknowledged
            with httpx.Client(base_url=gateway.url, headers=gateway.headers, timeout=30) as http:
                for ids, body in unacked:
                    r = http.post("/v1/feedback", content=body, headers=json_type)
                    assert r.status_code == 200, r.text
                    assert r.json()["stored"] + len(r.json()["duplicates"]) == len(ids)
        final = stored_ids(run_dir, location)
        assert final.keys() == sent and max(final.values()) == 1

