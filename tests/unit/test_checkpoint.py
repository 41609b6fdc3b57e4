"""Checkpoint directories: round trips, dtypes, shards, ties, and clear errors on bad directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from realtime_rl.model import Qwen3ForCausalLM, load_checkpoint, save_checkpoint
from realtime_rl.train.run_dir import remove_staging
from tests.conftest import tiny_config


def _logits(model, seed=0):
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits_BTV


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_round_trip_is_bit_exact(tmp_path, moe, tied, tokenizer):
    model = Qwen3ForCausalLM(tiny_config(moe=moe, tie_word_embeddings=tied)).eval()
    save_checkpoint(tmp_path, model, tokenizer)
    files = {p.name for p in tmp_path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= files
    loaded = load_checkpoint(tmp_path)
    assert torch.equal(_logits(loaded.model), _logits(model))
    assert loaded.tokenizer is not None and loaded.tokenizer.vocab_size == tokenizer.vocab_size
    keys = load_file(tmp_path / "model.safetensors").keys()
    assert ("lm_head.weight" in keys) == (not tied)
    if moe:
        assert "model.layers.0.mlp.experts.7.gate_proj.weight" in keys
        assert "model.layers.0.mlp.gate.weight" in keys
    if tied:
        assert loaded.model.lm_head.weight.data_ptr() == loaded.model.model.embed_tokens.weight.data_ptr()


def test_no_tokenizer_files_gives_none(tmp_path):
    save_checkpoint(tmp_path, Qwen3ForCausalLM(tiny_config()))
    assert load_checkpoint(tmp_path).tokenizer is None


def test_dtype_is_kept_and_can_be_overridden(tmp_path):
    model = Qwen3ForCausalLM(tiny_config(moe=True)).to(torch.bfloat16)
    save_checkpoint(tmp_path, model)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_checkpoint(tmp_path).model.lm_head.weight.dtype == torch.bfloat16
    as_fp32 = load_checkpoint(tmp_path, dtype=torch.float32)
    assert as_fp32.model.lm_head.weight.dtype == torch.float32
    assert as_fp32.config.torch_dtype == "float32"


def test_sharded_checkpoint_loads(tmp_path):
    model = Qwen3ForCausalLM(tiny_config(moe=True)).eval()
    save_checkpoint(tmp_path, model)
    tensors = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, tmp_path / shard)
        weight_map.update({k: shard for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert torch.equal(_logits(load_checkpoint(tmp_path).model), _logits(model))


def test_saving_over_a_sharded_checkpoint_loads_what_was_saved(tmp_path):
    """The index of the sharded checkpoint there before was read first: the old weights came back."""
    old, new = Qwen3ForCausalLM(tiny_config(moe=True)).eval(), Qwen3ForCausalLM(tiny_config(moe=True)).eval()
    new.reset_parameters(seed=1)
    test_sharded_checkpoint_loads(tmp_path)  # a sharded checkpoint of another model
    save_checkpoint(tmp_path, new)
    assert not (tmp_path / "model.safetensors.index.json").exists() and not list(tmp_path.glob("model-*"))
    assert torch.equal(_logits(load_checkpoint(tmp_path).model), _logits(new))
    assert not torch.equal(_logits(new), _logits(old))


def test_expert_tensors_past_the_configs_experts_are_refused(tmp_path):
    save_checkpoint(tmp_path, Qwen3ForCausalLM(tiny_config(moe=True)))
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"num_experts": cfg["num_experts"] - 2}))
    with pytest.raises(ValueError, match=rf"experts\.{cfg['num_experts'] - 2}\.\* .*num_experts="):
        load_checkpoint(tmp_path)  # experts 6 and 7 were dropped silently
    dense = {k: v for k, v in cfg.items() if k not in ("num_experts", "moe_intermediate_size")}
    (tmp_path / "config.json").write_text(json.dumps(dense | {"model_type": "qwen3",
                                                             "architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(ValueError, match="num_experts=0"):  # was a RuntimeError from torch.stack
        load_checkpoint(tmp_path)


def test_a_moe_config_without_num_experts_per_tok_routes_as_transformers_does(tmp_path):
    save_checkpoint(tmp_path, Qwen3ForCausalLM(tiny_config(moe=True)))
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["num_experts_per_tok"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_checkpoint(tmp_path).config.num_experts_per_tok == 8  # Qwen3MoeConfig's default (ours: 2)


def test_missing_tensor_is_a_clear_error(tmp_path):
    save_checkpoint(tmp_path, Qwen3ForCausalLM(tiny_config(moe=True)))
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"experts\.\{3\}\.up_proj"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("patch, message", [
    ({"model_type": "llama"}, "not a Qwen3 model"),
    ({"use_sliding_window": True}, "sliding_window"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "RoPE scaling"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 3}, "multiple of"),
])
def test_unsupported_configs_are_rejected(tmp_path, patch, message):
    save_checkpoint(tmp_path, Qwen3ForCausalLM(tiny_config()))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(patch)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        load_checkpoint(tmp_path)


def test_not_a_checkpoint_directory(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="invalid JSON"):
        load_checkpoint(tmp_path)


def test_a_published_directory_replaces_the_old_one_whole(tmp_path, monkeypatch):
    import os

    from realtime_rl.model.checkpoint import publish_directory

    def staged(text: str) -> Path:
        staging = tmp_path / f".ckpt-{text}"  # as the trainers stage their saves
        staging.mkdir()
        (staging / "a.txt").write_text(text)
        (staging / "b.txt").write_text(text)
        return staging

    final = tmp_path / "checkpoints" / "v-0000001"
    publish_directory(staged("old"), final)
    publish_directory(staged("new"), final)
    assert {p.name: p.read_text() for p in final.iterdir()} == {"a.txt": "new", "b.txt": "new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]  # nothing left aside
    # A crash between the two renames: the old directory was moved aside whole, not deleted file by file.
    replace = os.replace
    calls = []

    def crash_on_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("killed")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_second)
    with pytest.raises(OSError, match="killed"):
        publish_directory(staged("newer"), final)
    aside = next(final.parent.glob(".old-*")) / final.name
    assert not final.exists() and {p.read_text() for p in aside.iterdir()} == {"new"}
    monkeypatch.setattr(os, "replace", replace)
    remove_staging(tmp_path)  # the next holder of the run_dir puts it back, drops the staging
    assert {p.read_text() for p in final.iterdir()} == {"new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]
    assert [p.name for p in final.parent.iterdir()] == [final.name]
