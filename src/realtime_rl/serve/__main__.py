"""`python -m realtime_rl.serve SETTINGS.json`: run_server with settings from a JSON file (serve_in_process)."""

from __future__ import annotations

import sys
from pathlib import Path

from realtime_rl.config import ServeConfig
from realtime_rl.monitor import setup_logging
from realtime_rl.serve.server import run_server

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m realtime_rl.serve SETTINGS.json")
    setup_logging("INFO")
    run_server(ServeConfig.model_validate_json(Path(sys.argv[1]).read_text()))
