"""The gateway through FastAPI's TestClient, on a real engine with tiny models: every answered completion
is on disk with each token's logprob, routing and version; tool calls come back in the OpenAI shape
and malformed ones as content; bad input is a 4xx in the OpenAI error shape; overload 503, timeout 504.

Tool calls are real model output: `two_gram_model` writes the weights of a one-layer Qwen3-MoE so that,
after any generation prompt, it decodes a chosen text (a previous-token attention head built from
RoPE, an AND lookup of (previous, current) token in the experts, a readout in lm_head). Its router
keeps random weights, so routing is captured as for any model.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from realtime_rl.collect import SqliteEventStore
from realtime_rl.config import ApiKey, ModelConfig, ServeConfig
from realtime_rl.engine import AsyncEngine, Engine, SamplingParams
from realtime_rl.model import Qwen3ForCausalLM, Tokenizer, render_messages
from realtime_rl.serve import create_app
from realtime_rl.serve.completions import text_offsets
from realtime_rl.serve.schemas import ChatCompletionCreate
from tests.conftest import tiny_config

MODEL = "rtrl-policy"
TOOL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
KEYS = [ApiKey(name="client", key="k-inference-0123456789", scopes=["inference", "feedback"]),
        ApiKey(name="fb", key="k-feedback-only-0123456", scopes=["feedback"])]
AUTH = {"Authorization": f"Bearer {KEYS[0].key}"}


def _segment(tokenizer: Tokenizer, text: str, start: tuple[int, int]) -> list[int]:
    """Tokens that decode to `text` in which no (previous, current) pair repeats (a two-gram chain)."""
    pieces: dict[str, int] = {}
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.decode([i])
        if piece and "\ufffd" not in piece:
            pieces.setdefault(piece, i)

    def search(rest: str, state: tuple[int, int], seen: frozenset) -> list[int] | None:
        if not rest:
            return []
        if state in seen:
            return None
        for piece in sorted((p for p in pieces if rest.startswith(p)), key=len, reverse=True):
            tail = search(rest[len(piece):], (state[1], pieces[piece]), seen | {state})
            if tail is not None:
                return [pieces[piece], *tail]
        return None

    chain = search(text, start, frozenset())
    assert chain is not None and tokenizer.decode(chain) == text, "no two-gram tokenization of the text"
    return chain


@torch.no_grad()
def two_gram_model(tokenizer: Tokenizer, text: str = TOOL_TEXT, seed: int = 0) -> Qwen3ForCausalLM:
    """A Qwen3-MoE whose greedy (and nearly any temperature-1) continuation of a generation prompt is `text`."""
    start = tuple(tokenizer.encode(render_messages([{"role": "user", "content": "x"}], add_generation_prompt=True))[-2:])
    seq = [*start, *_segment(tokenizer, text, start), tokenizer.im_end_id]
    states = [((seq[i - 1], seq[i]), seq[i + 1]) for i in range(1, len(seq) - 1)]
    words, targets = sorted(set(seq[:-1])), sorted(set(seq[2:]))
    word = {w: k for k, w in enumerate(words)}
    nw = len(words) + 1  # a one-hot per chain token, and one for "any other token"
    C, P, O = 1, 1 + nw, 1 + 2 * nw  # residual layout: [bias | current token | previous token | next token]
    H = -(-(O + len(targets)) // 16) * 16
    head_dim = 64
    assert nw <= head_dim
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=H, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=-(-len(states) // 16) * 16,
                      tie_word_embeddings=False)  # grouped_mm wants rows of a multiple of 16 bytes
    model = Qwen3ForCausalLM(cfg)
    model.reset_parameters(seed=seed)
    emb = torch.zeros(cfg.vocab_size, H)
    emb[:, 0], emb[:, C + nw - 1] = 1.0, 1.0
    for w, k in word.items():
        emb[w, C + nw - 1], emb[w, C + k] = 0.0, 1.0
    model.model.embed_tokens.weight.copy_(emb)
    attn = model.model.layers[0].self_attn
    for proj in (attn.q_proj, attn.k_proj):  # constant queries and keys: the score depends on distance only
        proj.weight.zero_()
        proj.weight[:, 0] = 1.0
    # score(d) = sum over the 8 fastest RoPE frequencies of amp^2 cos(w (d - 1)): a sharp peak at d = 1
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    amp, half = math.sqrt(40 * math.sqrt(head_dim) / 0.8), head_dim // 2
    q, k = torch.zeros(head_dim), torch.zeros(head_dim)
    for f in range(8):
        k[f], q[f], q[f + half] = amp, amp * math.cos(inv_freq[f]), -amp * math.sin(inv_freq[f])
    attn.q_norm.weight.copy_(q)
    attn.k_norm.weight.copy_(k)
    attn.v_proj.weight.zero_()
    attn.o_proj.weight.zero_()
    for j in range(nw):  # values carry the token one-hot into the "previous token" block
        attn.v_proj.weight[j, C + j] = 1.0 / math.sqrt(H / 2)
        attn.o_proj.weight[P + j, j] = 1.0
    I, z, s = cfg.moe_intermediate_size, math.sqrt(H / 3), 20.0
    gate_up, down = torch.zeros(2 * I, H), torch.zeros(H, I)
    for j, ((prev, cur), nxt) in enumerate(states):  # unit j fires only when both tokens match
        gate_up[j, C + word[cur]] = gate_up[j, P + word[prev]] = s / z
        gate_up[j, 0] = -1.5 * s / z
        gate_up[I + j, C + word[cur]] = gate_up[I + j, P + word[prev]] = 1.0 / z
        down[O + targets.index(nxt), j] = 10.0 / (2 * s)
    experts = model.model.layers[0].mlp.experts
    experts.gate_up_proj.copy_(gate_up.expand_as(experts.gate_up_proj))
    experts.down_proj.copy_(down.expand_as(experts.down_proj))
    lm_head = torch.zeros(cfg.vocab_size, H)
    for t, y in enumerate(targets):
        lm_head[y, O + t] = 2.0
    model.lm_head.weight.copy_(lm_head)
    return model.eval()


def random_model(tokenizer: Tokenizer) -> Qwen3ForCausalLM:
    model = Qwen3ForCausalLM(tiny_config(moe=True, vocab_size=tokenizer.vocab_size))
    model.reset_parameters(seed=0)
    return model.eval()


@contextmanager
def gateway(tmp_path, tokenizer, model=None, max_pending=64, max_seq_len=256, **settings):
    settings = {"api_keys": KEYS, "run_dir": tmp_path, **settings}
    engine = AsyncEngine(Engine(model or random_model(tokenizer), tokenizer, max_batch=8, max_seq_len=max_seq_len),
                         max_pending=max_pending)
    store = SqliteEventStore(tmp_path / "events.sqlite")
    try:
        with TestClient(create_app(ServeConfig(**settings), engine, store)) as client:
            client.headers.update(AUTH)
            yield client, store, engine
    finally:
        engine.stop()
        store.close()


def chat(content="Write a function that adds two numbers.", **extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 12, **extra}


@pytest.fixture
def api(tmp_path, tokenizer):
    with gateway(tmp_path, tokenizer) as g:
        yield g


def test_every_answered_token_is_recorded_with_logprob_routing_and_version(api, tokenizer):
    client, store, engine = api
    r = client.post("/v1/chat/completions", json=chat(n=2, seed=3, user="ada", metadata={"session_id": "s-1"}))
    assert r.status_code == 200, r.text
    body = r.json()
    rec = store.get_completion(body["id"])  # the answer's id names a record already on disk
    assert rec is not None and rec.user == "ada" and rec.session_id == "s-1" and rec.api_key_name == "client"
    prompt = tokenizer.encode(render_messages([{"role": "user", "content": chat()["messages"][0]["content"]}],
                                              add_generation_prompt=True))
    assert rec.prompt_token_ids == prompt and rec.model_name == MODEL and rec.model_version == 0
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": rec.completion_tokens,
                             "total_tokens": len(prompt) + rec.completion_tokens}
    model = engine.engine.model
    for choice, crec in zip(body["choices"], rec.choices):
        T = len(crec.token_ids)
        assert choice["message"]["content"] == crec.content == crec.text
        assert choice["finish_reason"] == crec.finish_reason and crec.versions == [0] * T
        # the recorded logprobs and routing are those the model computes for the recorded tokens
        with torch.no_grad():
            out = model(torch.tensor([prompt + crec.token_ids]), capture_routing=True)
        raw = torch.log_softmax(out.logits_BTV[0, len(prompt) - 1:-1], -1).gather(1, torch.tensor(crec.token_ids)[:, None])
        torch.testing.assert_close(torch.tensor(crec.raw_logprobs), raw[:, 0], atol=1e-4, rtol=0)
        assert all(lp < 0 for lp in crec.logprobs)  # temperature 1: the sampled distribution's logprobs
        assert crec.routing.dtype == np.uint8 and crec.routing.shape == (len(prompt) + T - 1, 3, 2)
        assert np.array_equal(crec.routing, out.routing_BTLK[0, :-1].numpy())
    assert rec.choices[0].token_ids != rec.choices[1].token_ids  # seeds seed, seed+1


def test_session_header_wins_and_logprobs_come_back(api):
    client, store, _ = api
    r = client.post("/v1/chat/completions", json=chat(logprobs=True, top_logprobs=3, temperature=0,
                                                      metadata={"session_id": "meta"}),
                    headers={"X-Session-Id": "hdr"})
    body = r.json()
    rec = store.get_completion(body["id"])
    assert rec.session_id == "hdr"
    content = body["choices"][0]["logprobs"]["content"]
    crec = rec.choices[0]
    assert [c["logprob"] for c in content] == pytest.approx(crec.raw_logprobs[:len(content)])
    assert all(len(c["top_logprobs"]) == 3 and c["top_logprobs"][0]["logprob"] >= c["logprob"] for c in content)
    assert crec.logprobs == [0.0] * len(crec.token_ids)  # greedy: a point mass
    # Each token's bytes, joined, are the reply's (a token may hold part of a character: its bytes do not
    # round-trip through its text).
    assert bytes(b for c in content for b in c["bytes"]).decode(errors="replace") == crec.text


def test_streaming_sends_what_it_records_and_ends_with_done(api):
    client, store, _ = api
    r = client.post("/v1/chat/completions", json=chat(stream=True, n=2, stream_options={"include_usage": True}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in r.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    rec = store.get_completion(chunks[0]["id"])
    assert rec.stream and all(c["id"] == rec.completion_id for c in chunks)
    for i, crec in enumerate(rec.choices):
        text = "".join(ch["delta"].get("content", "") for c in chunks for ch in c["choices"] if ch["index"] == i)
        assert text == crec.content
        assert [ch["finish_reason"] for c in chunks for ch in c["choices"]
                if ch["index"] == i and ch.get("finish_reason")] == [crec.finish_reason]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == rec.completion_tokens


def test_a_streams_fingerprint_is_its_first_tokens_version_when_weights_swap_under_it(api, monkeypatch):
    client, store, engine = api
    real_stream = AsyncEngine.stream

    async def swap_after_the_first_token(self, *args, **kwargs):
        events = real_stream(self, *args, **kwargs)
        first = await anext(events)
        self.update_weights(dict(self.engine.model.named_parameters()), version=9)
        for _ in range(500):  # the engine applies it between decode steps (sampling goes on: 40 tokens)
            if self.engine.version == 9:
                break
            await asyncio.sleep(0.01)
        yield first
        async for event in events:
            yield event

    monkeypatch.setattr(AsyncEngine, "stream", swap_after_the_first_token)
    r = client.post("/v1/chat/completions", json=chat(stream=True, max_tokens=40, temperature=0))
    chunks = [json.loads(e) for e in sse_events(r.text) if e != "[DONE]"]
    rec = store.get_completion(chunks[0]["id"])
    assert engine.version == 9 and rec.model_version == 0 and 9 in rec.choices[0].versions  # a swap mid-reply
    assert {c["system_fingerprint"] for c in chunks} == {"rtrl-v0"}  # the record's version, not the engine's


def test_text_offsets_point_into_the_answered_text(tokenizer):
    """Characters split over byte tokens count once, special tokens (dropped from the text) not at all."""
    special = tokenizer.encode("<|im_start|>")
    ids = tokenizer.encode("x = 1  # \U0001F600 ok") + special + tokenizer.encode("\u00e9!")
    assert len(tokenizer.encode("\U0001F600")) > 1 and len(special) == 1  # the emoji spans tokens
    text = "echo" + tokenizer.decode(ids, skip_special_tokens=True)
    offsets = text_offsets(ids, tokenizer, start=4)
    for i, (token, offset) in enumerate(zip(ids, offsets)):
        assert offset == 4 + len(tokenizer.decode(ids[:i], skip_special_tokens=True).rstrip("\ufffd"))
        piece = tokenizer.decode([token], skip_special_tokens=True)
        if piece and "\ufffd" not in piece:
            assert text[offset:offset + len(piece)] == piece
    assert offsets[-1] == len(text) - 1  # "!"


@pytest.fixture
def tool_api(tmp_path, tokenizer):
    with gateway(tmp_path, tokenizer, model=two_gram_model(tokenizer)) as g:
        yield g


def test_tool_calls_come_back_in_the_openai_shape(tool_api):
    client, store, _ = tool_api
    r = client.post("/v1/chat/completions", json=chat("Weather in Paris?", tools=[WEATHER], temperature=0,
                                                      max_tokens=64))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    crec = store.get_completion(r.json()["id"]).choices[0]
    assert crec.text == TOOL_TEXT and crec.tool_calls[0].function.name == "get_weather"
    assert crec.malformed_tool_calls == 0 and crec.finish_reason == "tool_calls"


def test_a_stream_sends_the_recorded_content_around_tool_calls(tmp_path, tokenizer):
    """The text before and after a tool call is the recorded content (joined and trimmed): a stream sends
    that content, as a plain answer does, and the call. The blank line before the call is held back."""
    text, content = f"Let me check.\n\n{TOOL_TEXT}\n\nDone.", "Let me check.\nDone."
    model = two_gram_model(tokenizer, text)
    with gateway(tmp_path, tokenizer, model=model, max_seq_len=512) as (client, store, _):
        body = chat("Weather in Paris?", tools=[WEATHER], temperature=0, max_tokens=100)
        plain = client.post("/v1/chat/completions", json=body).json()
        r = client.post("/v1/chat/completions", json={**body, "stream": True})
        chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
        deltas = [ch["delta"] for c in chunks for ch in c["choices"]]
        assert plain["choices"][0]["message"]["content"] == "".join(d.get("content") or "" for d in deltas)
        assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls") or []] == ["get_weather"]
        for completion_id in (plain["id"], chunks[0]["id"]):
            crec = store.get_completion(completion_id).choices[0]
            assert crec.text == text and crec.content == content and crec.finish_reason == "tool_calls"


def test_a_malformed_tool_call_is_answered_as_content_and_recorded(tool_api):
    client, store, _ = tool_api
    other = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
    for extra in ({"tools": [other]}, {"tools": [WEATHER], "tool_choice": "none"}):
        r = client.post("/v1/chat/completions", json=chat("Weather?", temperature=0, max_tokens=64, **extra))
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] == TOOL_TEXT and choice["message"]["tool_calls"] is None
        assert choice["finish_reason"] == "stop"
        rec = store.get_completion(r.json()["id"])
        assert [e.kind for e in rec.choices[0].tool_call_errors] == ["unknown_tool"]
        assert rec.choices[0].malformed_tool_calls == 1
    # tool_choice "none" renders the prompt without the tools
    assert "get_weather" not in client.app.state.serve.tokenizer.decode(rec.prompt_token_ids)
    assert "rtrl_serve_malformed_tool_calls_total 2.0" in client.get("/metrics").text


def test_auth_scopes_and_open_routes(tmp_path, tokenizer):
    with gateway(tmp_path, tokenizer) as (client, _, _):
        url = "/v1/chat/completions"
        r = client.post(url, json=chat(), headers={"Authorization": ""})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "authentication_error"
        assert client.post(url, json=chat(), headers={"Authorization": "Bearer wrong-key-0000000000"}).status_code == 401
        r = client.post(url, json=chat(), headers={"Authorization": f"Bearer {KEYS[1].key}"})
        assert r.status_code == 403 and "inference" in r.json()["error"]["message"]
        assert client.get("/v1/models", headers={"Authorization": ""}).status_code == 401
        assert client.get("/v1/models").json()["data"][0]["id"] == MODEL
        assert client.get("/v1/models/other").status_code == 404
        assert client.get("/health", headers={"Authorization": ""}).json()["status"] == "ok"
        assert client.get("/metrics", headers={"Authorization": ""}).status_code == 200
    with gateway(tmp_path / "open", tokenizer, api_keys=[], allow_unauthenticated=True) as (client, store, _):
        r = client.post("/v1/chat/completions", json=chat(), headers={"Authorization": ""})
        assert r.status_code == 200 and store.get_completion(r.json()["id"]).api_key_name is None


M = [{"role": "user", "content": "hi"}]


def req(**fields):
    return {"model": MODEL, "messages": M, **fields}


def fn(**function):
    return [{"type": "function", "function": {"name": "f", **function}}]


BAD = [
    (req(messages=[]), "messages"),
    (req(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
    (req(messages=[{"role": "user"}]), "messages[0].content"),
    (req(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id"),
    (req(messages=[{"role": "user", "content": "x", "tool_calls": []}]), "messages[0].tool_calls"),
    (req(messages=[{"role": "assistant"}]), "messages[0]"),
    (req(messages=[{"role": "user", "content": "word " * 400}]), "messages"),  # longer than the context
    (req(temperature=-0.1), "temperature"), (req(temperature=2.1), "temperature"),
    (req(top_p=0), "top_p"), (req(top_p=1.5), "top_p"),
    (req(n=0), "n"), (req(n=17), "n"), (req(n=9), "n"),  # 9: above the engine's batch of 8
    (req(max_tokens=0), "max_tokens"), (req(max_tokens=10_000), "max_tokens"),  # does not fit the context
    (req(stop=[""]), "stop"),
    (req(tools=fn(name="a b")), "tools[0].function.name"),
    (req(tools=fn(parameters={"type": "object", "required": "city"})), "tools[0].function.parameters"),
    (req(tools=fn(parameters={"type": "string"})), "tools[0].function.parameters"),
    (req(tools=fn() + fn()), None),  # duplicate names
    (req(tool_choice="required"), None), (req(tool_choice={"type": "function", "function": {"name": "f"}}), None),
    (req(logit_bias={"1": 5}), "logit_bias"), (req(frequency_penalty=0.5), None), (req(top_logprobs=2), None),
    (req(stream_options={"include_usage": True}), None), (req(stream=False, stream_options={}), None),
    (req(metadata={"session_id": "s" * 257}), "metadata"),  # longer than feedback's gen_ai.conversation.id
    (req(user="u\u0000"), "user"), (req(metadata={"task": "a\u0000"}), "metadata"),  # text the store cannot hold
    (req(messages=[*M, {"role": "assistant", "content": "hi", "refusal": "no"}, *M]), "messages[1].refusal"),
    ({"messages": M}, "model"),
    (req(response_format={"type": "json_object"}), None),  # no constrained decoding
    (req(response_format={"type": "xml"}), "response_format.type"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_a_400_that_names_the_field(api, body, param):
    client, store, _ = api
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert param is None or error["param"] == param
    assert store.count_completions() == 0


def test_a_lone_surrogate_anywhere_in_the_body_is_a_400_before_generating(api):
    """JSON's \\ud800 escape parses in Python but is not Unicode text: the store refused it after generating."""
    client, store, _ = api
    message = b'"messages": [{"role": "user", "content": "%s"}]'
    lone = [message % b"hi \\ud800", message % b"\\udfff", message % b"hi" + b', "user": "\\ud83d"']
    for fields in lone:
        body = b'{"model": "%s", %s, "max_tokens": 4}' % (MODEL.encode(), fields)
        r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
    assert store.count_completions() == 0
    nested = b'{"model": "%s", "messages": %s"\\u0041"%s}' % (MODEL.encode(), b"[" * 50_000, b"]" * 50_000)
    r = client.post("/v1/chat/completions", content=nested, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:200]  # a RecursionError in the surrogate check was a 500
    paired = b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud83d\\ude00 C:\\\\ud800"}], ' \
             b'"max_tokens": 4}' % MODEL.encode()  # an escaped pair (an emoji), and an escaped backslash
    r = client.post("/v1/chat/completions", content=paired, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert store.count_completions() == 1
    # The raw UTF-8 bytes of a surrogate: json.loads(bytes) decodes them (surrogatepass). As a stop string the
    # engine's thread died encoding it (503 for everyone after); as content or prompt, the tokenizer's TypeError, 500.
    raw = b"\xed\xa0\x80"
    bodies = {"/v1/chat/completions": [b'"messages": [{"role": "user", "content": "hi"}], "stop": ["%s"]' % raw,
                                       b'"messages": [{"role": "user", "content": "hi %s"}]' % raw],
              "/v1/completions": [b'"prompt": "hi %s"' % raw]}
    for route, fields in bodies.items():
        for field in fields:
            body = b'{"model": "%s", %s, "max_tokens": 4}' % (MODEL.encode(), field)
            r = client.post(route, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400 and "not UTF-8" in r.json()["error"]["message"], r.text
    assert client.get("/health").status_code == 200
    assert client.post("/v1/chat/completions", json=chat()).status_code == 200


def test_a_stop_string_that_is_not_unicode_is_refused_on_the_callers_thread(tokenizer):
    engine = Engine(Qwen3ForCausalLM(tiny_config()), max_batch=2, max_seq_len=32, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="not Unicode text"):
        engine.add_request([1, 2], SamplingParams(max_tokens=2, stop=["\ud800"]))
    assert engine.generate([[1, 2]], SamplingParams(max_tokens=2))[0].samples[0].token_ids


def test_response_format_text_is_the_default_it_names():
    ok = req(response_format={"type": "text"})
    assert ChatCompletionCreate.model_validate(ok).response_format.type == "text"


def test_malformed_bodies_unknown_models_and_routes(api):
    client, _, _ = api
    for raw in (b"{not json", b"", b"[1, 2]", b"\xff\xfe"):
        r = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"], raw
    r = client.post("/v1/chat/completions", json={"model": "gpt-9", "messages": M})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert client.get("/v1/nothing").json()["error"]["type"] == "not_found_error"
    assert client.delete("/v1/chat/completions").status_code == 405


def test_overload_is_a_503_with_retry_after(tmp_path, tokenizer):
    with gateway(tmp_path, tokenizer, max_pending=0) as (client, store, _):
        for stream in (False, True):
            r = client.post("/v1/chat/completions", json=chat(stream=stream))
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "overloaded"
        assert store.count_completions() == 0


def test_a_slow_generation_is_a_504_and_frees_the_engine(tmp_path, tokenizer):
    with gateway(tmp_path, tokenizer, request_timeout_s=0.05) as (client, store, engine):
        r = client.post("/v1/chat/completions", json=chat(max_tokens=200))
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        assert store.count_completions() == 0
        deadline = time.monotonic() + 5  # the aborted request leaves the engine at its next step
        while engine.engine.num_running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.engine.num_running == 0 and engine.engine.num_waiting == 0


def test_a_failing_store_is_a_503_not_a_lost_record(tmp_path, tokenizer):
    with gateway(tmp_path, tokenizer) as (client, store, _):
        store.close()
        r = client.post("/v1/chat/completions", json=chat())
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"


def sse_events(text: str) -> list[str]:
    return [line.removeprefix("data: ") for line in text.split("\n\n") if line]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_that_dies_mid_request_is_a_503_and_a_stream_says_so(tmp_path, tokenizer, monkeypatch,
                                                                        stream):
    """The engine thread dies after the request's first token: a plain request is a 503, not a 500; a
    stream that has begun ends with the error event, not cut off. Nothing is recorded."""
    import realtime_rl.serve.streaming as streaming

    started, push = threading.Event(), streaming.TextStreamer.push

    def push_and_tell(self, token):
        started.set()  # the stream's body has begun
        return push(self, token)

    monkeypatch.setattr(streaming.TextStreamer, "push", push_and_tell)
    with gateway(tmp_path, tokenizer) as (client, store, engine):
        step, steps = engine.engine.step, []

        def failing_step():  # the first step prefills and samples the first token
            steps.append(1)
            if len(steps) == 2:
                if stream:
                    started.wait(30)
                raise RuntimeError("device lost")
            return step()

        engine.engine.step = failing_step
        r = client.post("/v1/chat/completions", json=chat(stream=stream, temperature=0, max_tokens=12))
        assert len(steps) == 2, "the request ended before the engine died"
        if stream:
            events = sse_events(r.text)
            assert r.status_code == 200 and "[DONE]" not in events and len(events) > 1
            assert json.loads(events[-1])["error"]["code"] == "engine_unavailable"
            metric = 'rtrl_serve_stream_errors_total{arm="champion",code="engine_unavailable"} 1.0'
            assert metric in client.get("/metrics").text
        else:
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert store.count_completions() == 0


def test_a_bug_mid_stream_ends_it_with_an_error_event_and_is_logged(api, monkeypatch, caplog):
    import realtime_rl.serve.streaming as streaming

    client, store, _ = api

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(streaming.ChatChunks, "build_choice", staticmethod(broken))
    r = client.post("/v1/chat/completions", json=chat(stream=True))
    events = sse_events(r.text)
    assert r.status_code == 200 and "[DONE]" not in events
    assert json.loads(events[-1])["error"]["code"] == "internal_error"
    assert any(rec.name == "realtime_rl.serve.streaming" and rec.exc_info for rec in caplog.records)
    assert store.count_completions() == 0
    # the answer's status is 200; the failure is counted by arm and code
    metric = 'rtrl_serve_stream_errors_total{arm="champion",code="internal_error"} 1.0'
    assert metric in client.get("/metrics").text


def test_metrics_count_requests_tokens_and_the_served_version(api, tokenizer):
    client, store, engine = api
    client.post("/v1/chat/completions", json=chat())
    client.post("/v1/chat/completions", json=chat(temperature=5))
    engine.update_weights(dict(engine.engine.model.named_parameters()), version=7)
    r = client.post("/v1/chat/completions", json=chat(max_tokens=3))
    assert r.json()["system_fingerprint"] == "rtrl-v7"
    assert store.get_completion(r.json()["id"]).choices[0].versions == [7] * 3
    text = client.get("/metrics").text
    tokens = sum(rec.completion_tokens for rec in store.list_completions())
    assert 'rtrl_serve_requests_total{method="POST",route="/v1/chat/completions",status="200"} 2.0' in text
    assert 'rtrl_serve_requests_total{method="POST",route="/v1/chat/completions",status="400"} 1.0' in text
    assert f"rtrl_serve_generated_tokens_total {float(tokens)}" in text
    assert "rtrl_serve_model_version 7.0" in text and "rtrl_serve_engine_running 0.0" in text
    assert 'rtrl_serve_request_duration_seconds_count{route="/v1/chat/completions"} 3.0' in text


def test_the_gateway_follows_a_weight_store_and_rejects_a_corrupt_delta(tmp_path, tokenizer):
    """The registry-to-gateway path: published versions arrive as verified deltas and are hot-swapped in;
    a corrupted delta is rejected and the last good version keeps serving."""
    import time

    from realtime_rl.deploy import FilesystemTransport, WeightPublisher

    model = random_model(tokenizer)
    store = FilesystemTransport(tmp_path / "weights")
    publisher = WeightPublisher(store, dtype=None, snapshot_every=100)
    state = {k: v.detach().clone() for k, v in model.named_parameters()}
    publisher.publish(state, 1)

    def wait_for(engine, version):
        deadline = time.monotonic() + 30
        while engine.version != version:
            assert time.monotonic() < deadline, f"gateway still on version {engine.version}, expected {version}"
            time.sleep(0.02)

    with gateway(tmp_path, tokenizer, model=model, weights=str(tmp_path / "weights"),
                 weights_poll_s=0.05) as (client, _, engine):
        wait_for(engine, 1)
        state["lm_head.weight"][0, :5] += 1.0  # version 2 changes a few elements
        publisher.publish(state, 2)
        wait_for(engine, 2)
        assert torch.equal(engine.engine.model.lm_head.weight, state["lm_head.weight"])
        assert client.post("/v1/chat/completions", json=chat(max_tokens=4)).status_code == 200

        state["lm_head.weight"][1, :5] += 1.0
        commit = store.commit

        def rot_then_commit(staging, version):  # bit rot in transit, before the version is visible (else a
            blob = staging / store.blob_path(version, "delta").name  # fast poll could take the good bytes)
            data = bytearray(blob.read_bytes())
            data[len(data) // 2] ^= 0xFF
            blob.write_bytes(bytes(data))
            commit(staging, version)

        store.commit = rot_then_commit
        publisher.publish(state, 3)
        time.sleep(0.5)
        assert engine.version == 2  # rejected by checksum; version 2 keeps serving
        assert client.post("/v1/chat/completions", json=chat(max_tokens=4)).status_code == 200
