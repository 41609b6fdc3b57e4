"""realtime-rl: keeps a coding agent learning from the people who use it."""

__version__ = "0.1.0"
