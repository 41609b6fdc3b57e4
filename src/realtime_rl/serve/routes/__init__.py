"""One router per resource: chat completions, models, health and metrics."""
