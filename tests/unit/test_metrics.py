from __future__ import annotations

import json

import pytest

from realtime_rl.monitor import ConsoleSink, JsonlSink, MetricsSink, MultiSink, NullSink


def test_jsonl_sink_appends_one_flushed_line_per_call(tmp_path):
    sink = JsonlSink(tmp_path / "m" / "metrics.jsonl")
    sink.log({"train/loss": 1.5, "train/steps": 3}, step=1)
    sink.log({"train/loss": float("nan")}, step=2)
    lines = (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()  # readable before close
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    assert json.loads(lines[0])["metrics"] == {"train/loss": 1.5, "train/steps": 3}
    assert json.loads(lines[1])["metrics"]["train/loss"] is None
    sink.close()


def test_sinks_reject_non_numbers(tmp_path):
    for sink in (NullSink(), JsonlSink(tmp_path / "x.jsonl")):
        with pytest.raises(ValueError, match="must be a number"):
            sink.log({"train/loss": "low"}, step=0)


def test_every_sink_satisfies_the_protocol(tmp_path, capsys):
    sinks = [NullSink(), ConsoleSink(), JsonlSink(tmp_path / "a.jsonl")]
    multi = MultiSink(*sinks)
    assert all(isinstance(s, MetricsSink) for s in [*sinks, multi])
    multi.log({"rollout/reward_mean": 0.25}, step=4)
    multi.close()
    assert "rollout/reward_mean=0.25" in capsys.readouterr().err
