"""`rtrl bench ingest`: durable feedback ingestion over HTTP on loopback, on SQLite and on Postgres.

For each store, `rtrl serve` runs as a subprocess on 127.0.0.1 (a tiny checkpoint; the engine idles)
and `clients` threads POST batches of `batch` events to /v1/feedback for `seconds`. Every answer is
an acknowledgement after a durable commit (SQLite WAL with synchronous=FULL; Postgres with
synchronous_commit=on), concurrent requests sharing one commit in the gateway's GroupCommitter. A share
of the batches (`retry_fraction` of each client's, its first included) is sent a second time right after
its acknowledgement: the retry of a client that lost the answer (same ids, same content), which must come
back as duplicates; a batch that fails (5xx, a dropped connection) is re-sent until acknowledged. Then the
gateway stops and the store is read directly:

    events_per_s     distinct events acknowledged per second of sending (retries not counted)
    sent             distinct events sent;  requests: POSTs made, retries included
    retried_events   events sent again (lost-answer retries and failures); acked_as_duplicates: of those
    stored           rows in the store
    lost             acknowledged events missing from the store                  (target 0)
    duplicated       rows beyond one per event id, retries included               (target 0)
    unexpected       stored ids that were never sent                               (0)
    commit_events_mean  events per group commit, from the gateway's /metrics
    gateway_cpu_us_per_event, client_cpu_us_per_event   CPU per acknowledged event, whatever else runs
    machine_busy_cores  cores busy on the whole machine during the run (Postgres and other jobs included)

Target (DESIGN.md): >= 10k events/s, 0 lost, 0 duplicated. The clients, the gateway and Postgres
share the machine's cores. Postgres runs in a schema of its own, dropped afterwards, on
RTRL_BENCH_POSTGRES_URL (default postgresql://127.0.0.1:5432/test); it is reported as skipped, with
the reason, when no server answers. `--quick` runs 3 s per store.

`Gateway` (start / stop / SIGKILL a real `rtrl serve` process) is shared with the durability test.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from realtime_rl.collect import open_event_store, postgres_unavailable
from realtime_rl.config import ModelConfig
from realtime_rl.model import Qwen3ForCausalLM, Tokenizer, generate_corpus, save_checkpoint
from realtime_rl.serve import free_port, log_tail, wait_until_serving

KEY = "rtrl-bench-feedback-key-0123456789"
POSTGRES_URL = os.environ.get("RTRL_BENCH_POSTGRES_URL", "postgresql://127.0.0.1:5432/test")
TYPES = ("edit_accepted", "edit_rejected", "edit_reverted", "followup_dissatisfied", "followup_neutral")


def tiny_checkpoint(directory: Path) -> Path:
    """A small random model and tokenizer: the gateway needs something to serve; ingestion never uses it."""
    tokenizer = Tokenizer.train(generate_corpus(300, seed=0), vocab_size=512)
    config = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = Qwen3ForCausalLM(config)
    model.reset_parameters(seed=0)
    return save_checkpoint(directory, model, tokenizer)


class Gateway:
    """`rtrl serve` as a subprocess on 127.0.0.1 with one feedback+inference key; logs in run_dir/gateway.log.

        with Gateway(checkpoint, run_dir, store="sqlite") as gw:   # started; stopped (SIGTERM) on exit
            httpx.post(f"{gw.url}/v1/feedback", headers=gw.headers, json=...)
            gw.kill()      # SIGKILL: no drain, no close
            gw.start()     # again, on the same store
    """

    def __init__(self, checkpoint: Path, run_dir: Path, store: str = "sqlite") -> None:
        self.checkpoint, self.run_dir, self.store = checkpoint, run_dir, store
        self.headers = {"Authorization": f"Bearer {KEY}"}
        self.proc: subprocess.Popen | None = None
        self.url = ""
        run_dir.mkdir(parents=True, exist_ok=True)
        self.config, self.log_path = run_dir / "serve.toml", run_dir / "gateway.log"
        self.config.write_text(
            f"run_dir = {json.dumps(str(run_dir))}\nstore = {json.dumps(store)}\nmax_seq_len = 128\n"
            f'[[api_keys]]\nname = "bench"\nkey = "{KEY}"\nscopes = ["inference", "feedback"]\n')

    def start(self, timeout_s: float = 120.0) -> str:
        assert self.proc is None or self.proc.poll() is not None, "the gateway is already running"
        port = free_port()
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "realtime_rl.cli", "--log-level", "WARNING", "serve", "--config", str(self.config),
             "--checkpoint", str(self.checkpoint), "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        log.close()
        self.url = f"http://127.0.0.1:{port}"
        try:
            wait_until_serving(self.proc, self.url, self.log_path, timeout_s)
        except TimeoutError:
            self.kill()
            raise
        return self.url

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, then wait for a clean exit (SIGKILL after timeout_s); the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text

    def __enter__(self) -> Gateway:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def postgres_schema(url: str) -> Iterator[str]:
    """A fresh schema on the server at `url`; yields a URL selecting it; drops it afterwards."""
    import psycopg

    name = f"rtrl_bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
        conn.execute(f"CREATE SCHEMA {name}")
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query) + [("options", f"-csearch_path={name}")]
    try:
        yield urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


def batch_body(prefix: str, size: int) -> tuple[list[str], bytes]:
    """Event ids and the JSON body of one batch; each event names a completion and a session."""
    ids = [f"{prefix}-{j}" for j in range(size)]
    events = [{"log.record.uid": event_id, "event.name": TYPES[j % len(TYPES)],
               "gen_ai.response.id": f"chatcmpl-{prefix}-{j % 4}", "gen_ai.conversation.id": f"sess-{prefix}",
               "attributes": {"bench": True}} for j, event_id in enumerate(ids)]
    return ids, json.dumps({"events": events}).encode()


class Load:
    """What the clients sent and what the gateway acknowledged (shared by the client threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent: set[str] = set()
        self.acked: set[str] = set()
        self.requests = self.retried_events = self.acked_as_duplicates = self.failures = 0

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)


def post_until_acked(client: httpx.Client, load: Load, ids: list[str], body: bytes, deadline: float) -> dict:
    """POST one batch until a 200 (re-sending the same body after a failure); the answer."""
    while True:
        load.add(requests=1)
        try:
            r = client.post("/v1/feedback", content=body)
            if r.status_code == 200:
                return r.json()
            if r.status_code < 500:
                raise RuntimeError(f"the gateway refused a batch: {r.status_code} {r.text[:300]}")
        except httpx.TransportError:
            pass
        load.add(failures=1, retried_events=len(ids))
        if time.monotonic() > deadline:
            raise TimeoutError("a batch stayed unacknowledged for too long")
        time.sleep(0.05)


def client_loop(url: str, load: Load, name: str, batch: int, stop_at: float, retry_fraction: float) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        i = 0
        while time.monotonic() < stop_at:
            ids, body = batch_body(f"{name}-{i}", batch)
            with load.lock:
                load.sent.update(ids)
            answer = post_until_acked(client, load, ids, body, stop_at + 120)
            with load.lock:
                load.acked.update(ids)
            load.add(acked_as_duplicates=len(answer["duplicates"]))
            # Batch i is retried where i x fraction passes an integer: that share of batches, the first
            # included (so that a short run on a loaded machine retries too).
            if math.ceil((i + 1) * retry_fraction) > math.ceil(i * retry_fraction):  # the answer was "lost"
                load.add(retried_events=len(ids))
                again = post_until_acked(client, load, ids, body, stop_at + 120)
                if sorted(again["duplicates"]) != sorted(ids) or again["stored"] != 0:
                    raise RuntimeError(f"a retried batch was not acknowledged as duplicates: {again}")
                load.add(acked_as_duplicates=len(ids))
            i += 1


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float | None:
    """CPU seconds all cores spent busy since boot (Linux /proc/stat; None elsewhere)."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except OSError:
        return None
    # user nice system idle iowait irq softirq steal (guest time is already inside user and nice)
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _per_event_us(cpu_s: float | None, events: int) -> float | None:
    return None if cpu_s is None or not events else round(1e6 * cpu_s / events, 1)


def measure(checkpoint: Path, run_dir: Path, store: str, clients: int, batch: int, seconds: float,
            retry_fraction: float) -> dict[str, Any]:
    if not 0 <= retry_fraction <= 1:
        raise ValueError(f"retry_fraction must be in [0, 1], got {retry_fraction}")
    load = Load()
    run = uuid.uuid4().hex[:8]
    with Gateway(checkpoint, run_dir, store) as gateway:
        threads = [threading.Thread(target=client_loop, args=(gateway.url, load, f"{run}-c{c}", batch,
                                                              time.monotonic() + seconds, retry_fraction))
                   for c in range(clients)]
        cpu0 = (process_cpu_s(gateway.proc.pid), time.process_time(), machine_busy_s())
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + 300)
        elapsed = time.monotonic() - start
        cpu1 = (process_cpu_s(gateway.proc.pid), time.process_time(), machine_busy_s())
        gateway_cpu, client_cpu, busy = (None if a is None or b is None else b - a for a, b in zip(cpu0, cpu1))
        if any(t.is_alive() for t in threads):
            raise TimeoutError("client threads did not finish")
        text = gateway.metrics()
        code = gateway.stop()
        if code != 0:
            raise RuntimeError(f"rtrl serve did not stop cleanly ({code}):\n{log_tail(gateway.log_path)}")
    with open_event_store(run_dir, store) as s:
        stored_ids: Counter[str] = Counter()
        cursor = 0
        while page := s.list_events(after_seq=cursor, limit=20_000):
            stored_ids.update(e.event_id for e in page)
            cursor = page[-1].seq
    commits = _metric(text, "rtrl_serve_feedback_commit_events_count")
    return {
        "events_per_s": round(len(load.acked) / elapsed, 1),
        "sent": len(load.sent),
        "acknowledged": len(load.acked),
        "stored": sum(stored_ids.values()),
        "lost": len(load.acked - stored_ids.keys()),
        "duplicated": sum(n - 1 for n in stored_ids.values()),
        "unexpected": len(stored_ids.keys() - load.sent),
        "requests": load.requests,
        "retried_events": load.retried_events,
        "acked_as_duplicates": load.acked_as_duplicates,
        "failed_requests": load.failures,
        "seconds": round(elapsed, 2),
        "commits": int(commits),
        "commit_events_mean": round(_metric(text, "rtrl_serve_feedback_commit_events_sum") / max(commits, 1), 1),
        "commit_ms_mean": round(1000 * _metric(text, "rtrl_serve_feedback_commit_seconds_sum") / max(commits, 1), 2),
        # CPU spent per acknowledged event, whatever else the machine runs: the gateway process (HTTP, JSON,
        # validation, the store's client side) and the benchmark's client threads; and how many cores were
        # busy on the whole machine during the run (Postgres and other jobs included).
        "gateway_cpu_us_per_event": _per_event_us(gateway_cpu, len(load.acked)),
        "client_cpu_us_per_event": _per_event_us(client_cpu, len(load.acked)),
        "machine_busy_cores": None if busy is None else round(busy / elapsed, 2),
    }


def run(quick: bool = False) -> dict[str, Any]:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    clients, batch, seconds, retry_fraction = (4, 100, 3.0, 0.1) if quick else (8, 250, 20.0, 0.05)
    metrics: dict[str, Any] = {"clients": clients, "batch": batch, "retry_fraction": retry_fraction,
                               "load_avg_1m_before": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-ingest-") as tmp:
        root = Path(tmp)
        checkpoint = tiny_checkpoint(root / "checkpoint")
        metrics["sqlite"] = measure(checkpoint, root / "sqlite", "sqlite", clients, batch, seconds, retry_fraction)
        reason = postgres_unavailable(POSTGRES_URL)
        if reason is not None:
            metrics["postgres"] = {"skipped": reason}
        else:
            with postgres_schema(POSTGRES_URL) as url:
                metrics["postgres"] = measure(checkpoint, root / "postgres", url, clients, batch, seconds,
                                              retry_fraction)
    metrics["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    return metrics
