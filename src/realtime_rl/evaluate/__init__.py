"""Evaluation: the eval harness (pass@k on task folders); the promotion gate and experiment statistics
arrive with the real-time loop."""

from realtime_rl.evaluate.harness import EvalReport, evaluate_policy, evaluate_solutions, pass_at_k, run_eval

__all__ = ["EvalReport", "evaluate_policy", "evaluate_solutions", "pass_at_k", "run_eval"]
