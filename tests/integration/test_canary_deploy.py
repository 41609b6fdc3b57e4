"""A canary deploy end to end, on a real gateway (uvicorn on 127.0.0.1, the checkpoint loaded from disk, the
SQLite store) with the official `openai` client: the champion and the candidate each follow a weight
store of their own (FilesystemTransport, lossless deltas from WeightPublisher).

1. The candidate store publishes the base weights, then a trained version as a delta: the candidate arm
   appears, then hot-swaps to the new version.
2. PUT /v1/admin/traffic {"candidate_fraction": 0.5}: every user keeps one arm, the split is the hash's,
   candidate answers carry the candidate's version, and the store records each completion's arm.
3. Promote: the candidate's weights are published into the champion store (a delta) and the fraction
   set to 0: every request is answered by the champion at the new version, with the candidate's answers.
4. A corrupt delta published to the candidate store is rejected; the candidate keeps serving its version.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from realtime_rl.collect import SqliteEventStore
from realtime_rl.config import ApiKey, ServeConfig
from realtime_rl.deploy import FilesystemTransport, WeightPublisher, WeightState, encode_delta
from realtime_rl.deploy.canary import assign_arm
from realtime_rl.model import Qwen3ForCausalLM, save_checkpoint
from tests.conftest import tiny_config
from tests.integration.test_openai_client import serving

MODEL = "rtrl-policy"
SALT = "canary-1"
KEYS = [ApiKey(name="client", key="k-inference-0123456789", scopes=["inference"]),
        ApiKey(name="deployer", key="k-admin-deploy-0123456", scopes=["admin"])]
ADMIN = {"Authorization": f"Bearer {KEYS[1].key}"}
USERS = [f"dev-{i}" for i in range(40)]
PROMPT = [{"role": "user", "content": "Write a function that reverses a string."}]


def traffic(url: str) -> dict:
    return httpx.get(f"{url}/v1/admin/traffic", headers=ADMIN, timeout=10).json()


def set_fraction(url: str, fraction: float) -> None:
    r = httpx.put(f"{url}/v1/admin/traffic", json={"candidate_fraction": fraction}, headers=ADMIN, timeout=10)
    assert r.status_code == 200, r.text


def wait_for(url: str, arm: str, version: int) -> None:
    deadline = time.monotonic() + 30
    while (got := traffic(url)["arms"][arm]["version"]) != version:
        assert time.monotonic() < deadline, f"the {arm} serves version {got}, expected {version}"
        time.sleep(0.05)


def ask(client: openai.OpenAI, user: str, temperature: float = 1.0) -> tuple[str, str, str, str]:
    """(arm, system_fingerprint, completion id, text) of one chat completion for `user`."""
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=PROMPT, max_tokens=6, user=user,
                                                           temperature=temperature)
    resp = raw.parse()
    return raw.headers["x-rtrl-arm"], resp.system_fingerprint, resp.id, resp.choices[0].message.content


@pytest.mark.slow
def test_a_candidate_is_canaried_promoted_and_survives_a_corrupt_delta(tmp_path, tokenizer, caplog):
    base = Qwen3ForCausalLM(tiny_config(moe=True, vocab_size=tokenizer.vocab_size))
    base.reset_parameters(seed=0)
    checkpoint = save_checkpoint(tmp_path / "checkpoint", base, tokenizer)
    weights = {k: v.detach().clone() for k, v in base.named_parameters()}
    champion_store, candidate_store = FilesystemTransport(tmp_path / "champion"), FilesystemTransport(tmp_path / "cand")
    champion_pub = WeightPublisher(champion_store, dtype=None, snapshot_every=100)
    candidate_pub = WeightPublisher(candidate_store, dtype=None, snapshot_every=100)
    champion_pub.publish(weights, 1)
    candidate_pub.publish(weights, 1)
    trained = {k: v.clone() for k, v in weights.items()}  # "training": the output head moves
    trained["lm_head.weight"] += 0.5 * torch.randn(trained["lm_head.weight"].shape,
                                                   generator=torch.Generator().manual_seed(1))

    settings = ServeConfig(checkpoint=checkpoint, run_dir=tmp_path / "run", api_keys=KEYS, max_seq_len=256,
                           weights=str(tmp_path / "champion"), candidate_weights=str(tmp_path / "cand"),
                           weights_poll_s=0.05, traffic_salt=SALT)
    with serving(settings) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS[0].key, max_retries=0, timeout=60)
        wait_for(url, "champion", 1)
        wait_for(url, "candidate", 1)  # the candidate arm exists, at the base weights
        stats = candidate_pub.publish(trained, 2)
        assert stats.bytes_delta is not None and stats.bytes_snapshot is None  # the delta path
        wait_for(url, "candidate", 2)

        # -- canary: half of the users on the candidate
        set_fraction(url, 0.5)
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda u: (u, *ask(client, u)), USERS + USERS))
        arm_of: dict[str, set[str]] = {}
        for user, arm, fingerprint, _, _ in answers:
            arm_of.setdefault(user, set()).add(arm)
            assert fingerprint == ("rtrl-v2" if arm == "candidate" else "rtrl-v1")
        assert all(len(arms) == 1 for arms in arm_of.values()), "a user switched arms"
        assert {u: arms.pop() for u, arms in arm_of.items()} == {u: assign_arm(u, SALT, 0.5) for u in USERS}
        share = sum(assign_arm(u, SALT, 0.5) == "candidate" for u in USERS) / len(USERS)
        assert 0.3 <= share <= 0.7
        with SqliteEventStore(settings.run_dir / "events.sqlite") as store:
            for user, arm, _, completion_id, _ in answers:
                rec = store.get_completion(completion_id)
                assert rec.user == user and rec.arm == arm
                assert rec.model_version == (2 if arm == "candidate" else 1)

        champion_user = next(u for u in USERS if assign_arm(u, SALT, 0.5) == "champion")
        candidate_user = next(u for u in USERS if assign_arm(u, SALT, 0.5) == "candidate")
        champion_text = ask(client, champion_user, temperature=0)[3]
        candidate_text = ask(client, candidate_user, temperature=0)[3]
        assert candidate_text != champion_text  # the arms really serve different weights

        # -- promote: the candidate's weights reach the champion as a delta; all traffic on the champion
        stats = champion_pub.publish(trained, 2)
        assert stats.bytes_delta is not None and stats.bytes_snapshot is None
        set_fraction(url, 0.0)
        wait_for(url, "champion", 2)
        for user in USERS[:10]:
            arm, fingerprint, _, _ = ask(client, user)
            assert (arm, fingerprint) == ("champion", "rtrl-v2")
        assert ask(client, champion_user, temperature=0)[3] == candidate_text

        # -- a corrupt delta to the candidate store is rejected; the candidate keeps its version
        set_fraction(url, 0.5)
        bad = {k: v.clone() for k, v in trained.items()}
        bad["lm_head.weight"][0, :4] += 1.0
        blob = bytearray(encode_delta(candidate_pub.last, WeightState.of(bad, 3)))
        blob[len(blob) // 2] ^= 0xFF  # bit rot in transit
        with caplog.at_level(logging.WARNING, logger="realtime_rl.deploy.sync"):
            candidate_store.publish(3, {"delta": bytes(blob)})
            deadline = time.monotonic() + 30
            while not any("delta 3" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "the gateway never tried the corrupt delta"
                time.sleep(0.05)
        assert traffic(url)["arms"] == {"champion": {"version": 2}, "candidate": {"version": 2}}
        arm, fingerprint, _, text = ask(client, candidate_user, temperature=0)
        assert (arm, fingerprint, text) == ("candidate", "rtrl-v2", candidate_text)
