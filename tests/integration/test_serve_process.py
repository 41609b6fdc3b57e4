"""serve_in_process: the gateway in a child interpreter, answering on a real port, stopped on exit."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from realtime_rl.config import ApiKey, ServeConfig
from realtime_rl.serve import serve_in_process


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:  # gone, or not ours to read
        return b""


def test_the_gateway_serves_from_a_child_process_and_stops_with_the_context(tmp_path, tiny_checkpoint):
    key = ApiKey(name="t", key="k" * 32, scopes=["inference"])
    settings = ServeConfig(checkpoint=tiny_checkpoint, run_dir=tmp_path / "serve", api_keys=[key], port=0,
                           max_seq_len=256)
    log = tmp_path / "serve" / "gateway.log"
    with serve_in_process(settings, log, threads=1, niceness=5) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key=key.key, timeout=60, max_retries=0)
        reply = client.chat.completions.create(model="rtrl-policy", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4)
        assert reply.id.startswith("chatcmpl-") and reply.usage.completion_tokens >= 1
        [pid] = [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and _cmdline(d).startswith(
            b"%s\0-m\0realtime_rl.serve\0%s" % (sys.executable.encode(), str(tmp_path).encode()))]
        assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0) + 5
    with pytest.raises(httpx.TransportError):  # drained and gone: nothing listens on the port any more
        httpx.get(f"{url}/health", timeout=2.0)
    assert (tmp_path / "serve" / "events.sqlite").is_file()
    assert (tmp_path / "serve" / "gateway.settings.json").stat().st_mode & 0o077 == 0  # the keys: owner only


def test_a_gateway_that_cannot_start_reports_why(tmp_path):
    settings = ServeConfig(checkpoint=tmp_path / "missing", run_dir=tmp_path / "serve",
                           api_keys=[ApiKey(name="t", key="k" * 32, scopes=["inference"])], port=0)
    with pytest.raises(RuntimeError, match="exited with"):
        with serve_in_process(settings, tmp_path / "serve" / "gateway.log", start_timeout_s=60):
            pass
