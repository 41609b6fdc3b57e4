"""POST /v1/feedback through FastAPI's TestClient on SQLite and Postgres: events are acknowledged once
stored, keyed by OpenTelemetry attribute names; retries are duplicates, a changed retry a 409; a bad
event rejects its whole batch with a 400 naming it; the feedback scope is required; an event about a
completion joins it; Prometheus counts events by type."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
from fastapi.testclient import TestClient

from realtime_rl.collect import EVENT_TYPES, open_event_store
from realtime_rl.config import ApiKey, ServeConfig
from realtime_rl.engine import AsyncEngine, Engine
from realtime_rl.serve import create_app
from tests.stores import BACKENDS, store_location
from tests.unit.test_event_store import make_record
from tests.unit.test_serve_api import AUTH, KEYS, MODEL, random_model

INFERENCE_ONLY = ApiKey(name="inference-only", key="k-inference-only-0123456", scopes=["inference"])
FEEDBACK_ONLY = {"Authorization": f"Bearer {KEYS[1].key}"}


@contextmanager
def feedback_gateway(tmp_path, tokenizer, location):
    engine = AsyncEngine(Engine(random_model(tokenizer), tokenizer, max_batch=4, max_seq_len=128), max_pending=8)
    store = open_event_store(tmp_path, location)
    try:
        settings = ServeConfig(api_keys=[*KEYS, INFERENCE_ONLY], run_dir=tmp_path)
        with TestClient(create_app(settings, engine, store)) as client:
            client.headers.update(AUTH)
            yield client, store
    finally:
        engine.stop()
        store.close()


@pytest.fixture(params=BACKENDS)
def api(request, tmp_path, tokenizer):
    with store_location(request.param, tmp_path) as location, feedback_gateway(tmp_path, tokenizer, location) as g:
        yield g


def event(event_id: str, type: str = "edit_accepted", **fields) -> dict:
    body = {"log.record.uid": event_id, "event.name": type}
    if "gen_ai.conversation.id" not in fields:
        body["gen_ai.response.id"] = "chatcmpl-1"
    return body | fields


ONE_OF_EACH = [
    event("e-acc", "edit_accepted", **{"choice_index": 1, "gen_ai.evaluation.score.value": 0.8}),
    event("e-rej", "edit_rejected"),
    event("e-per", "edit_persisted", window_s=600),
    event("e-rev", "edit_reverted", window_s=30.5),
    event("e-dis", "followup_dissatisfied", **{"gen_ai.conversation.id": "sess-1"}),
    event("e-neu", "followup_neutral", **{"user.id": "ada", "timestamp": 1_750_000_000.25}),
    event("e-tool", "tool_call_error", **{"gen_ai.tool.call.id": "call_7", "gen_ai.tool.name": "run_tests",
                                         "error.type": "bad_json"}),
    event("e-end", "session_end", **{"gen_ai.conversation.id": "sess-1"}),
    event("e-cus", "custom", **{"gen_ai.evaluation.name": "lint_clean", "gen_ai.evaluation.score.value": 3,
                                "attributes": {"task.difficulty": 2, "editor": "vim", "ok": True}}),
    event("e-und", "undelivered", attributes={"reason": "never shown"}),
]


def test_every_event_type_is_stored_under_its_otel_names_once_acknowledged(api):
    client, store = api
    r = client.post("/v1/feedback", json={"events": ONE_OF_EACH})
    assert r.status_code == 200, r.text
    assert r.json() == {"object": "feedback.ack", "received": 10, "stored": 10, "duplicates": []}
    got = {e.event_id: e for e in store.list_events()}  # the ack came after the commit
    assert [e.type for e in got.values()] == list(EVENT_TYPES)
    assert (got["e-acc"].completion_id, got["e-acc"].choice_index, got["e-acc"].value) == ("chatcmpl-1", 1, 0.8)
    assert got["e-per"].window_s == 600.0 and got["e-dis"].session_id == "sess-1"
    assert (got["e-neu"].user, got["e-neu"].occurred_at) == ("ada", 1_750_000_000.25)
    assert (got["e-tool"].tool_call_id, got["e-tool"].tool_name, got["e-tool"].error_type) == (
        "call_7", "run_tests", "bad_json")
    assert (got["e-cus"].name, got["e-cus"].value) == ("lint_clean", 3.0)
    assert got["e-cus"].attributes == {"task.difficulty": 2, "editor": "vim", "ok": True}
    assert {e.api_key_name for e in got.values()} == {"client"}
    metrics = client.get("/metrics").text
    for t in EVENT_TYPES:
        assert f'rtrl_serve_feedback_events_total{{type="{t}"}} 1.0' in metrics
    assert "rtrl_serve_feedback_commit_events_count 1.0" in metrics


def test_one_event_without_a_batch(api):
    client, store = api
    r = client.post("/v1/feedback", json=event("single"), headers=FEEDBACK_ONLY)
    assert r.status_code == 200 and r.json()["stored"] == 1
    (e,) = store.list_events()
    assert (e.event_id, e.type, e.api_key_name) == ("single", "edit_accepted", "fb")


def test_a_retry_is_acknowledged_and_not_stored_twice(api):
    client, store = api
    assert client.post("/v1/feedback", json={"events": ONE_OF_EACH[:4]}).json()["stored"] == 4
    r = client.post("/v1/feedback", json={"events": ONE_OF_EACH[:6]})  # a retry that grew two events
    assert r.status_code == 200
    assert r.json() == {"object": "feedback.ack", "received": 6, "stored": 2,
                        "duplicates": ["e-acc", "e-rej", "e-per", "e-rev"]}
    assert store.count_events() == 6
    assert "rtrl_serve_feedback_duplicates_total 4.0" in client.get("/metrics").text


def test_the_same_id_with_other_content_is_a_409_and_stores_nothing(api):
    client, store = api
    client.post("/v1/feedback", json=event("taken"))
    r = client.post("/v1/feedback", json={"events": [event("new-1"), event("taken", "edit_rejected")]})
    assert r.status_code == 409
    err = r.json()["error"]
    assert err["code"] == "event_id_conflict" and err["type"] == "conflict_error"
    assert "'taken' is already recorded with different content" in err["message"]
    assert [e.event_id for e in store.list_events()] == ["taken"]


@pytest.mark.parametrize("body, param, words", [
    ({"events": [event("ok-1"), event("bad", "custom"), event("ok-2")]}, "events[1]",
     "custom event needs a name and a numeric value"),
    ({"events": [event("ok-1"), event("bad", "edit_acepted")]}, "events[1].event.name", "edit_accepted"),
    ({"events": [event("ok-1"), {"log.record.uid": "bad", "event.name": "edit_accepted"}]}, "events[1]",
     "name the completion"),
    ({"events": [event("ok-1", gen_ai_response_id="x")]}, "events[0].gen_ai_response_id", "Extra inputs"),
    ({"events": [event("ok-1", window_s=-1)]}, "events[0].window_s", "greater than 0"),
    ({"events": [event("has space")]}, "events[0].log.record.uid", "pattern"),
    ({"events": [event("ok-1"), event("nul", **{"gen_ai.conversation.id": "s-\u0000"})]}, "events[1]", "NUL"),
    ({"events": [event("nul", attributes={"editor": "vim\u0000"})]}, "events[0]", "NUL"),
    ({"events": []}, "events", "at least 1"),
    ({"events": [event(f"e{i}") for i in range(1001)]}, "events", "at most 1000"),
    ([event("listed")], None, "valid dictionary"),
    (event("nan", "custom", **{"gen_ai.evaluation.name": "x", "gen_ai.evaluation.score.value": "NaN"}),
     "gen_ai.evaluation.score.value", "finite"),
])
def test_a_bad_event_is_a_400_naming_it_and_nothing_of_the_batch_is_stored(api, body, param, words):
    client, store = api
    r = client.post("/v1/feedback", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert store.count_events() == 0


def test_a_lone_surrogate_is_a_400_and_nothing_of_the_batch_is_stored(api):
    client, store = api
    body = b'{"events": [{"log.record.uid": "ok", "event.name": "edit_accepted", "gen_ai.response.id": "c"}, ' \
           b'{"log.record.uid": "bad", "event.name": "edit_accepted", "gen_ai.response.id": "c\\ud800"}]}'
    r = client.post("/v1/feedback", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]
    assert store.count_events() == 0
    r = client.post("/v1/feedback", json=event("ok"))  # and the next batch goes through
    assert r.status_code == 200 and store.count_events() == 1


def test_malformed_json_is_a_400(api):
    client, _ = api
    r = client.post("/v1/feedback", content=b'{"events": [', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_the_feedback_scope_is_required(api):
    client, store = api
    assert client.post("/v1/feedback", json=event("a"), headers={"Authorization": ""}).status_code == 401
    r = client.post("/v1/feedback", json=event("a"), headers={"Authorization": "Bearer wrong-key-000000"})
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
    r = client.post("/v1/feedback", json=event("a"), headers={"Authorization": f"Bearer {INFERENCE_ONLY.key}"})
    assert r.status_code == 403 and "'feedback' scope" in r.json()["error"]["message"]
    assert store.count_events() == 0


def test_feedback_joins_the_completion_it_names_even_when_it_came_first(api):
    client, store = api
    resp = client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": "hi"}]}).json()
    assert client.post("/v1/feedback", json=event("after", **{"gen_ai.response.id": resp["id"]})).status_code == 200
    early = event("before", **{"gen_ai.response.id": "chatcmpl-elsewhere"})  # served by another gateway
    assert client.post("/v1/feedback", json=early).status_code == 200
    assert [c for _, c in store.join_events()][1] is None
    store.add_completion(make_record("chatcmpl-elsewhere"))  # ... whose record lands later
    joined = {e.event_id: c for e, c in store.join_events()}
    assert joined["after"].completion_id == resp["id"] and joined["before"].completion_id == "chatcmpl-elsewhere"


def test_a_failing_store_is_a_503_and_the_retry_succeeds(api, monkeypatch):
    client, store = api
    real = store.add_event_batches

    def fail(batches):
        raise OSError("disk full")

    monkeypatch.setattr(store, "add_event_batches", fail)
    r = client.post("/v1/feedback", json={"events": ONE_OF_EACH})
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert "retry the same batch" in r.json()["error"]["message"]
    monkeypatch.setattr(store, "add_event_batches", real)
    assert client.post("/v1/feedback", json={"events": ONE_OF_EACH}).json()["stored"] == len(ONE_OF_EACH)
