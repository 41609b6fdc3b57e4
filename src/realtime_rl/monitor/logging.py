"""Process-wide logging: rich on a terminal, plain lines otherwise; `RTRL_LOG_LEVEL` overrides the level."""

from __future__ import annotations

import logging
import os
import sys

from rich.logging import RichHandler


def setup_logging(level: str | int = "INFO") -> None:
    level = os.environ.get("RTRL_LOG_LEVEL", level)
    if isinstance(level, str):
        if logging.getLevelName(level.upper()) not in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR,
                                                        logging.CRITICAL):
            raise ValueError(f"log level {level!r} (RTRL_LOG_LEVEL or --log-level): use DEBUG, INFO, WARNING, "
                             "ERROR or CRITICAL")
        level = level.upper()
    if sys.stderr.isatty():
        handler: logging.Handler = RichHandler(show_path=False, rich_tracebacks=False)
        fmt = "%(message)s"
    else:
        handler = logging.StreamHandler(sys.stderr)
        fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt, handlers=[handler], force=True)
    # HTTP clients log every request at INFO: thousands of lines a minute from the simulated users.
    for chatty in ("httpx", "httpx2", "httpcore", "openai"):
        logging.getLogger(chatty).setLevel(max(logging.WARNING, logging.getLogger().level))
