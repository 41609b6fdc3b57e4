"""Champion and candidate arms: the stable user hash (deploy.canary), the gateway's routing by it (header,
served version, recorded arm, per-arm metrics), the admin traffic API (scopes, bad input, persistence
across a restart), and a candidate arm that appears when its weight store gets a version and follows it."""

from __future__ import annotations

import hashlib
import logging
import json
import time
from contextlib import contextmanager

import pytest
import torch
from fastapi.testclient import TestClient

from realtime_rl.collect import SqliteEventStore
from realtime_rl.config import ApiKey, ServeConfig
from realtime_rl.deploy import FilesystemTransport, WeightPublisher
from realtime_rl.deploy.canary import assign_arm
from realtime_rl.engine import AsyncEngine, Engine, EngineStopped, SamplingParams
from realtime_rl.model import Qwen3ForCausalLM
from realtime_rl.serve import create_app
from tests.conftest import tiny_config
from tests.unit.test_serve_api import chat

KEYS = [ApiKey(name="client", key="k-inference-0123456789", scopes=["inference", "feedback"]),
        ApiKey(name="ops", key="k-admin-only-012345678", scopes=["admin"])]
AUTH = {"Authorization": f"Bearer {KEYS[0].key}"}
ADMIN = {"Authorization": f"Bearer {KEYS[1].key}"}
SALT = "exp-1"
USERS = [f"user-{i}" for i in range(24)]


# ---------------------------------------------------------------------------------------------- the hash


def reference_point(user: str, salt: str) -> float:
    """The spec, written independently: sha256(salt + user), first 8 bytes big-endian, over 2**64."""
    return int.from_bytes(hashlib.sha256((salt + user).encode()).digest()[:8], "big") / 2**64


def test_assign_arm_follows_the_spec_and_is_stable():
    users = [f"u{i}" for i in range(2000)]
    for fraction in (0.0, 0.01, 0.3, 0.5, 0.99, 1.0):
        arms = [assign_arm(u, SALT, fraction) for u in users]
        assert arms == [assign_arm(u, SALT, fraction) for u in users]  # stable
        assert arms == ["candidate" if reference_point(u, SALT) < fraction else "champion" for u in users]
    assert {assign_arm(u, SALT, 0.0) for u in users} == {"champion"}
    assert {assign_arm(u, SALT, 1.0) for u in users} == {"candidate"}
    for bad in (-0.01, 1.01, float("nan")):
        with pytest.raises(ValueError, match=r"candidate_fraction must be in \[0, 1\]"):
            assign_arm("u", SALT, bad)


def test_raising_the_fraction_only_moves_champion_users():
    users = [f"u{i}" for i in range(5000)]
    previous: set[str] = set()
    for fraction in (0.01, 0.05, 0.2, 0.5, 0.9):
        candidates = {u for u in users if assign_arm(u, SALT, fraction) == "candidate"}
        assert previous <= candidates and len(candidates) > len(previous)
        previous = candidates


def test_the_split_is_accurate_and_a_new_salt_reshuffles_it():
    users = [f"user-{i}" for i in range(20_000)]
    for fraction in (0.05, 0.3, 0.5):
        share = sum(assign_arm(u, SALT, fraction) == "candidate" for u in users) / len(users)
        assert abs(share - fraction) < 0.01, (fraction, share)
    a = {u for u in users if assign_arm(u, "exp-1", 0.5) == "candidate"}
    b = {u for u in users if assign_arm(u, "exp-2", 0.5) == "candidate"}
    assert abs(len(a & b) / len(a) - 0.5) < 0.02  # an independent draw, not the same users


# ---------------------------------------------------------------------------------------------- the gateway


def model(tokenizer, seed: int) -> Qwen3ForCausalLM:
    m = Qwen3ForCausalLM(tiny_config(moe=True, vocab_size=tokenizer.vocab_size))
    m.reset_parameters(seed=seed)
    return m.eval()


@contextmanager
def gateway(tmp_path, tokenizer, candidate: bool = True, candidate_pending: int = 64, **settings):
    """A gateway with a champion (version 0) and, if asked, a candidate engine (version 5) passed in."""
    settings = {"api_keys": KEYS, "run_dir": tmp_path, "traffic_salt": SALT, **settings}
    champion = AsyncEngine(Engine(model(tokenizer, 0), tokenizer, max_batch=4, max_seq_len=256))
    challenger = None
    if candidate:
        challenger = AsyncEngine(Engine(model(tokenizer, 1), tokenizer, max_batch=4, max_seq_len=256, version=5),
                                 max_pending=candidate_pending)
    store = SqliteEventStore(tmp_path / "events.sqlite")
    try:
        with TestClient(create_app(ServeConfig(**settings), champion, store, candidate_engine=challenger)) as client:
            client.headers.update(AUTH)
            yield client, store
    finally:
        for engine in (champion, challenger):
            if engine is not None:
                engine.stop()
        store.close()


def ask(client, **extra):
    return client.post("/v1/chat/completions", json=chat(max_tokens=2, **extra))


def test_users_are_routed_by_the_stable_hash_and_the_answer_names_the_arm(tmp_path, tokenizer):
    with gateway(tmp_path, tokenizer, candidate_fraction=0.5) as (client, store):
        seen = {}
        for user in USERS + USERS[:6]:  # the first six ask twice
            r = ask(client, user=user)
            assert r.status_code == 200, r.text
            arm = r.headers["x-rtrl-arm"]
            assert arm == assign_arm(user, SALT, 0.5) and seen.setdefault(user, arm) == arm
            assert r.json()["system_fingerprint"] == ("rtrl-v5" if arm == "candidate" else "rtrl-v0")
            rec = store.get_completion(r.json()["id"])
            assert rec.arm == arm and rec.model_version == (5 if arm == "candidate" else 0)
        assert set(seen.values()) == {"champion", "candidate"}

        session = "sess-7"  # no user: the session decides; neither: the champion
        r = client.post("/v1/chat/completions", json=chat(max_tokens=2), headers={"X-Session-Id": session})
        assert r.headers["x-rtrl-arm"] == assign_arm(session, SALT, 0.5)
        assert ask(client).headers["x-rtrl-arm"] == "champion"

        user = next(u for u in USERS if assign_arm(u, SALT, 0.5) == "candidate")  # streamed answers too
        r = ask(client, user=user, stream=True)
        assert r.status_code == 200 and r.headers["x-rtrl-arm"] == "candidate"
        chunks = [json.loads(line.removeprefix("data: ")) for line in r.text.split("\n\n")
                  if line.startswith("data: {")]
        assert chunks and {c["system_fingerprint"] for c in chunks} == {"rtrl-v5"}
        assert store.get_completion(chunks[0]["id"]).arm == "candidate"

        text = client.get("/metrics").text
        n_candidate = sum(rec.arm == "candidate" for rec in store.list_completions())
        assert f'rtrl_serve_arm_requests_total{{arm="candidate",status="200"}} {float(n_candidate)}' in text
        assert f'rtrl_serve_arm_request_duration_seconds_count{{arm="candidate"}} {float(n_candidate)}' in text
        assert 'rtrl_serve_arm_version{arm="candidate"} 5.0' in text
        assert 'rtrl_serve_arm_version{arm="champion"} 0.0' in text


def test_without_a_candidate_everything_goes_to_the_champion(tmp_path, tokenizer):
    with gateway(tmp_path, tokenizer, candidate=False, candidate_fraction=1.0) as (client, store):
        for user in USERS[:5]:
            r = ask(client, user=user)
            assert r.headers["x-rtrl-arm"] == "champion" and r.json()["system_fingerprint"] == "rtrl-v0"
        assert {rec.arm for rec in store.list_completions()} == {"champion"}
        body = client.get("/v1/admin/traffic", headers=ADMIN).json()
        assert body == {"candidate_fraction": 1.0, "salt": SALT,
                        "arms": {"champion": {"version": 0}, "candidate": {"version": None}}}
        assert 'rtrl_serve_arm_version{arm="candidate"} NaN' in client.get("/metrics").text
        assert client.get("/health").json()["arms"]["candidate"] == {"status": None, "version": None}


def test_an_overloaded_candidate_is_a_503_counted_against_its_arm(tmp_path, tokenizer):
    with gateway(tmp_path, tokenizer, candidate_pending=0, candidate_fraction=1.0) as (client, store):
        r = ask(client, user="ada")
        assert r.status_code == 503 and r.headers["x-rtrl-arm"] == "candidate"
        assert ask(client, user="ada", stream=True).headers["x-rtrl-arm"] == "candidate"
        assert store.count_completions() == 0
        assert 'rtrl_serve_arm_requests_total{arm="candidate",status="503"} 2.0' in client.get("/metrics").text


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_candidate_sends_its_users_to_the_champion_and_health_says_so(tmp_path, tokenizer, caplog):
    with gateway(tmp_path, tokenizer, candidate_fraction=1.0) as (client, store):
        r = client.get("/health")
        assert r.json()["arms"] == {"champion": {"status": "ok", "version": 0},
                                    "candidate": {"status": "ok", "version": 5}}
        candidate = client.app.state.serve.arms.candidate

        def dying_step():
            raise RuntimeError("device lost")

        candidate.engine.step = dying_step
        with pytest.raises(RuntimeError, match="engine thread died"):
            candidate.generate_sync([1, 2, 3], SamplingParams(max_tokens=2), timeout_s=30)
        with caplog.at_level(logging.ERROR, logger="realtime_rl.serve.arms"):
            for user in USERS[:3]:
                r = ask(client, user=user)
                assert r.status_code == 200 and r.headers["x-rtrl-arm"] == "champion", r.text
        assert sum("candidate engine died" in rec.getMessage() for rec in caplog.records) == 1  # once
        assert {rec.arm for rec in store.list_completions()} == {"champion"}
        r = client.get("/health")  # the gateway still serves everyone
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert r.json()["arms"]["candidate"] == {"status": "unavailable", "version": 5}


# ---------------------------------------------------------------------------------------------- admin API


def test_the_admin_api_changes_the_split_and_a_restart_keeps_it(tmp_path, tokenizer):
    with gateway(tmp_path, tokenizer) as (client, _):
        assert client.get("/v1/admin/traffic", headers={"Authorization": ""}).status_code == 401
        r = client.get("/v1/admin/traffic")  # an inference key lacks the admin scope
        assert r.status_code == 403 and "admin" in r.json()["error"]["message"]
        assert client.put("/v1/admin/traffic", json={"candidate_fraction": 1.0}).status_code == 403
        assert client.get("/v1/admin/traffic", headers=ADMIN).json() == {
            "candidate_fraction": 0.0, "salt": SALT, "arms": {"champion": {"version": 0}, "candidate": {"version": 5}}}
        assert {ask(client, user=u).headers["x-rtrl-arm"] for u in USERS[:6]} == {"champion"}

        r = client.put("/v1/admin/traffic", json={"candidate_fraction": 1.0}, headers=ADMIN)
        assert r.status_code == 200 and r.json()["candidate_fraction"] == 1.0 and r.json()["salt"] == SALT
        assert {ask(client, user=u).headers["x-rtrl-arm"] for u in USERS[:6]} == {"candidate"}

        r = client.put("/v1/admin/traffic", json={"candidate_fraction": 0.5, "salt": "exp-2"}, headers=ADMIN)
        assert r.json()["salt"] == "exp-2"
        for user in USERS[:8]:
            assert ask(client, user=user).headers["x-rtrl-arm"] == assign_arm(user, "exp-2", 0.5)
        assert json.loads((tmp_path / "traffic.json").read_text()) == {"candidate_fraction": 0.5, "salt": "exp-2"}

        for bad, param in [({"candidate_fraction": 1.5}, "candidate_fraction"),
                           ({"candidate_fraction": -0.1}, "candidate_fraction"),
                           ({"candidate_fraction": "half"}, "candidate_fraction"),
                           ({"candidate_fraction": True}, "candidate_fraction"),  # was 1.0: every user on it
                           ({"candidate_fraction": "0.5"}, "candidate_fraction"),
                           ({}, "candidate_fraction"), ({"candidate_fraction": 0.1, "salt": ""}, "salt"),
                           ({"candidate_fraction": 0.1, "fraction": 0.2}, "fraction")]:
            r = client.put("/v1/admin/traffic", json=bad, headers=ADMIN)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
        assert client.get("/v1/admin/traffic", headers=ADMIN).json()["candidate_fraction"] == 0.5  # unchanged

    # a restarted gateway keeps what the operator set, over its configured defaults
    with gateway(tmp_path, tokenizer, candidate_fraction=0.0, traffic_salt="other") as (client, _):
        body = client.get("/v1/admin/traffic", headers=ADMIN).json()
        assert (body["candidate_fraction"], body["salt"]) == (0.5, "exp-2")
        user = next(u for u in USERS if assign_arm(u, "exp-2", 0.5) == "candidate")
        assert ask(client, user=user).headers["x-rtrl-arm"] == "candidate"

    (tmp_path / "traffic.json").write_text('{"candidate_fraction": 2}')
    with pytest.raises(ValueError, match="traffic.json: not a traffic split .*fix it or delete it"):
        create_app(ServeConfig(api_keys=KEYS, run_dir=tmp_path))


def test_the_config_bounds_the_split():
    with pytest.raises(ValueError, match="candidate_fraction"):
        ServeConfig(candidate_fraction=1.5)
    with pytest.raises(ValueError, match="another weight store"):
        ServeConfig(weights="w", candidate_weights="w")


# ---------------------------------------------------------------------------------------------- weight store


def wait_for(client, arm: str, version: int | None) -> None:
    deadline = time.monotonic() + 30
    while (got := client.get("/v1/admin/traffic", headers=ADMIN).json()["arms"][arm]["version"]) != version:
        assert time.monotonic() < deadline, f"{arm} serves version {got}, expected {version}"
        time.sleep(0.02)


def test_the_candidate_arm_appears_with_its_first_version_and_follows_its_store(tmp_path, tokenizer):
    weights = FilesystemTransport(tmp_path / "candidate")
    publisher = WeightPublisher(weights, dtype=None, snapshot_every=100)
    state = {k: v.detach().clone() for k, v in model(tokenizer, 1).named_parameters()}
    user = next(u for u in USERS if assign_arm(u, SALT, 0.5) == "candidate")
    with gateway(tmp_path, tokenizer, candidate=False, candidate_fraction=0.5, weights_poll_s=0.05,
                 candidate_weights=str(tmp_path / "candidate")) as (client, store):
        time.sleep(0.2)  # a few polls of an empty store: no candidate yet
        wait_for(client, "candidate", None)
        assert ask(client, user=user).headers["x-rtrl-arm"] == "champion"

        publisher.publish(state, 3)
        wait_for(client, "candidate", 3)
        r = ask(client, user=user)
        assert r.headers["x-rtrl-arm"] == "candidate" and r.json()["system_fingerprint"] == "rtrl-v3"
        candidate = client.app.state.serve.arms.candidate
        assert candidate is not client.app.state.serve.engine
        for name, p in candidate.engine.model.named_parameters():
            assert torch.equal(p, state[name]), name
        champion = client.app.state.serve.engine.engine.model
        assert not torch.equal(champion.lm_head.weight, state["lm_head.weight"])  # the champion is untouched

        state["lm_head.weight"][0, :5] += 1.0
        publisher.publish(state, 4)  # a delta, hot-swapped into the same engine
        wait_for(client, "candidate", 4)
        assert client.app.state.serve.arms.candidate is candidate
        assert torch.equal(candidate.engine.model.lm_head.weight, state["lm_head.weight"])
        assert ask(client, user=user).json()["system_fingerprint"] == "rtrl-v4"
    with pytest.raises(EngineStopped):  # the gateway stopped the engine it built
        candidate.generate_sync([1, 2, 3], SamplingParams(max_tokens=1), timeout_s=5)


def test_weights_that_do_not_fit_the_model_are_refused_and_the_gateway_keeps_serving(tmp_path, tokenizer, caplog):
    other = Qwen3ForCausalLM(tiny_config(moe=True, vocab_size=tokenizer.vocab_size, hidden_size=32))
    WeightPublisher(FilesystemTransport(tmp_path / "candidate"), dtype=None).publish(dict(other.named_parameters()), 1)
    with caplog.at_level(logging.WARNING, logger="realtime_rl.deploy.sync"), gateway(
            tmp_path, tokenizer, candidate=False, candidate_fraction=1.0, weights_poll_s=0.05,
            candidate_weights=str(tmp_path / "candidate")) as (client, _):
        deadline = time.monotonic() + 30
        while sum("does not fit the served model" in r.getMessage() for r in caplog.records) < 2:  # retried
            assert time.monotonic() < deadline, "the misfit version was never tried"
            time.sleep(0.02)
        wait_for(client, "candidate", None)
        r = ask(client, user="ada")
        assert r.status_code == 200 and r.headers["x-rtrl-arm"] == "champion"
