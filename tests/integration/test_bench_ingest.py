"""`rtrl bench ingest --quick` runs end to end: a real `rtrl serve` per store, batching clients with
retries, and nothing lost or doubled; the figures of the full run live in benchmarks/BENCHMARKS.md."""

from __future__ import annotations

import pytest

from realtime_rl.bench import run_benchmark


@pytest.mark.slow
def test_bench_ingest_quick():
    m = run_benchmark("ingest", quick=True)["metrics"]
    for backend in ("sqlite", "postgres"):
        r = m[backend]
        if "skipped" in r:
            assert backend == "postgres", r
            continue
        assert r["lost"] == 0 and r["duplicated"] == 0 and r["unexpected"] == 0
        assert r["stored"] == r["sent"] == r["acknowledged"] > 0 and r["events_per_s"] > 0
        assert r["failed_requests"] == 0 and r["acked_as_duplicates"] == r["retried_events"] > 0
        assert r["commits"] >= 1
