"""The learning-rate schedule of pre-training and RL: linear warmup, then cosine decay to a floor."""

from __future__ import annotations

import math


def warmup_cosine(step: int, lr: float, warmup_steps: int, decay_steps: int | None, min_lr_ratio: float) -> float:
    """The rate of optimizer step `step` (0-based): lr * (step + 1) / warmup_steps during warmup, then a cosine
    from lr down to lr * min_lr_ratio over the next decay_steps steps, held there after; decay_steps None
    keeps lr constant after warmup."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay_steps is None:
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps))
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
