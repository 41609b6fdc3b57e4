"""The real-time loop (`rtrl loop`): collect, settle rewards, judge the canary, train, gate, deploy, again.

    loop = RealtimeLoop(LoopConfig(gateway_url=..., store_dir=...))
    loop.run()                      # LoopConfig.cycles cycles; each one's report goes to cycles.jsonl
    write_report(run_dir)           # report.html: per-cycle decisions, A/B tables and plots
"""

from realtime_rl.loop.cycle import RealtimeLoop
from realtime_rl.loop.gateway import GatewayClient
from realtime_rl.loop.state import LoopState

__all__ = ["GatewayClient", "LoopState", "RealtimeLoop"]
