"""One router per resource: chat completions, text completions, feedback, models, health and metrics."""
