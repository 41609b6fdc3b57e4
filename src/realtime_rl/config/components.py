"""Configs of the building blocks: the model, the tokenizer, the sandbox, the agent loop, evaluation."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from realtime_rl.config.base import StrictModel


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


MAX_WALL_S = 3600.0
"""The longest wall-clock limit a sandbox run may be given (SandboxConfig.wall_s)."""


class SandboxConfig(StrictModel):
    """Limits and isolation of the sandbox that runs untrusted code (tests, agent commands)."""

    isolation: Literal["auto", "full", "weak"] = "auto"
    """auto: the strongest tier the machine allows; full: bubblewrap namespaces or fail; weak: uid + rlimits + seccomp."""
    wall_s: float = Field(10.0, gt=0, le=MAX_WALL_S)
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
    test_runner: Literal["pytest", "light"] = "pytest"
    """What a fresh sandbox's `run_tests` (grading) runs: pytest, or the light runner with pytest where it
    cannot promise pytest's counts (the same counts, ~3x less CPU)."""


TURN_SEEDS = 1000
"""Sampling seeds a seeded episode owns (environments.policies.task_seed): one per policy call."""


class AgentConfig(StrictModel):
    """The multi-turn agent loop: turn limits, token budgets, self-summarization and fresh attempts."""

    max_turns: int = Field(50, ge=1, le=1000)
    """Assistant turns (each may hold several tool calls) before the attempt (the episode, with one attempt)
    is cut off."""
    max_new_tokens: int = Field(512, ge=1, le=65_536)
    """Tokens the policy may generate in one turn."""
    summary_trigger_tokens: int = Field(3072, ge=64, le=4_194_304)
    """When a segment's context passes this many tokens, the policy summarizes and the context restarts."""
    max_summary_tokens: int = Field(256, ge=8, le=65_536)
    """Tokens the policy may spend on one self-summary."""
    max_context_tokens: int = Field(4096, ge=128, le=4_194_304)
    """Hard limit of one segment (the model's window); the episode ends if even a fresh segment cannot fit."""
    max_summaries: int = Field(8, ge=0, le=1000)
    """Self-summaries allowed in one attempt (the episode, with one attempt); 0 disables summarization."""
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    """Sampling temperature for the policy (0 is greedy)."""
    test_timeout_s: float = Field(10.0, gt=0, le=600)
    """Wall-clock limit of one run_tests call."""
    max_observation_chars: int = Field(4000, ge=100, le=1_000_000)
    """Tool outputs longer than this are truncated before the model sees them."""
    attempts: int = Field(1, ge=1, le=100)
    """Fresh attempts per episode. When a run of the visible tests fails and attempts remain, the loop drops
    the attempt's workspace and context and starts the task again from the system prompt and the task (a new
    segment, max_turns turns of its own); the episode ends with its last attempt. Every attempt sees exactly
    what a one-attempt episode sees, so a policy trained on one-attempt episodes is what each attempt samples.
    1: the agent repairs in context after a failing run."""

    @model_validator(mode="after")
    def _check(self) -> AgentConfig:
        if self.summary_trigger_tokens >= self.max_context_tokens:
            raise ValueError("summary_trigger_tokens must be below max_context_tokens")
        calls = self.attempts * (self.max_turns + self.max_summaries)
        if calls > TURN_SEEDS:
            raise ValueError(f"attempts x (max_turns + max_summaries) = {calls} policy calls per episode; "
                             f"at most {TURN_SEEDS}, the sampling seeds a seeded episode owns (more would "
                             "reuse the next episode's)")
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
