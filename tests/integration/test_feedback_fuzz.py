"""No input to POST /v1/feedback gets a 5xx: schemathesis fuzzes the operation from the gateway's own
OpenAPI spec (valid and invalid bodies) and hypothesis sends near-valid events; every 4xx has the
OpenAI error shape and stores nothing, every 200 names only events that are in the store."""

from __future__ import annotations

import json

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from realtime_rl.collect import EVENT_TYPES, SqliteEventStore
from realtime_rl.config import ServeConfig
from realtime_rl.engine import AsyncEngine, Engine
from realtime_rl.serve import create_app
from tests.unit.test_serve_api import AUTH, KEYS, random_model

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, tokenizer):
    engine = AsyncEngine(Engine(random_model(tokenizer), tokenizer, max_batch=2, max_seq_len=128), max_pending=4)
    store = SqliteEventStore(tmp_path_factory.mktemp("fuzz") / "events.sqlite")
    with TestClient(create_app(ServeConfig(api_keys=KEYS), engine, store)) as client:
        client.headers.update(AUTH)
        yield engine, client, store
    engine.stop()
    store.close()


def check_answer(status: int, body: bytes, store: SqliteEventStore, sent: object) -> None:
    assert status < 500, body[:500]
    if status >= 400:
        error = json.loads(body)["error"]
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
        return
    events = sent["events"] if isinstance(sent, dict) and "events" in sent else [sent]
    ids = {e["log.record.uid"] for e in events}
    assert json.loads(body)["received"] == len(events)
    stored = {e.event_id for e in store.list_events(limit=1_000_000)}
    assert ids <= stored


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_schemathesis_finds_no_server_error(gateway, mode):
    engine, _, store = gateway
    app = create_app(ServeConfig(api_keys=KEYS), engine, store)  # an app of its own: schemathesis runs its lifespan
    operation = schemathesis.openapi.from_asgi("/openapi.json", app)["/v1/feedback"]["POST"]

    @given(case=operation.as_strategy(generation_mode=mode))
    @FUZZ
    def call(case):
        response = case.call(headers=AUTH)
        check_answer(response.status_code, response.content, store, case.body)

    call()


_text = st.text(min_size=0, max_size=12)
_junk = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False), _text,
                  st.lists(st.integers(), max_size=2), st.dictionaries(_text, st.integers(), max_size=2))


_id = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=16)
KEYS_ = ["log.record.uid", "event.name", "gen_ai.response.id", "gen_ai.conversation.id", "gen_ai.evaluation.name",
         "gen_ai.evaluation.score.value", "window_s", "choice_index", "gen_ai.tool.name", "gen_ai.tool.call.id",
         "error.type", "timestamp", "attributes", "user.id", "extra"]


@st.composite
def valid_event(draw) -> dict:
    """An event that follows every rule for its type."""
    t = draw(st.sampled_from(EVENT_TYPES))
    e = {"log.record.uid": str(draw(st.uuids())), "event.name": t}
    names = draw(st.sampled_from(["response", "conversation", "both"]))
    if names != "conversation" and t != "session_end":
        e["gen_ai.response.id"] = draw(_id)
    if names != "response" or t == "session_end":
        e["gen_ai.conversation.id"] = draw(_id)
    if t == "custom":
        e["gen_ai.evaluation.name"] = draw(st.from_regex(r"[a-z_]{1,10}", fullmatch=True))
    if t == "custom" or draw(st.booleans()):
        e["gen_ai.evaluation.score.value"] = draw(st.floats(-1e6, 1e6))
    if t == "edit_persisted" or (t.startswith("edit_") and draw(st.booleans())):
        e["window_s"] = draw(st.floats(0.5, 1e5))
    if t == "tool_call_error":
        e |= {"gen_ai.tool.name": draw(_id), "error.type": draw(_id)}
    if draw(st.booleans()):
        e["attributes"] = draw(st.dictionaries(_id, st.one_of(st.integers(-10, 10), _text, st.booleans()),
                                               max_size=3))
    return e


_event = st.one_of(  # valid, or valid with one key set to anything
    valid_event(), st.tuples(valid_event(), st.sampled_from(KEYS_), _junk).map(lambda x: x[0] | {x[1]: x[2]}))


@given(body=st.one_of(_event, st.fixed_dictionaries({"events": st.lists(_event, max_size=4)}), _junk))
@FUZZ
def test_near_valid_events_get_a_4xx_or_are_stored(gateway, body):
    _, client, store = gateway
    r = client.post("/v1/feedback", content=json.dumps(body).encode(),  # Infinity too, which JSON lacks
                    headers={"Content-Type": "application/json"})
    check_answer(r.status_code, r.content, store, body)
    STATUSES.append(r.status_code)


STATUSES: list[int] = []


def test_the_fuzzing_reached_both_answers():
    assert 200 in STATUSES and any(400 <= s < 500 for s in STATUSES), sorted(set(STATUSES))
