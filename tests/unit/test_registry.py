"""The policy registry: lifecycle, lineage, refusals, atomic promotion under concurrency, reopening, the CLI."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from realtime_rl.deploy.registry import DataWindow, Registry, StateChanged
from realtime_rl.cli import build_parser
from realtime_rl.deploy.registry_cli import run_registry

REGISTRY_PY = Path(__file__).resolve().parents[2] / "src" / "realtime_rl" / "deploy" / "registry.py"


def checkpoint(root: Path, name: str) -> Path:
    """A directory in the Hugging Face layout (the registry checks the layout, not the weights)."""
    path = root / "checkpoints" / name
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return path


@pytest.fixture
def registry(tmp_path):
    reg = Registry.open(tmp_path / "run")
    yield reg
    reg.close()


def canary(registry: Registry, root: Path, parent: int) -> int:
    v = registry.register(checkpoint(root, f"c{len(registry.list())}"), parent=parent)
    registry.transition(v.version, "canary", reason="gate passed")
    return v.version


def test_lifecycle_records_lineage_and_every_transition(registry, tmp_path):
    base = registry.bootstrap(checkpoint(tmp_path, "base"), metrics={"pass_at_1": 0.4})
    assert (base.version, base.state, registry.live()) == (1, "live", base)
    window = DataWindow(since=1000.0, until=4600.0, completions=812)
    v2 = registry.register(checkpoint(tmp_path, "step-2"), parent=1, window=window, reward_version="v3",
                           reward_digest="sha256:ab12", metrics={"pass_at_1": 0.55})
    assert (v2.version, v2.state, v2.parent, v2.window) == (2, "candidate", 1, window)
    assert v2.checkpoint == (tmp_path / "checkpoints" / "step-2").resolve()

    registry.transition(2, "canary", reason="gate passed", evidence={"p_value": 0.01})
    promoted = registry.promote(2, reason="A/B win", evidence={"edits_kept_diff": 0.02})
    assert promoted.state == "live" and registry.get(1).state == "retired" and registry.live().version == 2
    assert [(t.from_state, t.to_state) for t in registry.history(2)] == [
        (None, "candidate"), ("candidate", "canary"), ("canary", "live")]
    assert registry.history(2)[-1].evidence == {"edits_kept_diff": 0.02, "replaced": 1}
    assert registry.history(2)[1].evidence == {"p_value": 0.01}
    retire = registry.history(1)[-1]
    assert (retire.from_state, retire.to_state, retire.evidence) == ("live", "retired", {"replaced_by": 2})

    registry.register(checkpoint(tmp_path, "step-3"), parent=2)
    assert [v.version for v in registry.lineage(3)] == [3, 2, 1]
    assert [v.version for v in registry.list("candidate")] == [3]
    assert registry.set_metrics(3, {"pass_at_1": 0.6}).metrics == {"pass_at_1": 0.6}
    assert registry.set_metrics(3, {"ab": {"decision": "continue"}}).metrics == {
        "pass_at_1": 0.6, "ab": {"decision": "continue"}}


def test_refusals_name_the_allowed_moves(registry, tmp_path):
    registry.bootstrap(checkpoint(tmp_path, "base"))
    registry.register(checkpoint(tmp_path, "c"), parent=1)
    with pytest.raises(ValueError, match=r"candidate -> live is not allowed; from candidate the allowed moves are: "
                                         r"canary, rolled_back"):
        registry.promote(2, reason="skip the canary")
    with pytest.raises(ValueError, match=r"live -> retired is not allowed; .*allowed moves are: rolled_back"):
        registry.transition(1, "retired", reason="retire by hand")
    registry.rollback(2, reason="gate failed")
    with pytest.raises(ValueError, match=r"rolled_back -> canary is not allowed; from rolled_back there is no"):
        registry.transition(2, "canary", reason="retry")
    with pytest.raises(ValueError, match=r"unknown state 'shipped'; states are candidate, canary, live"):
        registry.transition(1, "shipped", reason="x")
    with pytest.raises(ValueError, match=r"version 9 is not registered .*registered: 1, 2"):
        registry.get(9)
    with pytest.raises(ValueError, match="needs a reason"):
        registry.rollback(1, reason=" ")
    with pytest.raises(ValueError, match="already live: bootstrap only starts an empty registry"):
        registry.bootstrap(checkpoint(tmp_path, "base2"))
    with pytest.raises(ValueError, match="version 2 is already registered"):
        registry.register(checkpoint(tmp_path, "dup"), version=2)
    with pytest.raises(ValueError, match="parent version 7 is not registered"):
        registry.register(checkpoint(tmp_path, "orphan"), parent=7)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="lacks config.json or \\*.safetensors"):
        registry.register(tmp_path / "empty")
    with pytest.raises(ValueError, match="finite numbers"):
        registry.register(checkpoint(tmp_path, "nan"), metrics={"loss": float("nan")})
    with pytest.raises(ValueError, match="since <= until"):
        DataWindow(since=10.0, until=5.0, completions=1)
    # A refused change wrote nothing.
    assert [v.state for v in registry.list()] == ["live", "rolled_back"]
    assert len(registry.history(1)) == 1


def test_rollback_restores_the_most_recently_retired_version(registry, tmp_path):
    registry.bootstrap(checkpoint(tmp_path, "base"))
    for parent in (1, 2):
        registry.promote(canary(registry, tmp_path, parent), reason="win")
    v4 = canary(registry, tmp_path, parent=1)  # trained from an older checkpoint than the live one
    registry.rollback(v4, reason="canary regressed latency")
    assert registry.live().version == 3 and registry.get(v4).state == "rolled_back"  # a canary: live unchanged

    registry.promote(canary(registry, tmp_path, parent=1), reason="win")  # v5 replaces v3, its parent is v1
    assert registry.live().version == 5
    rolled = registry.rollback(5, reason="dissatisfied up", evidence={"p": 0.001})
    # v5 took v3's place: the rollback undoes that promotion, it does not jump to v5's parent v1.
    assert rolled.state == "rolled_back" and registry.live().version == 3
    assert registry.history(5)[-1].evidence == {"p": 0.001, "restored": 3}
    restored = registry.history(3)[-1]
    assert (restored.from_state, restored.to_state, restored.evidence) == ("retired", "live", {"rolled_back": 5})
    registry.rollback(3, reason="again")
    assert registry.live().version == 2
    registry.rollback(2, reason="again")
    assert registry.live().version == 1
    with pytest.raises(ValueError, match="no retired version exists to restore"):
        registry.rollback(1, reason="nothing before the bootstrap")
    assert registry.live().version == 1


def test_two_live_versions_are_impossible_even_for_raw_sql(registry, tmp_path):
    registry.bootstrap(checkpoint(tmp_path, "base"))
    registry.register(checkpoint(tmp_path, "c"))
    conn = sqlite3.connect(registry.path)
    with pytest.raises(sqlite3.IntegrityError, match="UNIQUE"):
        conn.execute("UPDATE versions SET state = 'live' WHERE version = 2")
    conn.close()


def test_concurrent_promotions_on_separate_connections_serialize(tmp_path):
    run = tmp_path / "run"
    with Registry.open(run) as setup:
        setup.bootstrap(checkpoint(tmp_path, "base"))
        canaries = [canary(setup, tmp_path, parent=1) for _ in range(8)]
    registries = [Registry.open(run) for _ in range(4)]
    start, errors = threading.Barrier(4), []

    def promote_all(reg: Registry, versions: list[int]) -> None:
        start.wait(timeout=10)
        for v in versions:
            try:
                reg.promote(v, reason="race")
            except Exception as e:  # noqa: BLE001 - the test reports any failure below
                errors.append(e)

    threads = [threading.Thread(target=promote_all, args=(reg, canaries[i::4]))
               for i, reg in enumerate(registries)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and not any(t.is_alive() for t in threads)
    check = registries[0]
    assert len(check.list("live")) == 1 and len(check.list("retired")) == 8
    assert_promotions_form_one_chain(check)
    # The same canary promoted from two connections at once: exactly one wins, the other is told why.
    v = canary(check, tmp_path, parent=1)
    results: list[object] = []
    both = threading.Barrier(2)

    def promote_once(reg: Registry) -> None:
        both.wait(timeout=10)
        try:
            results.append(reg.promote(v, reason="race").state)
        except ValueError as e:
            results.append(str(e))

    threads = [threading.Thread(target=promote_once, args=(reg,)) for reg in registries[:2]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(map(str, results)) == ["live", f"version {v} is live: live -> live is not allowed; from live the "
                                         "allowed moves are: rolled_back (rollback; a live version is replaced by "
                                         "the most recently retired one)"]
    for reg in registries:
        reg.close()


def assert_promotions_form_one_chain(registry: Registry) -> None:
    """In commit order, each promotion retired exactly the version that was live just before it."""
    conn = sqlite3.connect(registry.path)
    rows = conn.execute("SELECT version, from_state, to_state, evidence FROM transitions ORDER BY id").fetchall()
    conn.close()
    live, promotions = None, 0
    for version, old, new, evidence in rows:
        if new == "retired":
            assert version == live
        if new == "live":
            if old == "canary":
                assert json.loads(evidence).get("replaced") == live
                promotions += 1
            live = version
    assert promotions > 1 and registry.live().version == live


PROMOTER = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("registry", sys.argv[1])
registry = importlib.util.module_from_spec(spec)
sys.modules["registry"] = registry  # dataclasses look their module up while the class is built
spec.loader.exec_module(registry)
reg = registry.Registry.open(sys.argv[2])
while time.time() < float(sys.argv[3]):
    time.sleep(0.001)
for v in sys.argv[4:]:
    reg.promote(int(v), reason="process race")
"""


def test_two_processes_promoting_at_once_leave_one_live_version(tmp_path):
    run = tmp_path / "run"
    with Registry.open(run) as reg:
        reg.bootstrap(checkpoint(tmp_path, "base"))
        canaries = [canary(reg, tmp_path, parent=1) for _ in range(10)]
    import time

    # registry.py imports nothing of ours: loading it by path keeps torch out of the child processes.
    go = str(time.time() + 1.0)
    procs = [subprocess.Popen([sys.executable, "-c", PROMOTER, str(REGISTRY_PY), str(run), go,
                               *map(str, canaries[i::2])], stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=30)
        assert p.returncode == 0, err
    with Registry.open(run) as reg:
        assert len(reg.list("live")) == 1 and len(reg.list("retired")) == 10
        assert_promotions_form_one_chain(reg)


def test_reopen_keeps_everything_and_uses_wal(tmp_path):
    run = tmp_path / "run"
    with Registry.open(run) as reg:
        reg.bootstrap(checkpoint(tmp_path, "base"), metrics={"pass_at_1": 0.4})
        v = canary(reg, tmp_path, parent=1)
        reg.promote(v, reason="win", evidence={"ci": [0.01, 0.05]})
        before = (reg.list(), [reg.history(x.version) for x in reg.list()])
    with Registry.open(run, create=False) as reg:
        assert (reg.list(), [reg.history(x.version) for x in reg.list()]) == before
        assert reg.live().version == v
        assert reg._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with pytest.raises(ValueError, match="no registry at .*is --run-dir the loop's run directory"):
        Registry.open(tmp_path / "elsewhere", create=False)


def cli(argv: list[str]) -> int:
    return run_registry(build_parser().parse_args(argv))


def test_cli_lists_shows_promotes_and_rolls_back(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps at 80 columns when stdout is not a terminal
    run = tmp_path / "run"
    with Registry.open(run) as reg:
        reg.bootstrap(checkpoint(tmp_path, "base"), metrics={"pass_at_1": 0.4})
        reg.register(checkpoint(tmp_path, "c"), parent=1, window=DataWindow(0.0, 3600.0, 57), reward_version="v2",
                     metrics={"pass_at_1": 0.61})
    assert cli(["registry", "promote", "2", "--run-dir", str(run), "--reason", "gate passed"]) == 0
    assert "version 2: candidate -> canary" in capsys.readouterr().out
    assert cli(["registry", "promote", "2", "--run-dir", str(run), "--reason", "A/B win"]) == 0
    assert "version 2: canary -> live" in capsys.readouterr().out
    assert cli(["registry", "list", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "retired" in out and "live" in out and "pass_at_1=0.61" in out and "57 completions" in out
    assert cli(["registry", "rollback", "2", "--run-dir", str(run), "--reason", "latency up"]) == 0
    assert "version 2: live -> rolled_back; live: 1" in capsys.readouterr().out
    assert cli(["registry", "show", "2", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "version 2 [rolled_back]" in out and "lineage: 2 (rolled_back) <- 1 (live)" in out
    assert "canary -> live: A/B win" in out
    assert '"restored": 1' in out and "live -> rolled_back: latency up" in out
    with pytest.raises(ValueError, match="no registry at"):
        cli(["registry", "list", "--run-dir", str(tmp_path / "nowhere")])
    with pytest.raises(ValueError, match="rolled_back -> live is not allowed"):
        cli(["registry", "promote", "2", "--run-dir", str(run), "--reason", "again"])
    with pytest.raises(SystemExit):
        cli(["registry", "promote", "2", "--run-dir", str(run)])  # --reason is required


def test_history_evidence_round_trips_as_json(registry, tmp_path):
    registry.bootstrap(checkpoint(tmp_path, "base"))
    evidence = {"test": "Tango", "ci": [-0.01, 0.08], "counts": {"b": 6, "c": 2}, "promote": True}
    v = registry.register(checkpoint(tmp_path, "c"), parent=1).version
    registry.transition(v, "canary", reason="gate passed", evidence=evidence)
    assert registry.history(v)[-1].evidence == evidence


def test_a_change_expecting_a_state_the_version_left_changes_nothing(registry, tmp_path):
    """A decision taken on a state read earlier (the loop's A/B on its canary) must not act on a version an
    operator moved meanwhile: rolling back what they just promoted would restore the old version."""
    base = registry.bootstrap(checkpoint(tmp_path, "base")).version
    v = canary(registry, tmp_path, parent=base)
    registry.promote(v, reason="operator: by hand")  # while the loop computed its verdict
    before = registry.history(v)
    with pytest.raises(StateChanged, match=rf"version {v} is live, no longer canary") as caught:
        registry.rollback(v, reason="A/B: worse", expect="canary")
    assert (caught.value.expected, caught.value.found) == ("canary", "live")
    with pytest.raises(StateChanged):
        registry.promote(v, reason="A/B: better", expect="canary")
    assert registry.live().version == v and registry.history(v) == before
    with pytest.raises(ValueError, match="unknown state 'canry'"):
        registry.rollback(v, reason="A/B", expect="canry")
    assert registry.rollback(v, reason="A/B", expect="live").state == "rolled_back"  # as expected: it happens
    assert registry.live().version == base
