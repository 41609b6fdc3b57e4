"""Evaluation: the eval harness (pass@k on task folders), the promotion gate (candidate against the live
champion on a held-out suite, a paired non-inferiority test, hack canaries) and the A/B statistics of a
canary (per-arm metrics with intervals, sample-ratio mismatch, promote / roll back / continue)."""

from realtime_rl.evaluate.ab import ABRecord, ABReport, ab_records, analyze
from realtime_rl.evaluate.gate import EpisodeOutcome, GateDecision, decide, evaluate_checkpoint
from realtime_rl.evaluate.harness import EvalReport, evaluate_policy, evaluate_solutions, pass_at_k, run_eval

__all__ = ["ABRecord", "ABReport", "EpisodeOutcome", "EvalReport", "GateDecision", "ab_records", "analyze", "decide",
           "evaluate_checkpoint", "evaluate_policy", "evaluate_solutions", "pass_at_k", "run_eval"]
