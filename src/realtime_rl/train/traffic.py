"""Served traffic as training data: a recorded chat completion becomes an RL episode, exactly.

    episodes = traffic_episodes([(record, 0, reward), ...], group_id="cycle-3")
    trainer.step(episodes)

The gateway records, for every choice it answered, the prompt token ids, the generated token ids with
the logprob each was sampled with, the policy version that produced each token and (MoE) the routing
of every input position. That is everything the RL trainer needs: the episode's one segment is the
prompt (context, never trained on) followed by the generated tokens (trained on, with the behaviour
logprobs for the importance ratio and the recorded routing replayed). Nothing is re-rendered or
re-tokenized, so the trainer sees the very tokens the user saw.

What counts as on-policy (which versions may train the next one) is the caller's decision, made from
`record.model_version` and the choice's per-token versions; this module only converts.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import numpy as np

from realtime_rl.collect import CompletionRecord
from realtime_rl.rewards import request_metadata
from realtime_rl.types import Episode, Segment


def sampled_at(record: CompletionRecord) -> float:
    """The temperature the request's choices were sampled at (the gateway's default, 1, when it gave none);
    0 is greedy decoding, whose tokens are no sample of a distribution and do not train."""
    temperature = json.loads(record.request_json).get("temperature")
    return 1.0 if temperature is None else float(temperature)


def nucleus(record: CompletionRecord) -> float:
    """The top_p the request's choices were sampled with (1, the whole distribution, when it gave none); below 1
    the tail was never sampled, so no importance ratio corrects for it and such choices do not train."""
    top_p = json.loads(record.request_json).get("top_p")
    return 1.0 if top_p is None else float(top_p)


def trainable(record: CompletionRecord) -> bool:
    """Whether the request's choices are samples of the policy the trainer recomputes: T > 0 and no nucleus."""
    return sampled_at(record) > 0 and nucleus(record) == 1


def traffic_segment(record: CompletionRecord, choice_index: int = 0) -> Segment:
    """The prompt and one choice's tokens as a trainable segment (loss on the generated tokens only)."""
    if not 0 <= choice_index < len(record.choices):
        raise ValueError(f"completion {record.completion_id} has no choice {choice_index}")
    choice = record.choices[choice_index]
    P, G = len(record.prompt_token_ids), len(choice.token_ids)
    routing = None
    if choice.routing is not None:
        # Recorded for every input position (P + G - 1 rows); the last token was never an input.
        pad = np.zeros((1, *choice.routing.shape[1:]), dtype=choice.routing.dtype)
        routing = np.concatenate([choice.routing, pad])
    return Segment(
        token_ids=np.asarray(record.prompt_token_ids + choice.token_ids, dtype=np.int64),
        loss_mask=np.concatenate([np.zeros(P, dtype=bool), np.ones(G, dtype=bool)]),
        logprobs=np.concatenate([np.zeros(P, dtype=np.float32), np.asarray(choice.logprobs, dtype=np.float32)]),
        versions=np.concatenate([np.full(P, -1, dtype=np.int64), np.asarray(choice.versions, dtype=np.int64)]),
        routing=routing,
        temperature=sampled_at(record),
        top_p=nucleus(record),
    )


def traffic_episode(record: CompletionRecord, choice_index: int, reward: float, group_id: str = "") -> Episode:
    segment = traffic_segment(record, choice_index)  # checks the index first: a negative one would pick another
    choice = record.choices[choice_index]
    asked = any(call.function.name == "ask_user" for call in choice.tool_calls)
    metadata = request_metadata(record)
    return Episode(
        episode_id=f"{record.completion_id}/{choice_index}",
        task_id=str(metadata.get("task_id", "")),
        segments=[segment],
        ended_by="ask_user" if asked else "answer",
        num_turns=1,
        num_tool_calls=len(choice.tool_calls),
        malformed_tool_calls=len(choice.tool_call_errors),
        tool_errors=0,
        group_id=group_id,
        reward=float(reward),
        metadata={"completion_id": record.completion_id, "model_version": record.model_version,
                  "user": record.user, "session_id": record.session_id, "arm": record.arm,
                  "difficulty": metadata.get("difficulty")},
    )


def traffic_episodes(rewarded: Iterable[tuple[CompletionRecord, int, float]], group_id: str = "") -> list[Episode]:
    """(record, choice index, reward) triples as episodes sharing `group_id`: the trainer's baseline is
    then the mean reward of the whole batch, since live requests rarely repeat a prompt."""
    return [traffic_episode(record, index, reward, group_id) for record, index, reward in rewarded]
