"""Every recipe in configs/ parses with its root; bad input fails with a message that says what to fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from realtime_rl.config import RECIPE_ROOTS, DemoConfig, LoopConfig, ModelConfig, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPES = sorted(CONFIGS.rglob("*.toml"))


def test_there_are_recipes():
    assert RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=[str(p.relative_to(CONFIGS)) for p in RECIPES])
def test_every_recipe_parses(path):
    folder = path.relative_to(CONFIGS).parts[0]
    assert folder in RECIPE_ROOTS, f"configs/{folder}/ has no root in config.RECIPE_ROOTS"
    load_config(RECIPE_ROOTS[folder], path)


def test_every_field_is_documented():
    def walk(cls, seen):
        for name, field in cls.model_fields.items():
            assert field.description, f"{cls.__name__}.{name} has no docstring"
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields") and ann not in seen:
                seen.add(ann)
                walk(ann, seen)
    for root in RECIPE_ROOTS.values():
        walk(root, set())


def test_unknown_keys_are_rejected(tmp_path):
    path = tmp_path / "x.toml"
    path.write_text("seed = 1\nmax_new_tokenz = 3\n")
    with pytest.raises(ValueError, match="max_new_tokenz: Extra inputs are not permitted"):
        load_config(DemoConfig, path)


def test_overrides_are_typed_and_nested():
    cfg = load_config(DemoConfig, None, ["pretrain.model.num_experts=4", "seed=7", 'run_dir="out/x"',
                                         "pretrain.model.rope_theta=1e4"])
    assert cfg.pretrain.model.num_experts == 4 and cfg.seed == 7 and str(cfg.run_dir) == "out/x"
    assert cfg.pretrain.model.rope_theta == 1e4


def test_a_nested_table_changes_only_the_keys_it_names(tmp_path):
    """The demo's loop is not LoopConfig's production default: setting one key of it keeps the rest."""
    demo = DemoConfig()
    cfg = load_config(DemoConfig, None, ["loop.cycles=5", "loop.gate.margin=0.2"])
    assert cfg.loop.cycles == 5 and cfg.loop.gate.margin == 0.2
    assert cfg.loop.cycle_period_s == demo.loop.cycle_period_s != LoopConfig().cycle_period_s
    assert cfg.loop.gate.concurrency == demo.loop.gate.concurrency and cfg.users == demo.users
    path = tmp_path / "demo.toml"
    path.write_text('[users]\nusers = 3\nstyle_mix = {none = 1.0}\n')
    cfg = load_config(DemoConfig, path)
    assert cfg.users.users == 3 and cfg.users.style_mix == {"none": 1.0}  # a dict value is replaced, not merged
    assert cfg.users.think_time_s == demo.users.think_time_s


@pytest.mark.parametrize("override, message", [
    ("pretrain.model.num_experts=-1", "greater than or equal"),
    ("pretrain.model.num_key_value_heads=3", "multiple of"),
    ("nonsense", "key=value"),
    ("seed.x=1", "seed: Input should be a valid integer"),
])
def test_bad_overrides_say_what_to_fix(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(DemoConfig, None, [override])


def test_override_below_a_value_is_refused():
    with pytest.raises(ValueError, match="'seed' is a value, not a table"):
        load_config(DemoConfig, None, ["seed=1", "seed.x=1"])


def test_invalid_toml_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("seed = = 1")
    with pytest.raises(ValueError, match="bad.toml: invalid TOML"):
        load_config(DemoConfig, path)


def test_model_config_invariants():
    with pytest.raises(ValueError, match="exceeds num_experts"):
        ModelConfig(num_experts=2, num_experts_per_tok=3)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelConfig(num_hidden_layers=2, mlp_only_layers=[5])
    assert ModelConfig(num_experts=4, num_hidden_layers=4, decoder_sparse_step=2).moe_layers == [1, 3]


def test_prefix_reuse_across_versions_stays_within_the_staleness_bound():
    from realtime_rl.config import RolloutConfig, TrainConfig

    assert TrainConfig(max_staleness=2, rollout=RolloutConfig(prefix_max_age=2)).rollout.prefix_max_age == 2
    with pytest.raises(ValueError, match="may not exceed max_staleness"):
        TrainConfig(max_staleness=1, rollout=RolloutConfig(prefix_max_age=2))


def test_fresh_attempts_stay_within_an_episodes_seeds_and_out_of_training_and_the_gate():
    from realtime_rl.config import AgentConfig, RolloutConfig

    assert AgentConfig(attempts=4, max_turns=8, max_summaries=0).attempts == 4
    with pytest.raises(ValueError, match="sampling seeds"):  # 40 x 58 calls would reuse later episodes' seeds
        AgentConfig(attempts=40)
    with pytest.raises(ValueError, match="one-attempt episodes"):
        RolloutConfig(agent=AgentConfig(attempts=2))
    with pytest.raises(ValueError, match="as users are served"):
        LoopConfig(agent=AgentConfig(attempts=2))
    with pytest.raises(ValueError, match="no cycle could train"):
        LoopConfig(min_trajectories=64, max_trajectories=32)
