"""One router per resource: chat completions, feedback, models, health and metrics."""
