"""The official `openai` client against a real gateway on 127.0.0.1 (uvicorn, checkpoints saved to disk,
the engine and the SQLite store built by the app's lifespan): plain chat, n > 1, streaming, tool calls and
tool results round trip, errors; then the rows in events.sqlite, read through a second connection.
`run_server` itself is started in a subprocess and stopped with SIGTERM."""

from __future__ import annotations

import json
import math
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from realtime_rl.collect import SqliteEventStore
from realtime_rl.config import ServeConfig
from realtime_rl.model import Qwen3ForCausalLM, render_messages, save_checkpoint
from realtime_rl.serve import serve_in_thread
from tests.conftest import tiny_config
from tests.unit.test_serve_api import KEYS, MODEL, TOOL_TEXT, WEATHER, two_gram_model


def serving(settings: ServeConfig):
    """The gateway under uvicorn on a free port of 127.0.0.1, in a thread; yields the base URL."""
    return serve_in_thread(settings.model_copy(update={"host": "127.0.0.1", "port": 0}))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("ckpt")
    model = Qwen3ForCausalLM(tiny_config(moe=True, vocab_size=tokenizer.vocab_size))
    model.reset_parameters(seed=0)
    save_checkpoint(root / "random", model, tokenizer)
    save_checkpoint(root / "tools", two_gram_model(tokenizer), tokenizer)
    return root


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    settings = ServeConfig(checkpoint=checkpoints / "random", run_dir=run_dir, api_keys=KEYS, max_seq_len=512)
    with serving(settings) as url, SqliteEventStore(run_dir / "events.sqlite") as store:
        yield url, store


@pytest.fixture(scope="module")
def tool_server(checkpoints, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run-tools")
    settings = ServeConfig(checkpoint=checkpoints / "tools", run_dir=run_dir, api_keys=KEYS, max_seq_len=1024)
    with serving(settings) as url, SqliteEventStore(run_dir / "events.sqlite") as store:
        yield url, store


def client(url: str, key: str = KEYS[0].key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def assert_fully_recorded(rec, tokenizer, moe_layers: int = 3) -> None:
    """Every served token has a finite logprob, a version and its routing row."""
    assert rec is not None
    for c in rec.choices:
        T = len(c.token_ids)
        assert T > 0 and len(c.logprobs) == len(c.raw_logprobs) == len(c.versions) == T
        assert all(math.isfinite(x) and x <= 0 for x in c.logprobs + c.raw_logprobs)
        assert c.versions == [0] * T
        assert c.routing.shape[0] == len(rec.prompt_token_ids) + T - 1 and c.routing.shape[1:] == (moe_layers, 2)
        assert tokenizer.decode(c.token_ids, skip_special_tokens=True).startswith(c.text)


def test_plain_chat_is_answered_and_on_disk(server, tokenizer):
    url, store = server
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Add two numbers."}]
    resp = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=16, seed=1, user="ada",
                                               extra_headers={"X-Session-Id": "sess-9"})
    assert resp.id.startswith("chatcmpl-") and resp.model == MODEL and resp.system_fingerprint == "rtrl-v0"
    assert resp.choices[0].finish_reason in ("stop", "length")
    rec = store.get_completion(resp.id)
    assert_fully_recorded(rec, tokenizer)
    assert (rec.user, rec.session_id, rec.api_key_name) == ("ada", "sess-9", "client")
    assert rec.prompt_token_ids == tokenizer.encode(render_messages(messages, add_generation_prompt=True))
    assert resp.choices[0].message.content == rec.choices[0].content
    assert resp.usage.completion_tokens == len(rec.choices[0].token_ids)
    assert [m.id for m in client(url).models.list()] == [MODEL]


def test_n_choices_share_one_id_and_are_recorded_each(server, tokenizer):
    url, store = server
    resp = client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Sort a list."}],
                                               n=3, max_tokens=8, temperature=1.0, seed=5)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    rec = store.get_completion(resp.id)
    assert_fully_recorded(rec, tokenizer)
    assert [c.index for c in rec.choices] == [0, 1, 2]
    assert [c.message.content for c in resp.choices] == [c.content for c in rec.choices]


def test_streaming_matches_the_record(server, tokenizer):
    url, store = server
    stream = client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                                 max_tokens=20, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    rec = store.get_completion(chunks[0].id)
    assert_fully_recorded(rec, tokenizer)
    assert rec.stream and text == rec.choices[0].content and finish == [rec.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == len(rec.choices[0].token_ids)


def test_text_completions_continue_a_raw_prompt_and_are_recorded(server, tokenizer):
    url, store = server
    api = client(url)
    prompt = "def add(a, b):\n    return"
    resp = api.completions.create(model=MODEL, prompt=prompt, max_tokens=12, n=2, seed=3, logprobs=2,
                                  user="ada")
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion"
    assert resp.system_fingerprint == "rtrl-v0"
    rec = store.get_completion(resp.id)
    assert_fully_recorded(rec, tokenizer)
    assert rec.prompt_token_ids == tokenizer.encode(prompt) and rec.user == "ada"  # no chat template
    assert json.loads(rec.request_json)["prompt"] == prompt
    for choice, crec in zip(resp.choices, rec.choices):
        assert choice.text == crec.text == crec.content and choice.finish_reason == crec.finish_reason
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
        assert lp.token_logprobs == pytest.approx(crec.raw_logprobs[:len(lp.tokens)])
        assert all(tok in top and len(top) <= 3 for tok, top in zip(lp.tokens, lp.top_logprobs))
        for token, offset in zip(lp.tokens, lp.text_offset):  # each whole character's token is at its offset
            if "\ufffd" not in token and tokenizer.decode(tokenizer.encode(token), skip_special_tokens=True):
                assert choice.text[offset:offset + len(token)] == token
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(choice.text)
    assert resp.usage.prompt_tokens == len(rec.prompt_token_ids)

    # Token ids and echo; the stream is what the record holds, after the echoed prompt.
    ids = tokenizer.encode(prompt)
    chunks = list(api.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=10, stream=True,
                                         stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    rec = store.get_completion(chunks[0].id)
    assert rec.stream and rec.prompt_token_ids == ids and text == tokenizer.decode(ids) + rec.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        rec.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == len(rec.choices[0].token_ids)
    assert all(c.object == "text_completion" and c.system_fingerprint == "rtrl-v0" for c in chunks)

    # What is not supported is a 400 naming it, and nothing is recorded.
    before = store.count_completions()
    for bad, word in [(dict(prompt=["a", "b"]), "one prompt"), (dict(prompt="x", suffix="y"), "suffix"),
                      (dict(prompt="x", echo=True, logprobs=1), "echo"), (dict(prompt=""), "empty"),
                      (dict(prompt="x", max_tokens=10_000), "does not fit"),
                      (dict(prompt=[1, 10**6], echo=True), "token ids")]:
        with pytest.raises(openai.BadRequestError, match=word):
            api.completions.create(model=MODEL, **bad)
    assert store.count_completions() == before


def test_tool_calls_and_tool_results_round_trip(tool_server, tokenizer):
    url, store = tool_server
    api = client(url)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    resp = api.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=64)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    first = store.get_completion(resp.id)
    assert_fully_recorded(first, tokenizer, moe_layers=1)
    assert first.choices[0].text == TOOL_TEXT and first.choices[0].malformed_tool_calls == 0

    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    resp2 = api.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=64)
    second = store.get_completion(resp2.id)
    assert second.prompt_token_ids == tokenizer.encode(render_messages(messages, [WEATHER], add_generation_prompt=True))
    prompt = tokenizer.decode(second.prompt_token_ids)
    assert TOOL_TEXT in prompt and "<tool_response>\nSunny, 21 C\n</tool_response>" in prompt

    stream = api.chat.completions.create(model=MODEL, messages=messages[:1], tools=[WEATHER], temperature=0,
                                         max_tokens=64, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [("get_weather", {"city": "Paris"})]
    assert not "".join(d.content or "" for d in deltas)


def test_errors_reach_the_client_in_the_openai_shape(server):
    url, store = server
    before = store.count_completions()
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.AuthenticationError) as e:
        client(url, key="not-a-valid-key-000").chat.completions.create(model=MODEL, messages=messages)
    assert e.value.status_code == 401 and e.value.response.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.PermissionDeniedError):
        client(url, key=KEYS[1].key).chat.completions.create(model=MODEL, messages=messages)
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(model=MODEL, messages=messages, temperature=3)
    assert e.value.param == "temperature" and e.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x " * 2000}])
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client(url).chat.completions.create(model="gpt-4o", messages=messages)
    assert store.count_completions() == before
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    assert "rtrl_serve_requests_total" in httpx.get(f"{url}/metrics").text


def test_an_abandoned_stream_aborts_its_engine_request_and_is_not_recorded(server):
    url, store = server
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 400,
            "temperature": 0}
    full = client(url).chat.completions.create(**body)
    assert full.choices[0].finish_reason == "length"  # so the stream below cannot end before we leave
    before = store.count_completions()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body | {"stream": True},
                      headers={"Authorization": f"Bearer {KEYS[0].key}"}, timeout=30) as r:
        for line in r.iter_lines():
            if '"content":"' in line and '"role"' not in line:
                break  # the first token arrived; hang up
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/health").json()["engine_running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert httpx.get(f"{url}/health").json()["engine_running"] == 0
    assert store.count_completions() == before


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_run_server_serves_then_stops_cleanly_on_sigterm(checkpoints, tmp_path, tokenizer):
    settings = ServeConfig(checkpoint=checkpoints / "random", run_dir=tmp_path, api_keys=KEYS, port=_free_port())
    code = ("import sys; from realtime_rl.config import ServeConfig; from realtime_rl.serve import run_server; "
            "run_server(ServeConfig.model_validate_json(sys.argv[1]))")
    proc = subprocess.Popen([sys.executable, "-c", code, settings.model_dump_json()],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{settings.port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "run_server did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        resp = client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    with SqliteEventStore(tmp_path / "events.sqlite") as store:
        assert_fully_recorded(store.get_completion(resp.id), tokenizer)
