"""Metrics sinks and logging shared by every process."""

from realtime_rl.monitor.logging import setup_logging
from realtime_rl.monitor.metrics import ConsoleSink, JsonlSink, MetricsSink, MultiSink, NullSink

__all__ = ["ConsoleSink", "JsonlSink", "MetricsSink", "MultiSink", "NullSink", "setup_logging"]
