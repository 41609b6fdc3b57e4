"""Training: continued pre-training of the base model (pretrain.py, corpus.py); RL lands next."""

from realtime_rl.train.pretrain import latest_checkpoint, pretrain, prepare_corpus

__all__ = ["latest_checkpoint", "prepare_corpus", "pretrain"]
