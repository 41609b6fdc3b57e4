"""Many rows that share a prefix, computed once: the trainer's forward over sequences with one prompt.

    prefix = SharedPrefix()
    model.hidden_states(ids[:1, :P], shared_prefix=prefix)                    # one row: records each layer's K/V
    h, _ = model.hidden_states(ids[:, P:], positions, shared_prefix=prefix)   # every row attends to them

In the second call each row's queries attend to the prefix's keys and values (read as an expanded view,
never copied per row before attention) and causally to their own. Autograd sums the rows' gradients
back into the one prefix computation, so the loss and its gradient equal those of B full-length
forwards, up to float summation order, at the cost of one prefix plus B suffixes. In the live loop every
reply shares the system prompt and the tool schemas (about three quarters of a trained sequence).

Not here: choosing the prefix (the trainer does: equal token ids, equal replayed routing, no trained
target inside it), caching across forwards (the engine's KV cache does that for inference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from realtime_rl.model.kv_cache import masked_attention


class SharedPrefix:
    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.length: int | None = None
        """Prefix length once recorded."""

    def begin(self, positions_BT: torch.Tensor) -> _Record | _Extend:
        """The step of one forward: record the prefix (first call), or continue it in every row."""
        B, T = positions_BT.shape
        device = positions_BT.device
        causal_TT = torch.ones((T, T), dtype=torch.bool, device=device).tril()
        if self.length is None:
            if B != 1:
                raise ValueError(f"a shared prefix is recorded from one row, got {B}")
            self.length = T
            return _Record(self, causal_TT[None, None])
        P = self.length
        if int(positions_BT[:, 0].min()) != P or int(positions_BT[:, 0].max()) != P:
            raise ValueError(f"rows continuing a shared prefix of {P} tokens must start at position {P}")
        prefix_TP = torch.ones((T, P), dtype=torch.bool, device=device)
        return _Extend(self, B, torch.cat([prefix_TP, causal_TT], dim=1)[None, None])


@dataclass
class _Record:
    prefix: SharedPrefix
    mask_B1TS: torch.Tensor

    def attend(self, layer_idx: int, q_BHTD: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor
               ) -> torch.Tensor:
        self.prefix.keys[layer_idx], self.prefix.values[layer_idx] = k_BHTD, v_BHTD
        return masked_attention(q_BHTD, k_BHTD, v_BHTD, self.mask_B1TS)


@dataclass
class _Extend:
    prefix: SharedPrefix
    rows: int
    mask_B1TS: torch.Tensor

    def attend(self, layer_idx: int, q_BHTD: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor
               ) -> torch.Tensor:
        k_prefix = self.prefix.keys[layer_idx].expand(self.rows, -1, -1, -1)
        v_prefix = self.prefix.values[layer_idx].expand(self.rows, -1, -1, -1)
        k_BHSD, v_BHSD = torch.cat([k_prefix, k_BHTD], dim=2), torch.cat([v_prefix, v_BHTD], dim=2)
        return masked_attention(q_BHTD, k_BHSD, v_BHSD, self.mask_B1TS)
