"""No input gets a 5xx: schemathesis fuzzes every operation of the gateway's own OpenAPI spec (valid and
invalid requests), and hypothesis sends near-valid chat bodies and raw bytes. Every 4xx has the OpenAI
error shape; every 200 completion is in the event store. The engine and store are real (tiny MoE, SQLite)."""

from __future__ import annotations

import json

import pytest
import schemathesis
from schemathesis import GenerationMode
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from realtime_rl.collect import SqliteEventStore
from realtime_rl.config import ApiKey, ServeConfig
from realtime_rl.engine import AsyncEngine, Engine
from realtime_rl.serve import create_app
from tests.unit.test_serve_api import KEYS, MODEL, WEATHER, random_model

ADMIN = ApiKey(name="admin", key="k-admin-fuzz-0123456789", scopes=["inference", "feedback", "admin"])
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN.key}"}  # every scope, so the admin routes are fuzzed too
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, tokenizer):
    # A short context keeps every generation small; limits are part of what gets fuzzed.
    engine = AsyncEngine(Engine(random_model(tokenizer), tokenizer, max_batch=4, max_seq_len=384), max_pending=8)
    run_dir = tmp_path_factory.mktemp("fuzz")
    store = SqliteEventStore(run_dir / "events.sqlite")
    app = create_app(ServeConfig(api_keys=[*KEYS, ADMIN], default_max_tokens=4, request_timeout_s=20,
                                 run_dir=run_dir), engine, store)
    with TestClient(app) as client:
        client.headers.update(ADMIN_AUTH)
        yield app, client, store
    engine.stop()
    store.close()


@pytest.fixture(scope="module")
def api_schema(gateway):
    return schemathesis.openapi.from_asgi("/openapi.json", gateway[0])


def check_answer(status: int, body: bytes, store: SqliteEventStore, stream: bool = False) -> None:
    assert status < 500, body[:500]
    if status >= 400:
        error = json.loads(body)["error"]
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    elif not stream and body.startswith((b'{"id":"chatcmpl-', b'{"id":"cmpl-')):
        assert store.get_completion(json.loads(body)["id"]) is not None


OPERATIONS = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
              ("GET", "/v1/models/{model}"),
              ("GET", "/health"), ("GET", "/metrics"), ("POST", "/v1/feedback"),
              ("GET", "/v1/admin/traffic"), ("PUT", "/v1/admin/traffic")]


def test_every_operation_is_fuzzed(api_schema):
    found = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert found == set(OPERATIONS)


# Negative cases need inputs to break: /health and /metrics take none.
CASES = [(m, p, mode) for m, p in OPERATIONS for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
         if mode == GenerationMode.POSITIVE or p not in ("/health", "/metrics")]


@pytest.mark.parametrize("method,path,mode", CASES, ids=[f"{p}-{mode.value}" for _, p, mode in CASES])
def test_schemathesis_finds_no_server_error(api_schema, gateway, method, path, mode):
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @FUZZ
    def call(case):
        if mode == GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL  # a random model name would stop every valid request at the 404
        response = case.call(headers=ADMIN_AUTH)
        stream = response.headers.get("content-type", [""])[0].startswith("text/event-stream")
        check_answer(response.status_code, response.content, gateway[2], stream)

    call()


scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
json_values = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c,
                                                                                          max_size=3), max_leaves=8)
text = st.text(max_size=40) | st.sampled_from(["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_response>"])
content = text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2)
tool_call = st.fixed_dictionaries({"id": st.text(max_size=8), "type": st.just("function"),
                                   "function": st.fixed_dictionaries({"name": st.text(max_size=8),
                                                                      "arguments": st.text(max_size=20)})})
valid_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user"]), "content": content}),
    st.fixed_dictionaries({"role": st.just("assistant")},
                          optional={"content": content, "tool_calls": st.lists(tool_call, min_size=1, max_size=2)}),
    st.fixed_dictionaries({"role": st.just("tool"), "content": content, "tool_call_id": st.text(min_size=1, max_size=8)}),
)
junk_message = st.fixed_dictionaries({"role": st.text(max_size=8) | json_values},
                                     optional={"content": json_values, "tool_calls": json_values, "name": json_values})
tool = st.just(WEATHER) | st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.from_regex(r"[a-z_]{1,10}", fullmatch=True) | st.text(max_size=5)},
        optional={"parameters": st.dictionaries(st.sampled_from(["type", "properties", "required",
                                                                 "additionalProperties"]), json_values, max_size=4),
                  "description": st.text(max_size=10)})})
bodies = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, MODEL, MODEL, "other"]),
     "messages": st.lists(valid_message, min_size=1, max_size=3) | st.lists(valid_message | junk_message, max_size=3)},
    optional={"temperature": st.floats(-1, 3) | json_values, "top_p": st.floats(-0.5, 1.5) | json_values,
              "n": st.integers(-1, 6), "max_tokens": st.integers(-2, 24) | st.none() | json_values,
              "max_completion_tokens": st.integers(-1, 24), "stop": text | st.lists(text, max_size=5),
              "tools": st.lists(tool, max_size=2), "tool_choice": st.sampled_from(["auto", "none", "required"]),
              "stream": st.booleans(), "seed": st.integers(-(2**64), 2**64), "logprobs": st.booleans(),
              "top_logprobs": st.integers(-1, 25), "user": st.text(max_size=10),
              "metadata": st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3) | json_values,
              "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
              "unknown_field": json_values})


@given(body=bodies)
@FUZZ
def test_near_valid_chat_bodies_never_get_a_server_error(gateway, body):
    _, client, store = gateway
    # json.dumps writes NaN and Infinity literals, which Python's JSON parser (and so FastAPI) accepts
    r = client.post("/v1/chat/completions", content=json.dumps(body),
                    headers={"X-Session-Id": "fuzz", "content-type": "application/json"})
    check_answer(r.status_code, r.content, store, stream=bool(body.get("stream")))
    if r.status_code == 200 and body.get("stream"):
        assert r.text.endswith("data: [DONE]\n\n")


token_ids = st.lists(st.integers(-5, 5000) | st.integers(-(2**70), 2**70), max_size=6)
text_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, MODEL, "other"]),
     "prompt": text | token_ids | st.lists(text, max_size=2) | st.lists(token_ids, max_size=2) | json_values},
    optional={"temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5), "n": st.integers(-1, 6),
              "max_tokens": st.integers(-2, 24) | st.none(), "stop": text | st.lists(text, max_size=5),
              "stream": st.booleans(), "echo": st.booleans(), "logprobs": st.integers(-1, 25) | st.none(),
              "best_of": st.integers(0, 4), "suffix": text | st.none(), "logit_bias": json_values,
              "seed": st.integers(-(2**64), 2**64), "user": st.text(max_size=10),
              "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values})


@given(body=text_bodies)
@FUZZ
def test_near_valid_text_completion_bodies_never_get_a_server_error(gateway, body):
    _, client, store = gateway
    r = client.post("/v1/completions", content=json.dumps(body), headers={"content-type": "application/json"})
    check_answer(r.status_code, r.content, store, stream=bool(body.get("stream")))
    if r.status_code == 200 and body.get("stream"):
        assert r.text.endswith("data: [DONE]\n\n")


@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
@FUZZ
def test_raw_bodies_are_a_4xx(gateway, raw):
    _, client, store = gateway
    r = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500
    check_answer(r.status_code, r.content, store)
