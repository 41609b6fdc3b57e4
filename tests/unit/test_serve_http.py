"""The gateway at the HTTP edge: a client that leaves before its answer aborts the generation and nothing is
recorded; a body over max_request_bytes is a 413 before it is parsed; a model id may hold "/"; what OpenAI
and vLLM clients send back (null fields of their answers) is accepted; the streamer decodes linearly; one
timeout covers rendering and generating; parallel_tool_calls false ends a reply at its first call."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time

from tests.unit.test_serve_api import (
    AUTH, M, TOOL_TEXT, WEATHER, chat, gateway, sse_events, two_gram_model,
)


def test_a_client_that_leaves_before_its_answer_aborts_it_and_nothing_is_recorded(tmp_path, tokenizer):
    """Over ASGI: the body, then a disconnect as soon as the request decodes. Each decode step is slowed so
    that the 200 tokens asked for would take 10 seconds (at 10 ms a step a loaded 2-core machine once let the
    whole answer through before the disconnect was seen)."""
    with gateway(tmp_path, tokenizer) as (client, store, engine):
        step, steps = engine.engine.step, []

        def slow_step():
            steps.append(1)
            time.sleep(0.05)
            return step()

        engine.engine.step = slow_step
        body = json.dumps(chat(max_tokens=200)).encode()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            while not engine.engine.num_running:  # the client leaves once its request decodes
                await asyncio.sleep(0.005)
            return {"type": "http.disconnect"}

        sent = []

        async def send(message):
            sent.append(message)

        _asgi_post(client, chat(max_tokens=200), receive, send)
        deadline = time.monotonic() + 5  # the aborted request leaves the engine at its next step
        while engine.engine.num_running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.engine.num_running == 0 and engine.engine.num_waiting == 0
        assert len(steps) < 100, "the engine generated the whole answer"
        assert store.count_completions() == 0
        assert sent[0]["status"] == 499


def test_a_stream_whose_client_leaves_before_its_first_token_is_aborted_with_a_499(tmp_path, tokenizer):
    """A stream waits for its first token before its response starts; a client gone meanwhile (its request
    queued behind others) was noticed only once the first token came, and the request kept its place."""
    with gateway(tmp_path, tokenizer) as (client, store, engine):
        step, slow = engine.engine.step, threading.Event()

        def slow_first_steps():
            if not slow.is_set():
                time.sleep(0.1)
            return step()

        engine.engine.step = slow_first_steps
        body = chat(max_tokens=200, stream=True)
        messages, sent = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}], []

        async def receive():
            if messages:
                return messages.pop()
            return {"type": "http.disconnect"}  # at once: before any token

        async def send(message):
            sent.append(message)

        t0 = time.monotonic()
        _asgi_post(client, body, receive, send)
        slow.set()
        assert sent[0]["status"] == 499 and time.monotonic() - t0 < 5
        deadline = time.monotonic() + 5
        while (engine.engine.num_running or engine.engine.num_waiting) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.engine.num_running == 0 and engine.engine.num_waiting == 0 and engine._pending == 0
        assert store.count_completions() == 0


def _asgi_post(client, body: dict, receive, send) -> None:
    """POST /v1/chat/completions straight to the app over ASGI, with the test's receive and send."""
    raw = json.dumps(body).encode()
    headers = {"content-type": "application/json", "content-length": str(len(raw)), **AUTH}
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "root_path": "", "query_string": b"", "client": ("127.0.0.1", 50000), "server": ("testserver", 80),
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    asyncio.run(asyncio.wait_for(client.app(scope, receive, send), 60))


def _undelivered(store, deadline_s: float = 10.0) -> list:
    """The undelivered events, once the gateway's group commit has written one (it does not block the request)."""
    deadline = time.monotonic() + deadline_s
    while not (found := store.list_events()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return [e for e in found if e.type == "undelivered"]


def test_a_stream_whose_client_leaves_after_the_record_is_marked_undelivered(tmp_path, tokenizer):
    """The record is written before the closing chunks; a client that goes away then never got the completion:
    it stays recorded, with an `undelivered` event that keeps it out of training."""
    with gateway(tmp_path, tokenizer) as (client, store, _):
        body = json.dumps(chat(max_tokens=6, stream=True, user="ada")).encode()
        messages, gone, sent = [{"type": "http.request", "body": body, "more_body": False}], asyncio.Event(), []

        async def receive():
            if messages:
                return messages.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if b'"finish_reason"' in message.get("body", b""):  # a closing chunk: the record is written
                gone.set()
                await asyncio.sleep(5)  # the server sees the disconnect while this chunk is on the wire

        _asgi_post(client, json.loads(body), receive, send)
        assert not any(b"[DONE]" in m.get("body", b"") for m in sent)
        [record] = store.list_completions()
        [event] = _undelivered(store)
        assert (event.completion_id, event.user, event.attributes) == (
            record.completion_id, "ada", {"reason": "client_disconnected"})
        assert 'rtrl_serve_undelivered_completions_total{reason="client_disconnected"} 1.0' in client.get(
            "/metrics").text
        r = client.post("/v1/chat/completions", json=chat(max_tokens=6, stream=True))  # one that is read
        assert r.status_code == 200 and "[DONE]" in r.text
        time.sleep(0.2)
        assert len(_undelivered(store)) == 1


def test_a_client_that_leaves_while_its_answer_is_recorded_gets_a_499_and_it_is_marked(tmp_path, tokenizer):
    with gateway(tmp_path, tokenizer) as (client, store, _):
        add, recorded = store.add_completion, threading.Event()

        def add_and_tell(record):
            add(record)
            recorded.set()

        store.add_completion = add_and_tell
        messages, sent = [{"type": "http.request", "body": json.dumps(chat()).encode(), "more_body": False}], []

        async def receive():
            if messages:
                return messages.pop()
            while not recorded.is_set():
                await asyncio.sleep(0.005)
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        _asgi_post(client, chat(), receive, send)
        assert sent[0]["status"] == 499
        [record] = store.list_completions()
        [event] = _undelivered(store)
        assert event.completion_id == record.completion_id


def test_a_stream_whose_client_leaves_while_its_record_is_written_is_marked_undelivered(tmp_path, tokenizer):
    """The client goes away while the record's write is in flight: the stream is cancelled there, and the write
    commits anyway (it runs in a thread). It was recorded as delivered, and trained on."""
    with gateway(tmp_path, tokenizer) as (client, store, _):
        add, writing = store.add_completion, threading.Event()

        def slow_add(record):
            writing.set()
            time.sleep(0.5)
            add(record)

        store.add_completion = slow_add
        body = chat(max_tokens=6, stream=True)
        messages, sent = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}], []

        async def receive():
            if messages:
                return messages.pop()
            while not writing.is_set():
                await asyncio.sleep(0.005)
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        _asgi_post(client, body, receive, send)
        assert not any(b"[DONE]" in m.get("body", b"") for m in sent)
        [event] = _undelivered(store)
        deadline = time.monotonic() + 10  # the write lands after the stream was cancelled
        while not store.list_completions() and time.monotonic() < deadline:
            time.sleep(0.02)
        [record] = store.list_completions()
        assert (event.completion_id, event.attributes) == (record.completion_id, {"reason": "client_disconnected"})


def test_a_record_whose_write_outlasts_the_503_is_marked_undelivered(tmp_path, tokenizer, monkeypatch):
    """Past STORE_TIMEOUT_S the answer is a 503 but the write may still commit: should it land, it is marked."""
    import realtime_rl.serve.completions as completions

    monkeypatch.setattr(completions, "STORE_TIMEOUT_S", 0.2)
    with gateway(tmp_path, tokenizer) as (client, store, _):
        add = store.add_completion

        def slow_add(record):
            time.sleep(1.0)
            add(record)

        store.add_completion = slow_add
        r = client.post("/v1/chat/completions", json=chat())
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
        [event] = _undelivered(store)
        assert event.attributes == {"reason": "store_timeout"}
        deadline = time.monotonic() + 10
        while not store.count_completions() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert store.list_completions()[0].completion_id == event.completion_id


def test_a_store_that_times_out_itself_wrote_nothing_and_marks_nothing(tmp_path, tokenizer):
    """The store's own lock timeout is a TimeoutError too, but nothing was written: marking it undelivered left
    an event naming a completion that never exists (held by the ledger forever)."""
    with gateway(tmp_path, tokenizer) as (client, store, _):
        def busy(record):
            raise TimeoutError("event store busy for more than 30 s")

        store.add_completion = busy
        r = client.post("/v1/chat/completions", json=chat())
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
        assert _undelivered(store, deadline_s=1.0) == [] and store.count_completions() == 0  # a mark would come late


def test_a_body_over_the_limit_is_a_413_before_it_is_parsed(tmp_path, tokenizer, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the tokenizer saw an oversized request")

    monkeypatch.setattr(tokenizer, "encode", refuse)
    with gateway(tmp_path, tokenizer, max_request_bytes=4096) as (client, store, _):
        raw = json.dumps(chat("x" * 5000)).encode()
        for content in (raw, iter([raw[:3000], raw[3000:]])):  # Content-Length, then chunked (no length)
            r = client.post("/v1/chat/completions", content=content,
                            headers={"content-type": "application/json"})
            assert r.status_code == 413, r.text
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and "max_request_bytes" in error["message"]
        assert store.count_completions() == 0
        metric = 'rtrl_serve_requests_total{method="POST",route="unmatched",status="413"} 1.0'
        assert metric in client.get("/metrics").text  # the one refused by its Content-Length


def test_a_model_id_with_a_slash_is_found(tmp_path, tokenizer):
    with gateway(tmp_path, tokenizer, model_name="org/name") as (client, _, _):
        r = client.get("/v1/models/org/name")
        assert r.status_code == 200 and r.json()["id"] == "org/name"
        assert client.get("/v1/models/org/other").status_code == 404
        r = client.post("/v1/chat/completions", json={**chat(max_tokens=2), "model": "org/name"})
        assert r.status_code == 200


def test_an_answer_sent_back_as_history_and_a_long_session_id_are_accepted(tmp_path, tokenizer):
    """OpenAI and vLLM answers carry null refusal, annotations, ...; clients send them back as history. A
    session id as long as a completion accepts can be named by feedback."""
    with gateway(tmp_path, tokenizer) as (client, store, _):
        answer = {"role": "assistant", "content": "hi", "refusal": None, "annotations": None, "audio": None,
                  "function_call": None, "reasoning_content": None, "tool_calls": None}
        openai_answer = answer | {"annotations": []}  # OpenAI's own answers: it was a 400
        session = "s" * 256
        body = chat(messages=[*M, answer, *M, openai_answer, *M], metadata={"session_id": session})
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert store.get_completion(r.json()["id"]).session_id == session
        feedback = {"log.record.uid": "e-1", "event.name": "session_end", "gen_ai.conversation.id": session}
        assert client.post("/v1/feedback", json=feedback).status_code == 200


def test_the_streamer_decodes_each_token_about_once_and_gets_the_whole_text_right(tokenizer):
    """Incremental decoding gives, after every token, the text of all tokens so far, characters split
    across byte-level tokens included; the old streamer decoded the whole reply at each token."""
    import random

    from realtime_rl.serve.streaming import TextStreamer

    text = "def f(x):\n    return 'héllo wörld 😀 中文' * x  # ünïcode\n" * 6
    ids = tokenizer.encode(text)
    rng = random.Random(0)
    ids += [rng.randrange(tokenizer.vocab_size - 8) for _ in range(200)]  # any bytes, broken UTF-8 too
    decoded, decode = [0], tokenizer.decode

    def counting(token_ids, skip_special_tokens=False):
        decoded[0] += len(token_ids)
        return decode(token_ids, skip_special_tokens=skip_special_tokens)

    tokenizer.decode = counting
    try:
        streamer = TextStreamer(tokenizer, [], hold_tool_calls=False)
        for i, token in enumerate(ids, 1):
            streamer.push(token)
            assert streamer.text() == decode(ids[:i], skip_special_tokens=True)
    finally:
        del tokenizer.decode
    assert decoded[0] < 6 * len(ids)  # whole-reply decoding: len(ids)**2 / 2


def test_rendering_and_generating_share_the_request_timeout(tmp_path, tokenizer, monkeypatch):
    """A request gets request_timeout_s in all: rendering that took most of it leaves generation the rest
    (each had the whole of it, so a request could run for twice its timeout)."""
    import realtime_rl.serve.routes.chat as chat_route

    prepare = chat_route.prepare

    def slow_prepare(*args):
        time.sleep(2.0)
        return prepare(*args)

    with gateway(tmp_path, tokenizer, request_timeout_s=3.0) as (client, store, engine):
        assert client.post("/v1/chat/completions", json=chat(max_tokens=12)).status_code == 200  # warm
        step = engine.engine.step

        def slow_step():
            time.sleep(0.12)
            return step()

        engine.engine.step = slow_step  # 12 tokens: ~1.4 s, within a whole timeout, past what is left
        monkeypatch.setattr(chat_route, "CHAT", dataclasses.replace(chat_route.CHAT, prepare=slow_prepare))
        answer = client.post("/v1/chat/completions", json=chat(max_tokens=12))
        assert answer.status_code == 504 and answer.json()["error"]["code"] == "timeout"
        assert store.count_completions() == 1  # the warm-up's


def test_parallel_tool_calls_false_ends_the_reply_at_its_first_call(tmp_path, tokenizer, monkeypatch):
    """The model would write on after its call; with parallel_tool_calls false the reply ends at the call's
    closing token, plain and streamed, and the record holds exactly what the client got."""
    text = f"Let me check.\n\n{TOOL_TEXT}\n\nDone."
    model = two_gram_model(tokenizer, text)
    with gateway(tmp_path, tokenizer, model=model, max_seq_len=512) as (client, store, _):
        body = chat("Weather in Paris?", tools=[WEATHER], temperature=0, max_tokens=100)
        single = {**body, "parallel_tool_calls": False}
        plain = client.post("/v1/chat/completions", json=single).json()
        streamed = client.post("/v1/chat/completions", json={**single, "stream": True})
        first = json.loads(sse_events(streamed.text)[0])
        for completion_id in (plain["id"], first["id"]):
            crec = store.get_completion(completion_id).choices[0]
            assert crec.text == f"Let me check.\n\n{TOOL_TEXT}" and crec.finish_reason == "tool_calls"
            assert crec.token_ids[-1] == tokenizer.encode("</tool_call>")[0]
            assert crec.content == "Let me check."
        calls = plain["choices"][0]["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["get_weather"]
        unset = client.post("/v1/chat/completions", json=body).json()
        assert store.get_completion(unset["id"]).choices[0].text == text  # true or unset: it writes on

        encode = tokenizer.encode  # a tokenizer without a single closing token cannot end there: a clear 400
        monkeypatch.setattr(tokenizer, "encode",
                            lambda s, *a, **k: [5, 6] if s == "</tool_call>" else encode(s, *a, **k))
        r = client.post("/v1/chat/completions", json=single)
        assert r.status_code == 400 and r.json()["error"]["param"] == "parallel_tool_calls"
