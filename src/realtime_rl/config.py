"""Typed configuration: one pydantic root per process, loaded from TOML recipes in `configs/`.

Every field has a docstring and bounds; unknown keys are rejected so a typo in a recipe fails loudly.
`load_config(cls, path, overrides)` reads a TOML file (or the class defaults when `path` is None) and
applies `--set a.b=value` overrides, whose values are parsed as TOML literals (`lr=3e-4`,
`model.num_experts=8`, `name="x"`), falling back to a bare string.

This module imports nothing of ours and no torch: recipes are validated without loading a model.
"""

from __future__ import annotations

import tomllib
import urllib.parse
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class StrictModel(BaseModel):
    """Base for every config: unknown keys are an error, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class ModelConfig(StrictModel):
    """Architecture of a Qwen3-family transformer (dense, or MoE when `num_experts > 0`).

    Field names and meanings are those of transformers' `Qwen3Config` / `Qwen3MoeConfig`, so the
    object round-trips through a checkpoint's `config.json`.
    """

    vocab_size: int = Field(4096, ge=8, le=1_048_576)
    """Rows of the embedding and of the LM head (may exceed the tokenizer's size, as in Qwen3)."""
    hidden_size: int = Field(128, ge=8, le=65_536)
    """Width of the residual stream."""
    intermediate_size: int = Field(384, ge=8, le=262_144)
    """Hidden width of the dense SwiGLU MLP (dense layers of an MoE model use it too)."""
    num_hidden_layers: int = Field(4, ge=1, le=512)
    """Number of decoder layers."""
    num_attention_heads: int = Field(4, ge=1, le=512)
    """Query heads."""
    num_key_value_heads: int = Field(2, ge=1, le=512)
    """Key/value heads (grouped-query attention); must divide `num_attention_heads`."""
    head_dim: int = Field(32, ge=4, le=1024)
    """Width of one attention head (Qwen3 sets it explicitly, independent of hidden_size)."""
    max_position_embeddings: int = Field(4096, ge=16, le=4_194_304)
    """Longest sequence the model is meant to see."""
    rms_norm_eps: float = Field(1e-6, gt=0, le=1e-2)
    """Epsilon of every RMSNorm."""
    rope_theta: float = Field(1_000_000.0, gt=0)
    """RoPE base frequency."""
    attention_bias: bool = False
    """Bias on the q/k/v/o projections."""
    tie_word_embeddings: bool = True
    """Share the embedding matrix with the LM head."""
    initializer_range: float = Field(0.02, gt=0, le=1.0)
    """Std of the normal init of linear and embedding weights."""
    # MoE (Qwen3-MoE); num_experts == 0 means a dense Qwen3 model.
    num_experts: int = Field(0, ge=0, le=4096)
    """Routed experts per MoE layer; 0 builds a dense model."""
    num_experts_per_tok: int = Field(2, ge=1, le=64)
    """Top-k experts each token is routed to."""
    moe_intermediate_size: int = Field(128, ge=8, le=262_144)
    """Hidden width of one expert's SwiGLU."""
    norm_topk_prob: bool = True
    """Renormalize the top-k router probabilities to sum to one."""
    decoder_sparse_step: int = Field(1, ge=1, le=512)
    """Layer i is MoE when (i + 1) % decoder_sparse_step == 0 (and not in mlp_only_layers)."""
    mlp_only_layers: list[int] = Field(default_factory=list)
    """Layers that use the dense MLP even in an MoE model."""
    router_aux_loss_coef: float = Field(0.001, ge=0)
    """Load-balancing loss weight (kept for config.json fidelity; the RL trainer may use it)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id (Qwen3 uses none)."""
    eos_token_id: int | list[int] | None = None
    """End-of-sequence token id(s)."""
    pad_token_id: int | None = None
    """Padding token id."""
    torch_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the weights are stored in."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.is_moe
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the MoE layers, in order; routing records use this order."""
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.is_moe and self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})"
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"mlp_only_layers {bad} are outside 0..{self.num_hidden_layers - 1}")
        return self


class TokenizerTrainConfig(StrictModel):
    """How the local byte-level BPE tokenizer is trained."""

    vocab_size: int = Field(4096, ge=300, le=262_144)
    """Total vocabulary including the 256 byte symbols and the special tokens."""
    corpus_documents: int = Field(4000, ge=10, le=10_000_000)
    """Documents of generated code and chat transcripts to train on."""
    seed: int = 0
    """Seed of the corpus generator."""


class SandboxConfig(StrictModel):
    """Limits and isolation of the sandbox that runs untrusted code (tests, agent commands)."""

    isolation: Literal["auto", "full", "weak"] = "auto"
    """auto: the strongest tier the machine allows; full: bubblewrap namespaces or fail; weak: uid + rlimits + seccomp."""
    wall_s: float = Field(10.0, gt=0, le=3600)
    """Wall-clock limit of one run; the whole process tree is killed when it passes."""
    cpu_s: int = Field(10, ge=1, le=3600)
    """CPU-time rlimit (RLIMIT_CPU) of one run."""
    memory_mb: int = Field(512, ge=16, le=65_536)
    """Address-space rlimit, and the cgroup memory limit where the cgroup tree is writable."""
    max_procs: int = Field(64, ge=1, le=4096)
    """Process/thread limit (RLIMIT_NPROC, and cgroup pids.max where writable)."""
    file_size_mb: int = Field(16, ge=1, le=4096)
    """Largest file a run may write (RLIMIT_FSIZE)."""
    open_files: int = Field(256, ge=16, le=65_536)
    """Open file descriptors (RLIMIT_NOFILE)."""
    workspace_mb: int = Field(64, ge=1, le=65_536)
    """Size of the tmpfs the workspace lives on."""
    output_bytes: int = Field(65_536, ge=1024, le=64 * 1024 * 1024)
    """stdout and stderr are each truncated to this many bytes (the run records that it was truncated)."""
    pool_size: int = Field(2, ge=1, le=256)
    """Warm interpreters kept ready for fast test runs."""


class AgentConfig(StrictModel):
    """The multi-turn agent loop: turn limits, token budgets and self-summarization."""

    max_turns: int = Field(50, ge=1, le=1000)
    """Assistant turns (each may hold several tool calls) before the episode is cut off."""
    max_new_tokens: int = Field(512, ge=1, le=65_536)
    """Tokens the policy may generate in one turn."""
    summary_trigger_tokens: int = Field(3072, ge=64, le=4_194_304)
    """When a segment's context passes this many tokens, the policy summarizes and the context restarts."""
    max_summary_tokens: int = Field(256, ge=8, le=65_536)
    """Tokens the policy may spend on one self-summary."""
    max_context_tokens: int = Field(4096, ge=128, le=4_194_304)
    """Hard limit of one segment (the model's window); the episode ends if even a fresh segment cannot fit."""
    max_summaries: int = Field(8, ge=0, le=1000)
    """Self-summaries allowed in one episode; 0 disables summarization."""
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    """Sampling temperature for the policy (0 is greedy)."""
    test_timeout_s: float = Field(10.0, gt=0, le=600)
    """Wall-clock limit of one run_tests call."""
    max_observation_chars: int = Field(4000, ge=100, le=1_000_000)
    """Tool outputs longer than this are truncated before the model sees them."""

    @model_validator(mode="after")
    def _check(self) -> AgentConfig:
        if self.summary_trigger_tokens >= self.max_context_tokens:
            raise ValueError("summary_trigger_tokens must be below max_context_tokens")
        return self


class EvalConfig(StrictModel):
    """`rtrl eval`: grade reference solutions or stubs, or run a policy through the agent loop, on a task folder."""

    tasks: Path | None = None
    """A task directory or a folder of them (Exercism layout)."""
    solutions: Literal["reference", "stub"] | None = None
    """Grade the tasks' own reference solutions or untouched stubs instead of a policy."""
    checkpoint: Path | None = None
    """A Hugging Face checkpoint directory whose model is run through the agent loop."""
    samples: int = Field(1, ge=1, le=1000)
    """Episodes per task; pass@k is reported for k = samples."""
    workers: int = Field(2, ge=1, le=256)
    """Tasks graded (or episodes run) concurrently."""
    include_hidden: bool = True
    """Grade with the tasks' hidden tests too, where they have them."""
    seed: int = 0
    """Seed for sampling."""
    limit: int | None = Field(None, ge=1)
    """Evaluate only the first N tasks."""
    agent: AgentConfig = Field(default_factory=AgentConfig)
    """The agent loop's limits."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """Limits of test runs and grading."""

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if self.tasks is None:
            raise ValueError("tasks: give a task directory or folder (--tasks PATH)")
        if (self.solutions is None) == (self.checkpoint is None):
            raise ValueError("give exactly one of --solutions reference|stub and --checkpoint DIR")
        return self


class ApiKey(StrictModel):
    """One bearer key and what it may do."""

    name: str = Field(min_length=1, max_length=64)
    """Who holds the key (shown in logs and metrics, never the key itself)."""
    key: str = Field(min_length=16, max_length=256)
    """The secret; clients send `Authorization: Bearer <key>`."""
    scopes: list[Literal["inference", "feedback", "admin"]] = Field(min_length=1)
    """inference: completions and models; feedback: POST /v1/feedback; admin: registry and weights."""


class ServeConfig(StrictModel):
    """`rtrl serve`: the OpenAI-compatible gateway in front of the engine."""

    checkpoint: Path | None = None
    """The Hugging Face checkpoint directory to serve (with its tokenizer)."""
    model_name: str = Field("rtrl-policy", min_length=1, max_length=128)
    """The model id clients name in requests and see in GET /v1/models."""
    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = Field(8000, ge=0, le=65535)
    """Port to bind (0 picks a free one)."""
    run_dir: Path = Path("runs/serve")
    """Where the SQLite event store (events.sqlite) lives."""
    store: str = Field("sqlite", min_length=1, max_length=4096)
    """The event store: "sqlite" (run_dir/events.sqlite, the default) or a Postgres URL such as
    postgresql://127.0.0.1:5432/test (add ?options=-csearch_path%3Dname to use an existing schema)."""
    api_keys: list[ApiKey] = Field(default_factory=list)
    """Bearer keys with scopes; requests without a valid key get 401, with a key lacking the scope 403."""
    allow_unauthenticated: bool = False
    """Serve without keys (local experiments only); refused when api_keys is non-empty."""
    max_batch: int = Field(32, ge=1, le=4096)
    """Sequences decoded together (KV-cache slots)."""
    max_seq_len: int = Field(2048, ge=16, le=4_194_304)
    """Longest prompt + completion; longer prompts get a 400."""
    max_pending: int = Field(256, ge=1, le=1_000_000)
    """Requests queued or running before new ones get 503 (backpressure)."""
    request_timeout_s: float = Field(120.0, gt=0, le=3600)
    """A completion that takes longer is aborted and answered 504."""
    default_max_tokens: int = Field(256, ge=1, le=1_000_000)
    """max_tokens when a request does not give one."""
    device: str = "cpu"
    """Torch device for the engine (cpu, cuda, cuda:1)."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Weights dtype; None keeps the checkpoint's."""
    weights: str | None = None
    """A weight store to follow (a directory of the filesystem transport, or the http(s) URL of a weights
    server): each newly published version arrives as a verified lossless delta and is hot-swapped in."""
    weights_poll_s: float = Field(2.0, gt=0, le=3600)
    """How often the gateway checks the weight store for a new version."""

    @field_validator("store")
    @classmethod
    def _store(cls, v: str) -> str:
        if v == "sqlite":
            return v
        example = "postgresql://127.0.0.1:5432/test"
        try:
            url = urllib.parse.urlsplit(v)
            url.port  # noqa: B018 (parses the port: a bad one raises ValueError)
        except ValueError as e:
            raise ValueError(f'store: not a valid URL ({e}); give "sqlite" or a URL like {example}') from None
        if url.scheme not in ("postgresql", "postgres"):
            raise ValueError(f'store must be "sqlite" or a postgresql:// URL like {example}; got scheme '
                             f"{url.scheme or 'none'!r}")
        if not url.hostname and "host=" not in url.query:
            raise ValueError(f"store: the Postgres URL names no host; give one, like {example}")
        if url.path.strip("/") == "" and "dbname=" not in url.query:
            raise ValueError(f"store: the Postgres URL names no database; give one, like {example}")
        return v

    @model_validator(mode="after")
    def _check(self) -> ServeConfig:
        if self.allow_unauthenticated and self.api_keys:
            raise ValueError("allow_unauthenticated cannot be combined with api_keys")
        names = [k.name for k in self.api_keys]
        if len(set(names)) != len(names):
            raise ValueError("api_keys names must be unique")
        return self


class PretrainConfig(StrictModel):
    """`rtrl pretrain`: continued pre-training of the default base model on generated agent episodes.

    The defaults are configs/pretrain/default.toml, the default base model (a test checks they agree)."""

    run_dir: Path = Path("runs/pretrain")
    """Checkpoints (HF directories with trainer state), the corpus cache and metrics.jsonl."""
    seed: int = 0
    """Seed for tasks, corpus mix, init and batching."""
    model: ModelConfig = Field(
        default_factory=lambda: ModelConfig(num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)
    )
    """Architecture; vocab_size is set from the tokenizer."""
    tokenizer: TokenizerTrainConfig = Field(default_factory=lambda: TokenizerTrainConfig(vocab_size=4096))
    """Tokenizer training (on rendered episodes of the corpus tasks)."""
    num_tasks: int = Field(13000, ge=1, le=10_000_000)
    """Synthetic train tasks, one document each."""
    episode_fraction: float = Field(0.15, ge=0.0, le=1.0)
    """Share of the tasks run as whole scripted episodes in the sandbox (at least one when > 0); each other
    task gives a first-turn document: the prompt, then write_file of the reference or a novice variant
    (same expert_fraction), dense in supervised tokens and needing no sandbox."""
    max_difficulty: int = Field(2, ge=1, le=4)
    """Tasks cycle through difficulties 1..max_difficulty."""
    expert_fraction: float = Field(0.8, ge=0.0, le=1.0)
    """Share of first-turn documents that write the reference solution; the rest write a novice variant."""
    episode_expert_fraction: float = Field(0.3, ge=0.0, le=1.0)
    """Share of whole episodes that write the reference first. The rest write a novice variant, see the
    tests fail and (fix_rate) write the fix: a lower share puts more repairs in the corpus."""
    fix_rate: float = Field(0.8, ge=0.0, le=1.0)
    """Share of novice episodes that fix the bug after a failing test run."""
    steps: int = Field(1000, ge=1, le=10_000_000)
    """Optimizer steps."""
    batch_size: int = Field(16, ge=1, le=4096)
    """Sequences per step."""
    lr: float = Field(3e-3, gt=0, le=1.0)
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """Cosine decay floor, as a fraction of lr."""
    warmup_steps: int = Field(50, ge=0)
    """Linear warmup steps."""
    weight_decay: float = Field(0.01, ge=0.0, le=1.0)
    """AdamW weight decay (matrices only)."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    checkpoint_every: int = Field(250, ge=1)
    """Steps between checkpoints (the last step always checkpoints)."""
    log_every: int = Field(10, ge=1)
    """Steps between metric lines."""
    resume: bool = True
    """Continue from the newest checkpoint in run_dir when there is one."""
    threads: int | None = Field(None, ge=1, le=1024)
    """torch threads (None: torch's default)."""


class RLConfig(StrictModel):
    """The RL trainer: optimizer, GRPO advantages, the decoupled PPO objective, router replay, checkpoints."""

    lr: float = Field(2e-4, gt=0, le=1.0)
    """AdamW learning rate (constant after warmup)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps."""
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    """AdamW weight decay (matrices only)."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    group_size: int = Field(8, ge=2, le=1024)
    """Episodes sampled per task (one GRPO group)."""
    groups_per_step: int = Field(4, ge=1, le=100_000)
    """Groups consumed by one optimizer step."""
    leave_one_out: bool = False
    """RLOO baseline (mean of the other episodes of the group) instead of the group mean."""
    std_normalize: bool = True
    """Divide advantages by the group's reward std (GRPO)."""
    minibatches: int = Field(1, ge=1, le=1024)
    """Optimizer steps per batch; with 1 (and ppo_epochs 1) the proximal policy is the current one."""
    ppo_epochs: int = Field(1, ge=1, le=64)
    """Passes over each batch."""
    clip_low: float = Field(0.2, ge=0.0, le=1.0)
    """PPO ratio lower clip (1 - clip_low)."""
    clip_high: float = Field(0.28, ge=0.0, le=10.0)
    """PPO ratio upper clip (1 + clip_high; higher than clip_low as in DAPO)."""
    tis_cap: float = Field(2.0, ge=1.0)
    """Truncated importance sampling: behaviour->proximal weights are capped here."""
    icepop_low: float = Field(0.5, gt=0.0, le=1.0)
    """IcePop: tokens whose behaviour->proximal ratio is below this are masked out."""
    icepop_high: float = Field(2.0, ge=1.0)
    """IcePop: tokens whose behaviour->proximal ratio is above this are masked out."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of k3 KL to the reference (initial) policy; 0 skips the reference forward."""
    router_replay: bool = True
    """R3: the trainer's forward uses the routing the engine recorded for each token (MoE models)."""
    micro_batch_tokens: int = Field(8192, ge=64)
    """Padded tokens per forward/backward micro-batch (gradients accumulate over micro-batches)."""
    malformed_penalty: float = Field(0.0, ge=0.0, le=10.0)
    """Subtracted from an episode's reward per malformed tool call."""


class RolloutConfig(StrictModel):
    """Rollout workers: engines driving agent episodes on synthetic tasks in sandboxes."""

    backend: Literal["local", "ray"] = "local"
    """local: worker processes on this machine; ray: Ray actors (weights and trajectories via the object store)."""
    workers: int = Field(1, ge=1, le=4096)
    """Rollout worker processes (or actors), each with its own engine and sandbox pool."""
    episodes_in_flight: int = Field(16, ge=1, le=4096)
    """Episodes each worker runs concurrently (they share the worker's engine batch)."""
    threads_per_worker: int = Field(1, ge=1, le=256)
    """torch threads in each worker."""
    max_difficulty: int = Field(2, ge=1, le=4)
    """Train tasks cycle through difficulties 1..max_difficulty."""
    task_seed: int = 0
    """Seed of the synthetic task generator (the pre-training recipe's seed)."""
    first_task: int = Field(100_000, ge=0)
    """Index of the first train task used for RL (past those pre-training saw; wraps at a difficulty's pool size)."""
    temperature: float = Field(1.0, gt=0.0, le=10.0)
    """Sampling temperature of rollouts."""
    tool_latency_s: float = Field(0.0, ge=0.0, le=600.0)
    """Simulated extra latency of each tool turn (to study overlap), on top of the real sandbox runs."""
    agent: AgentConfig = Field(default_factory=lambda: AgentConfig(max_turns=6, max_new_tokens=256,
                                                                  summary_trigger_tokens=1536, max_context_tokens=2048))
    """The agent loop's limits."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """Limits of test runs and grading."""
    timeout_s: float = Field(600.0, gt=0)
    """A worker that returns nothing for this long is an error (never a silent hang)."""
    weights_dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype the trainer publishes its weights in. float32: the workers sample from exactly the
    trainer's weights (the delta is ~2-3x smaller than the weights: most fp32 elements move every step).
    bfloat16: what a bf16 inference fleet receives, ~16x smaller at lr 5e-5 and ~150-250x at ~1% changed
    (benchmarks/BENCHMARKS.md, delta on real RL steps); the workers then sample from the bf16-rounded
    weights and the decoupled objective corrects for the difference (mismatch_k3 shows it)."""


class TrainConfig(StrictModel):
    """`rtrl train`: asynchronous RL on sandboxed synthetic coding tasks, from a base checkpoint."""

    run_dir: Path = Path("runs/train")
    """Checkpoints, the trajectory log and metrics.jsonl; a rerun resumes from here."""
    base_checkpoint: Path | None = None
    """The model to start from (an HF directory); None builds (or reuses) the default base model."""
    seed: int = 0
    """Seed for sampling and task order."""
    steps: int = Field(50, ge=1, le=10_000_000)
    """Optimizer steps (policy versions) to train."""
    max_minutes: float | None = Field(None, gt=0)
    """Stop after this many minutes even if steps remain."""
    max_staleness: int = Field(2, ge=0, le=1000)
    """Oldest token of a trajectory may be this many versions behind the trainer; 0 is synchronous on-policy."""
    threads: int = Field(1, ge=1, le=1024)
    """torch threads of the trainer."""
    rl: RLConfig = Field(default_factory=RLConfig)
    """The trainer."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """The rollout workers."""
    checkpoint_keep: int = Field(2, ge=1, le=1000)
    """Checkpoints kept on disk (older ones are deleted after a newer one is durable)."""


class DemoConfig(StrictModel):
    """`rtrl demo`: the most complete end-to-end job the code can run today, on a laptop-sized budget."""

    run_dir: Path = Path("runs/demo")
    """Where tasks, the corpus, checkpoints and metrics are written."""
    seed: int = 0
    """Seed for tasks, weights, corpus and sampling."""
    train_tasks: int = Field(120, ge=4, le=1_000_000)
    """Synthetic train tasks whose scripted episodes make the pre-training corpus."""
    eval_tasks: int = Field(6, ge=1, le=10_000)
    """Held-out synthetic tasks the model then attempts through the engine and the agent loop."""
    pretrain_steps: int = Field(60, ge=1, le=1_000_000)
    """Pre-training steps (a smoke-sized run; `rtrl pretrain` builds the real base model)."""
    tokenizer: TokenizerTrainConfig = Field(default_factory=lambda: TokenizerTrainConfig(vocab_size=2048))
    """Tokenizer training."""
    model: ModelConfig = Field(default_factory=lambda: ModelConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, tie_word_embeddings=False))
    """Architecture of the demo model (MoE, to exercise router replay)."""
    max_turns: int = Field(4, ge=1, le=50)
    """Agent turns per held-out episode."""
    max_new_tokens: int = Field(160, ge=1, le=4096)
    """Tokens the policy may generate per turn."""
    rl_steps: int = Field(2, ge=1, le=1000)
    """Asynchronous RL steps after pre-training (a smoke-sized run; `rtrl train` runs the real thing)."""


T = TypeVar("T", bound=BaseModel)

# Which root each recipe folder under configs/ holds; a test parses every recipe with it.
RECIPE_ROOTS: dict[str, type[BaseModel]] = {
    "model": ModelConfig,
    "demo": DemoConfig,
    "sandbox": SandboxConfig,
    "eval": EvalConfig,
    "serve": ServeConfig,
    "pretrain": PretrainConfig,
    "train": TrainConfig,
}


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` strings to a nested dict (in place) and return it."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects key=value, got {item!r}")
        *parents, leaf = key.strip().split(".")
        node = data
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"--set {key}: {part!r} is a value, not a table")
            node = child
        node[leaf] = _parse_value(raw.strip())
    return data


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Build `cls` from a TOML recipe (or defaults) plus `--set` overrides; raises ValueError on bad input."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file not found: {path}")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: invalid TOML: {e}") from None
    apply_overrides(data, overrides or [])
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        where = f"{path}: " if path is not None else ""
        raise ValueError(where + format_validation_error(e)) from None


def format_validation_error(e: ValidationError) -> str:
    """One line per problem, joined: `model.num_experts: Input should be greater than or equal to 0`."""
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}" for err in e.errors()
    )
