"""Training: continued pre-training of the base model (pretrain.py, corpus.py) and the RL trainer
(rl.py, with the objective in losses.py).

Public API:
    pretrain(PretrainConfig()) -> summary;  ensure_base_model(PretrainConfig()) -> checkpoint dir
    RLTrainer.open(run_dir, base_checkpoint, RLConfig()); trainer.step(episodes); trainer.save()
    traffic_episodes([(completion_record, choice_index, reward), ...]) -> episodes   # served traffic, exactly
    with run_dir_lock(run_dir, "`rtrl train`"): remove_staging(run_dir)  # one writer
"""

from realtime_rl.train.losses import LossConfig, group_advantages, k3, pass_at_k_advantages, policy_loss
from realtime_rl.train.pretrain import ensure_base_model, latest_checkpoint, prepare_corpus, pretrain
from realtime_rl.train.rl import RLTrainer, episode_reward, staleness
from realtime_rl.train.run_dir import remove_staging, run_dir_lock
from realtime_rl.train.traffic import (nucleus, sampled_at, trainable, traffic_episode, traffic_episodes,
                                      traffic_segment)

__all__ = ["LossConfig", "RLTrainer", "ensure_base_model", "episode_reward", "group_advantages", "k3",
           "latest_checkpoint", "nucleus", "pass_at_k_advantages", "policy_loss", "prepare_corpus", "pretrain",
           "remove_staging", "run_dir_lock", "sampled_at", "staleness", "trainable", "traffic_episode",
           "traffic_episodes", "traffic_segment"]
