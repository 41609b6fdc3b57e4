"""A tiny policy whose one decision is whether to try: a Qwen3-MoE that, after any generation prompt, samples
one of a few answers (a risky edit, a clarifying question, a broken tool call) and then writes it out exactly.

    policy = hack_policy(tokenizer, {"edit": 0.8, "question": 0.2})
    policy.texts["question"]              # the answer the question branch decodes to
    policy.mix(candidate_model)           # {"edit": ..., "question": ...}: the choice under other weights

It is tests/unit/test_serve_api.two_gram_model with a fork and a longer memory: the first generated token
picks the answer (each answer opens with a token of its own, drawn with the chosen probability), and every
later token is a lookup of the last three tokens, so the rest of the answer follows with probability ~1.
Three tokens, not two: the answers share long stretches of tool-call JSON, and a lookup on two tokens would
have to continue `"name": "` two ways. The weights are written, not trained: two attention heads built
from RoPE that copy the previous token and the one before, one MoE unit per state that fires only when all
three tokens match, a readout in lm_head. Nothing else is special, so RL through the real engine and
trainer moves the mix: the rest of an answer has probability ~1, hence ~no gradient, and what a reward
teaches lands on the first token, which the fork's own MoE unit writes.

The answers, for the tasks of tests/integration/test_reward_hacks.py:
  edit       write_file one.py with `X = 1`: it passes task `one` and fails every other task (risky);
  question   ask_user, a clarifying question instead of the edit;
  malformed  the same write_file call with a closing brace missing (the parser reports bad_json).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from realtime_rl.config import ModelConfig
from realtime_rl.model import Qwen3ForCausalLM, Tokenizer, render_messages
from realtime_rl.model.chat import TOOL_CALL_CLOSE, render_tool_call

KINDS = ("edit", "question", "malformed")
_CALLS = {
    "edit": ("Writing the fix.\n", "write_file", {"path": "one.py", "content": "X = 1"}, False),
    "question": ("Quick question first.\n", "ask_user", {"question": "Which value do you want?"}, False),
    "malformed": ("Sure.\n", "write_file", {"path": "one.py", "content": "X = 1"}, True),
}
State = tuple[int, int, int]
FORK_GAIN = 8.0
"""How much louder the fork's MoE unit is than a lookup's (see hack_policy)."""


def _answer(kind: str) -> str:
    """The answer of `kind` as render_tool_call writes it, after a line of content that opens it."""
    lead, name, arguments, broken = _CALLS[kind]
    text = lead + render_tool_call(name, arguments)
    return text.replace("}}\n" + TOOL_CALL_CLOSE, "}\n" + TOOL_CALL_CLOSE) if broken else text  # drop a brace


def _pieces(tokenizer: Tokenizer) -> dict[str, int]:
    """Every token's text (the first id of each), for tokenizing an answer any way that decodes to it."""
    pieces: dict[str, int] = {}
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.decode([i])
        if piece and "\ufffd" not in piece:
            pieces.setdefault(piece, i)
    return pieces


def _chain(pieces: dict[str, int], text: str, start: State, known: dict[State, int], end: int,
           budget: int = 5_000) -> list[int] | None:
    """Tokens that decode to `text` (then `end`) such that, from `start` (the prompt's last three tokens),
    the last three tokens determine the next: no three-token state repeats within the chain (it would
    loop), and a state another answer uses (`known`) is followed by the same token here. The first token
    is free: the fork picks it. None if there is none, or none was found within `budget` search steps.

    A depth-first search over tokenizations, longest pieces first; it prunes what cannot finish
    consistently with `known` (`finishes`, repeats ignored) and remembers the (position, state, used
    states that could still recur) it failed from: nothing else decides the rest of the search."""
    n = len(text)
    at = [sorted(((len(p), t) for p, t in pieces.items() if text.startswith(p, pos)), reverse=True)
          for pos in range(n)]
    pairs: list[set[tuple[int, int]]] = [{start[1:]}, *(set() for _ in range(n))]  # possible last two tokens
    for pos in range(n):
        for length, t in at[pos]:
            pairs[pos + length] |= {(b, t) for _, b in pairs[pos]}
    future: list[frozenset[State]] = [frozenset()] * (n + 1)  # states that can still form from a boundary on
    for pos in range(n - 1, -1, -1):
        future[pos] = future[pos + 1] | {(a, b, t) for a, b in pairs[pos] for _, t in at[pos]}

    @functools.cache
    def finishes(pos: int, state: State) -> bool:
        if pos == n:
            return known.get(state, end) == end
        return any(known.get(state, t) in (None, t) and finishes(pos + length, (*state[1:], t))
                   for length, t in at[pos])

    failed: set[tuple[int, State, frozenset[State]]] = set()
    steps = [budget]

    def search(pos: int, state: State, used: frozenset[State]) -> list[int] | None:
        if pos == n:
            return []  # finishes() checked the end
        key = (pos, state, used & future[pos])
        steps[0] -= 1
        if key in failed or steps[0] < 0:
            return None
        for length, t in at[pos]:
            new = (*state[1:], t)
            if (pos == 0 or known.get(state, t) in (None, t)) and new not in used and finishes(pos + length, new):
                tail = search(pos + length, new, used | {new})
                if tail is not None:
                    return [t, *tail]
        failed.add(key)
        return None

    return search(0, start, frozenset({start}))


def _prompt(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode(render_messages([{"role": "user", "content": "x"}], add_generation_prompt=True))


@dataclass
class HackPolicy:
    model: Qwen3ForCausalLM
    """The policy's weights (save_checkpoint it with the tokenizer to serve or train it)."""
    texts: dict[str, str]
    """Each kind's answer, exactly as the model writes it."""
    tokens: dict[str, list[int]]
    """Each kind's answer as the model writes it, token by token; drawing the first is the policy's choice."""
    prompt: list[int]
    """A generation prompt (any would do: the policy does not read it)."""

    @torch.no_grad()
    def mix(self, model: Qwen3ForCausalLM | None = None) -> dict[str, float]:
        """The probability of each answer after a generation prompt (temperature 1) under `model`'s weights
        (default: the policy's own), e.g. a candidate's checkpoint."""
        model = model or self.model
        probs = torch.softmax(model(torch.tensor([self.prompt])).logits_BTV[0, -1].float(), dim=-1)
        return {kind: float(probs[tokens[0]]) for kind, tokens in self.tokens.items()}


@torch.no_grad()
def hack_policy(tokenizer: Tokenizer, mix: Mapping[str, float], seed: int = 0) -> HackPolicy:
    """A one-layer Qwen3-MoE that answers any generation prompt with the answer of kind k with probability
    mix[k] (temperature 1), then ends the turn."""
    if not mix or set(mix) - set(KINDS) or abs(sum(mix.values()) - 1) > 1e-6 or min(mix.values()) <= 0:
        raise ValueError(f"mix must give positive probabilities summing to 1 to kinds among {KINDS}, got {dict(mix)}")
    prompt = _prompt(tokenizer)
    start: State = (prompt[-3], prompt[-2], prompt[-1])
    pieces, end = _pieces(tokenizer), tokenizer.im_end_id
    known: dict[State, int] = {}
    texts, chains = {}, {}
    for kind in mix:
        text = _answer(kind)
        chain = _chain(pieces, text, start, known, end)
        if chain is None or chain[0] in {c[0] for c in chains.values()}:
            raise ValueError(f"this tokenizer has no three-gram chain for the {kind} answer that opens with a token "
                             f"of its own and agrees with the chains of {list(texts)}")
        seq = [*start, *chain, end]
        for i in range(3, len(seq) - 1):
            known[(seq[i - 2], seq[i - 1], seq[i])] = seq[i + 1]
        texts[kind], chains[kind] = text, chain
    firsts = {kind: chain[0] for kind, chain in chains.items()}

    states = sorted(known.items())
    words = sorted({*start, *(t for c in chains.values() for t in c)})
    targets = sorted({*known.values(), *firsts.values()})
    word = {w: k for k, w in enumerate(words)}
    nw = len(words) + 1  # a one-hot per chain token, and one for "any other token"
    # residual layout: [bias | current token | previous token | the one before | next token]
    C, P, P2, O = 1, 1 + nw, 1 + 2 * nw, 1 + 3 * nw
    H = -(-(O + len(targets)) // 16) * 16
    head_dim = 64 if nw <= 64 else 128  # the attention values carry a one-hot per chain token
    if nw > head_dim:
        raise ValueError(f"the answers use {nw - 1} distinct tokens; the attention values carry {head_dim - 1}")
    units = -(-(len(states) + 1) // 4) * 4  # torch's grouped_mm on CPU wants rows of a multiple of 16 bytes
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=H, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=units, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg)
    model.reset_parameters(seed=seed)
    emb = torch.zeros(cfg.vocab_size, H)
    emb[:, 0], emb[:, C + nw - 1] = 1.0, 1.0
    for w, k in word.items():
        emb[w, C + nw - 1], emb[w, C + k] = 0.0, 1.0
    model.model.embed_tokens.weight.copy_(emb)

    # Attention from constant queries and keys, so the score depends on distance only: head 0 peaks at
    # distance 1, head 1 at distance 2. With RoPE, score_h(d) = sum over the 8 fastest frequencies of
    # amp^2 cos(w (d - h - 1)). Both heads share q_norm's weights (head 0's pattern), so head 1's query
    # projection scales each dimension to turn angle w into 2w, keeping the query's RMS at 1.
    attn = model.model.layers[0].self_attn
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    amp, half = math.sqrt(40 * math.sqrt(head_dim) / 0.8), head_dim // 2
    q, k = torch.zeros(head_dim), torch.zeros(head_dim)
    turn = torch.zeros(head_dim)
    for f in range(8):
        w = float(inv_freq[f])
        k[f], q[f], q[f + half] = amp, amp * math.cos(w), -amp * math.sin(w)
        turn[f], turn[f + half] = math.cos(2 * w) / math.cos(w), 2 * math.cos(w)
    unused = torch.ones(head_dim, dtype=torch.bool)
    unused[:8], unused[half:half + 8] = False, False
    turn[unused] = math.sqrt((head_dim - float((turn ** 2).sum())) / int(unused.sum()))
    attn.q_norm.weight.copy_(q)
    attn.k_norm.weight.copy_(k)
    attn.q_proj.weight.zero_()
    attn.q_proj.weight[:head_dim, 0] = 1.0
    attn.q_proj.weight[head_dim:, 0] = turn
    attn.k_proj.weight.zero_()
    attn.k_proj.weight[:, 0] = 1.0
    attn.v_proj.weight.zero_()
    attn.o_proj.weight.zero_()
    for j in range(nw):  # values carry the token one-hot: head 0 into "previous", head 1 into "the one before"
        attn.v_proj.weight[j, C + j] = 1.0 / math.sqrt(H / 2)
        attn.o_proj.weight[P + j, j] = 1.0
        attn.o_proj.weight[P2 + j, head_dim + j] = 1.0

    z, s = math.sqrt(H / 4), 20.0  # after attention four entries are ~1: RMSNorm scales them to z
    gate_up, down = torch.zeros(2 * units, H), torch.zeros(H, units)
    for j, ((before, prev, cur), nxt) in enumerate(states):  # unit j fires only when all three tokens match
        gate_up[j, C + word[cur]] = gate_up[j, P + word[prev]] = gate_up[j, P2 + word[before]] = s / z
        gate_up[j, 0] = -2.5 * s / z
        gate_up[units + j, C + word[cur]] = gate_up[units + j, P + word[prev]] = 1.0 / z
        down[O + targets.index(nxt), j] = 10.0 / (2 * s)
    # The fork: a unit on the generation prompt's last two tokens (where every answer starts) whose output
    # is FORK_GAIN times louder than a lookup's, with entries as much smaller. The mix is the same; what a
    # change of one entry does to the first token's log-odds is FORK_GAIN times larger, so that the choice
    # moves at a learning rate that leaves the lookups (margins of ~20 logits) intact.
    fork = len(states)
    gate_up[fork, C + word[start[2]]] = gate_up[fork, P + word[start[1]]] = s / z
    gate_up[fork, 0] = -1.5 * s / z
    gate_up[units + fork, C + word[start[2]]] = gate_up[units + fork, P + word[start[1]]] = FORK_GAIN / z
    lm_head = torch.zeros(cfg.vocab_size, H)
    for t, y in enumerate(targets):
        lm_head[y, O + t] = 2.0
    model.lm_head.weight.copy_(lm_head)

    # The fork's unit writes each first token's slot; the logits are not linear in those entries (the final
    # RMSNorm sees them all), so they are set by fixed-point rounds on the measured log-odds.
    experts = model.model.layers[0].mlp.experts
    kinds = list(firsts)
    want = torch.tensor([math.log(mix[kind]) for kind in kinds])
    entries = torch.full((len(kinds),), 10.0 / (2 * s) / FORK_GAIN)
    policy = HackPolicy(model.eval(), texts, chains, prompt)
    for _ in range(50):
        for kind, entry in zip(kinds, entries):
            down[O + targets.index(firsts[kind]), fork] = entry
        experts.gate_up_proj.copy_(gate_up.expand_as(experts.gate_up_proj))
        experts.down_proj.copy_(down.expand_as(experts.down_proj))
        logits = model(torch.tensor([prompt])).logits_BTV[0, -1, [firsts[kind] for kind in kinds]]
        error = (want - want.max()) - (logits - logits.max())
        if error.abs().max() < 1e-3:
            break
        entries = entries * (1 + error / logits)  # each logit is ~proportional to its own entry
    else:
        raise AssertionError(f"the fork's probabilities did not converge to {dict(mix)}: {policy.mix()}")
    return policy
