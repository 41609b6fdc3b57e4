"""The Qwen3 causal LM (dense and MoE) in plain PyTorch.

    model = Qwen3ForCausalLM(ModelConfig(num_experts=8))
    out = model(input_ids_BT, positions_BT, capture_routing=True)    # full sequence (trainer)
    out.logits_BTV, out.routing_BTLK                                  # routing: [B, T, moe layers, k]
    cache = KVCache(model.config, num_slots=4, max_seq_len=512)
    out = model(ids_BT, pos_BT, kv_cache=cache, cache_slots=slots_B)  # prefill / decode (engine)
    out = model(ids_BT, pos_BT, replay_routing=out.routing_BTLK)      # forced routing (R3)
    hidden_BTC, routing = model.hidden_states(ids_BT)                 # without the LM head (trainer)

Module and parameter names mirror transformers' `Qwen3ForCausalLM`/`Qwen3MoeForCausalLM`, so the
state dict maps to a Hub checkpoint one to one (expert tensors aside: see moe.py).

Not here: sampling, batching policy and weight swaps (engine/), losses (train/), sliding-window
attention and RoPE scaling (rejected when a config.json asks for them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from realtime_rl.config import ModelConfig
from realtime_rl.model.kv_cache import KVCache, KVStep
from realtime_rl.model.layers import MLP, Attention, RMSNorm, RotaryEmbedding
from realtime_rl.model.moe import SparseMoeBlock
from realtime_rl.model.shared_prefix import SharedPrefix


def routing_dtype(num_experts: int) -> torch.dtype:
    """The compact integer dtype that holds an expert index."""
    return torch.uint8 if num_experts <= 256 else torch.int16


@dataclass
class ModelOutput:
    logits_BTV: torch.Tensor
    """Next-token logits for every input position."""
    routing_BTLK: torch.Tensor | None = None
    """With capture_routing: ordered top-k expert indices per token and MoE layer, compact dtype."""


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.is_moe = config.is_moe_layer(layer_idx)
        self.mlp: nn.Module = (
            SparseMoeBlock(config) if self.is_moe else MLP(config.hidden_size, config.intermediate_size)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x_BTC: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache_step: KVStep | None,
        replay_BTK: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x_BTC = x_BTC + self.self_attn(self.input_layernorm(x_BTC), cos_sin, cache_step)
        h_BTC = self.post_attention_layernorm(x_BTC)
        if self.is_moe:
            y_BTC, experts_BTK = self.mlp(h_BTC, replay_BTK)
            return x_BTC + y_BTC, experts_BTK
        return x_BTC + self.mlp(h_BTC), None


class Qwen3Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.num_moe_layers = len(config.moe_layers)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Normal(0, initializer_range) for matrices and experts, ones for norms, zeros for biases."""
        gen = None
        if seed is not None:
            gen = torch.Generator(device="cpu").manual_seed(seed)
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        positions_BT: torch.Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
        cache_slots: torch.Tensor | slice | None = None,
        capture_routing: bool = False,
        replay_routing: torch.Tensor | None = None,
        cache_length: int | None = None,
    ) -> ModelOutput:
        """Logits for every position; optionally capture or replay MoE routing ([B, T, moe layers, k]).

        cache_slots: the KV-cache slot of each row, a LongTensor [B] or a slice of consecutive slots.
        cache_length: the cached prefix the rows read (default: the largest position + 1).
        """
        hidden_BTC, routing = self.hidden_states(
            input_ids_BT, positions_BT, kv_cache=kv_cache, cache_slots=cache_slots, capture_routing=capture_routing,
            replay_routing=replay_routing, cache_length=cache_length)
        return ModelOutput(self.lm_head(hidden_BTC), routing)

    def hidden_states(
        self,
        input_ids_BT: torch.Tensor,
        positions_BT: torch.Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
        cache_slots: torch.Tensor | slice | None = None,
        capture_routing: bool = False,
        replay_routing: torch.Tensor | None = None,
        cache_length: int | None = None,
        shared_prefix: SharedPrefix | None = None,
        check_replay: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final (normed) hidden state of every position, and the routing: `forward` without the LM head.

        The trainer applies the head only where a token is trained. shared_prefix: the first call over one
        row records the keys/values of a prefix; later calls over many rows continue it (see shared_prefix.py);
        positions, unless given, follow from it. check_replay=False: the caller checked the replayed routing's
        expert indices on the host (the check here reads a device value, a wait for a GPU).
        """
        B, T = input_ids_BT.shape
        chosen_positions = positions_BT
        if positions_BT is None:
            if kv_cache is not None:
                raise ValueError("cached forward needs explicit positions")
            start = 0 if shared_prefix is None else shared_prefix.start
            positions_BT = torch.arange(start, start + T, device=input_ids_BT.device).expand(B, T)
        if replay_routing is not None:
            if replay_routing.shape[:3] != (B, T, self.num_moe_layers):
                raise ValueError(
                    f"replay_routing has shape {tuple(replay_routing.shape)}, "
                    f"expected ({B}, {T}, {self.num_moe_layers}, k)"
                )
            # Checked once for all layers (one read back from the device): an index out of range would end
            # a CUDA process in a device-side assert instead of an error.
            E = self.config.num_experts
            if check_replay and replay_routing.numel():
                low, high = torch.stack(torch.aminmax(replay_routing)).tolist()
                if low < 0 or high >= E:
                    raise ValueError(f"replayed routing names an expert outside 0..{E - 1}")
        x_BTC = self.model.embed_tokens(input_ids_BT)
        cos_sin = self.model.rotary_emb(positions_BT, x_BTC.dtype)
        cache_step = None
        if kv_cache is not None:
            assert cache_slots is not None, "cached forward needs cache_slots"
            cache_step = kv_cache.begin(cache_slots, positions_BT, cache_length)
        elif shared_prefix is not None:
            cache_step = shared_prefix.begin(B, T, chosen_positions)
        captured: list[torch.Tensor] = []
        moe_i = 0
        for layer in self.model.layers:
            replay = None
            if layer.is_moe and replay_routing is not None:
                replay = replay_routing[:, :, moe_i]
            x_BTC, experts_BTK = layer(x_BTC, cos_sin, cache_step, replay)
            if experts_BTK is not None:
                moe_i += 1
                if capture_routing:
                    captured.append(experts_BTK)
        routing = None
        if capture_routing and captured:
            routing = torch.stack(captured, dim=2).to(routing_dtype(self.config.num_experts))
        return self.model.norm(x_BTC), routing

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


@torch.no_grad()
def sequence_logprobs(
    model: Qwen3ForCausalLM, token_ids: torch.Tensor, replay_routing: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The trainer's view of one sequence: one full-sequence forward over token_ids[:-1].

    Returns (logprob of each of token_ids[1:] given its prefix, fp32 [T-1]; the routing that forward
    used, [T-1, moe layers, k], or None for a dense model). `replay_routing` ([>= T-1, layers, k]) forces
    the recorded routing of each input position.
    """
    token_ids = torch.as_tensor(token_ids, dtype=torch.long, device=model.lm_head.weight.device)
    T = token_ids.shape[0]
    replay = None
    if replay_routing is not None:
        replay = torch.as_tensor(replay_routing, device=token_ids.device)[None, : T - 1]
    out = model(token_ids[None, :-1], capture_routing=True, replay_routing=replay)
    lp_TV = torch.log_softmax(out.logits_BTV[0].float(), dim=-1)
    logprobs = lp_TV.gather(1, token_ids[1:, None])[:, 0]
    return logprobs, None if out.routing_BTLK is None else out.routing_BTLK[0]
