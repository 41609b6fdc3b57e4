"""Hugging Face checkpoint directories: read ours and transformers', write ones transformers reads.

A directory holds `config.json` (Qwen3Config / Qwen3MoeConfig fields, `model_type` qwen3 or
qwen3_moe), `model.safetensors` (or shards with `model.safetensors.index.json`) under transformers'
tensor names, and optionally `tokenizer.json`, `tokenizer_config.json` (with the chat template) and
`generation_config.json`.

Expert tensors are accepted both as the Hub's per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`
and as transformers 5's fused `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`; we write the
per-expert form, which every version of transformers and every inference server reads.

Not supported (rejected with a clear error, never silently ignored): sliding-window attention, RoPE
scaling, activations other than SiLU.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from realtime_rl.config import ModelConfig
from realtime_rl.model.qwen3 import Qwen3ForCausalLM
from realtime_rl.model.tokenizer import Tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@dataclass
class Checkpoint:
    """What `load_checkpoint` returns: the module, its tokenizer (None when the directory has none)."""

    model: Qwen3ForCausalLM
    tokenizer: Tokenizer | None
    config: ModelConfig
    path: Path
    generation_config: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- config


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    """Translate a transformers config.json dict into a ModelConfig, rejecting what we do not implement."""
    model_type = raw.get("model_type")
    if model_type not in ("qwen3", "qwen3_moe"):
        raise ValueError(f"config.json: model_type {model_type!r} is not a Qwen3 model (qwen3 or qwen3_moe)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
    if raw.get("use_sliding_window"):
        raise ValueError("config.json: use_sliding_window=true is not supported")
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling")
    rope_type = rope.get("rope_type") or (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if rope_type not in (None, "default"):
        raise ValueError(f"config.json: RoPE scaling {rope_type!r} is not supported")
    fields = set(ModelConfig.model_fields)
    data = {k: v for k, v in raw.items() if k in fields}
    data["rope_theta"] = rope.get("rope_theta", raw.get("rope_theta", 10_000.0))
    data["torch_dtype"] = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if "head_dim" not in raw:
        data["head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]
    if model_type == "qwen3_moe":
        data["num_experts"] = raw.get("num_experts", raw.get("num_local_experts"))
        data["mlp_only_layers"] = raw.get("mlp_only_layers") or []
        # transformers' Qwen3MoeConfig defaults, which a config.json may leave out.
        data.setdefault("norm_topk_prob", False)
        data.setdefault("tie_word_embeddings", False)
        data.setdefault("num_experts_per_tok", 8)  # ours is 2: left out, it routed differently from transformers
    else:
        data["num_experts"] = 0
        data.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    return ModelConfig.model_validate(data)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The config.json transformers' Qwen3Config / Qwen3MoeConfig reads."""
    out: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM" if config.is_moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if config.is_moe else "qwen3",
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "dtype": config.torch_dtype,
        "torch_dtype": config.torch_dtype,
    }
    moe_only = {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef"}
    for name, value in config.model_dump().items():
        if name in moe_only and not config.is_moe:
            continue
        out.setdefault(name, value)
    if not config.is_moe:
        out["max_window_layers"] = config.num_hidden_layers
        out["layer_types"] = ["full_attention"] * config.num_hidden_layers
    return dict(sorted(out.items()))


# ---------------------------------------------------------------------------------------------- weights


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(path / name, framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def hf_to_state_dict(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Hub tensor names -> our state dict (per-expert tensors fused into [E, ...] parameters)."""
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for key, t in tensors.items():
        m = _EXPERT_KEY.match(key)
        if m:
            prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
            experts.setdefault(prefix, {}).setdefault(proj, {})[e] = t
        else:
            state[key] = t
    for prefix, projs in experts.items():
        extra = sorted({e for got in projs.values() for e in got if e >= config.num_experts})
        if extra:  # a dense config (num_experts 0) with expert tensors lands here too
            raise ValueError(f"checkpoint has {prefix}.{extra[0]}.* (and maybe more) but config.json has "
                             f"num_experts={config.num_experts}: unexpected tensors")

        def stack(proj: str, prefix: str = prefix, projs: dict = projs) -> torch.Tensor:
            got = projs.get(proj, {})
            missing = sorted(set(range(config.num_experts)) - set(got))
            if missing:
                raise ValueError(f"checkpoint lacks {prefix}.{{{missing[0]}}}.{proj}.weight (and maybe more)")
            return torch.stack([got[e] for e in range(config.num_experts)])
        state[f"{prefix}.gate_up_proj"] = torch.cat([stack("gate_proj"), stack("up_proj")], dim=1)
        state[f"{prefix}.down_proj"] = stack("down_proj")
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def state_dict_to_hf(model: Qwen3ForCausalLM) -> dict[str, torch.Tensor]:
    """Our state dict -> Hub tensor names, experts split per expert, tied lm_head left out."""
    out: dict[str, torch.Tensor] = {}
    for key, t in model.state_dict().items():
        if key == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if key.endswith("mlp.experts.gate_up_proj"):
            prefix = key.removesuffix(".gate_up_proj")
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = gate[e]
                out[f"{prefix}.{e}.up_proj.weight"] = up[e]
        elif key.endswith("mlp.experts.down_proj"):
            prefix = key.removesuffix(".down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
        else:
            out[key] = t
    return {k: v.detach().contiguous().cpu() for k, v in out.items()}


# ---------------------------------------------------------------------------------------------- public


def torch_device(name: str | torch.device) -> torch.device:
    """The torch device `name` names, checked to exist here (a ValueError says what is missing)."""
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device {str(name)!r}: {e}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(name)!r}: this torch ({torch.__version__}) finds no CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(name)!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return device


def load_checkpoint(
    path: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> Checkpoint:
    """Load a Qwen3 / Qwen3-MoE checkpoint directory (ours or transformers').

    dtype None keeps the dtype config.json names; the tokenizer is None when the directory has no
    tokenizer.json.
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path}: not a checkpoint directory (no config.json)")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file}: invalid JSON: {e}") from None
    config = config_from_hf(raw)
    dtype = dtype or _DTYPES[config.torch_dtype]
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    state = hf_to_state_dict(_read_safetensors(path), config)
    expected = {k for k in model.state_dict() if not (k == "lm_head.weight" and config.tie_word_embeddings)}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"{path}: checkpoint tensors do not match the config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    device = torch_device(device) if device is not None else None
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.config = config.model_copy(update={"torch_dtype": _DTYPE_NAMES[dtype]})
    model.eval()
    tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
    gen_file = path / "generation_config.json"
    generation_config = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    return Checkpoint(model, tokenizer, model.config, path, generation_config)


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory (a directory's fsync makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_directory(staging: Path, final: Path) -> Path:
    """Give a fully written directory its final name, durably: its files and itself are fsynced first, a
    directory already under that name is renamed aside (never half-deleted under it) and removed after,
    and the parent is fsynced: a crash leaves under `final` the old directory, the new one, or (between the
    two renames) none, never a part of one."""
    for path in [*staging.iterdir(), staging]:
        fsync_path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".old-{final.name}-"))
        os.replace(final, old / final.name)
    os.replace(staging, final)
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def numbered_checkpoints(parent: Path, prefix: str) -> list[Path]:
    """parent/<prefix><number> directories, oldest first by the number, not the name: a zero-padded name
    outgrows its padding (v-10000000 sorts before v-9999999 as a string)."""
    found = [p for p in Path(parent).glob(f"{prefix}*") if p.name[len(prefix):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(prefix):]))


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_durably(path: str | os.PathLike, data: bytes) -> None:
    """Replace a file atomically and durably: a reader, or a restart after a crash or a power loss, sees the old
    contents or the new, whole (a temporary file fsynced, renamed over it, then its directory fsynced)."""
    path = Path(path)
    _write_atomic(path, data)
    fsync_path(path.parent)


def save_checkpoint(
    path: str | Path,
    model: Qwen3ForCausalLM,
    tokenizer: Tokenizer | None = None,
    generation_config: dict[str, Any] | None = None,
) -> Path:
    """Write a Hugging Face checkpoint directory. Every file is written atomically and durably (temp, fsync,
    rename; the directory fsynced last), and a sharded checkpoint's index and shards there before are removed
    (the index would win over the new model.safetensors). The set of files is not one atomic change: to give
    a checkpoint its name only once whole, save to a staging directory and `publish_directory` it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for stale in [path / "model.safetensors.index.json", *path.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)  # the index first: without it, the shards are never read
    tensors = state_dict_to_hf(model)
    dtype = next(iter(tensors.values())).dtype
    config = model.config.model_copy(update={"torch_dtype": _DTYPE_NAMES[dtype]})
    if tokenizer is not None:
        config = config.model_copy(update={
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
        })
    fd, tmp = tempfile.mkstemp(dir=path, prefix=".model.safetensors.")
    os.close(fd)
    save_file(tensors, tmp, metadata={"format": "pt"})
    fsync_path(tmp)
    os.replace(tmp, path / "model.safetensors")
    _write_atomic(path / "config.json", (json.dumps(config_to_hf(config), indent=2) + "\n").encode())
    gen = {"_from_model_config": True, "do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}
    if tokenizer is not None:
        gen.update(eos_token_id=[tokenizer.eos_token_id, tokenizer.endoftext_id], pad_token_id=tokenizer.pad_token_id)
    gen.update(generation_config or {})
    _write_atomic(path / "generation_config.json", (json.dumps(gen, indent=2) + "\n").encode())
    if tokenizer is not None:
        for name, data in tokenizer.files().items():
            _write_atomic(path / name, data)
    fsync_path(path)
    return path
