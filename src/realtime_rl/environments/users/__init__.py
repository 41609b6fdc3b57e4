"""Simulated developers who use the gateway through the official `openai` client and send feedback.

    summary = run_simulated_users(SimulateUsersConfig(base_url="http://127.0.0.1:8000", sessions=20))

model.py is the user's mind (profiles, reading an answer, style checks, reactions: pure functions);
session.py is one user against the gateway (completions, feedback with retries, delayed events, the
sandbox); run.py runs many users on threads and summarizes. The CLI's `rtrl simulate-users` calls
run_simulated_users.
"""

from realtime_rl.environments.users.model import (
    Answer, EditOutcome, PlannedEvent, Reaction, UserProfile, make_users, react, read_answer, style_violation,
)
from realtime_rl.environments.users.run import load_user_tasks, run_simulated_users
from realtime_rl.environments.users.session import (
    DelayedFeedback, FeedbackSender, SimulatedUser, Stats, followup_messages, wire_event,
)

__all__ = ["Answer", "DelayedFeedback", "EditOutcome", "FeedbackSender", "PlannedEvent", "Reaction", "SimulatedUser",
           "Stats", "UserProfile", "followup_messages", "load_user_tasks", "make_users", "react", "read_answer",
           "run_simulated_users", "style_violation", "wire_event"]
