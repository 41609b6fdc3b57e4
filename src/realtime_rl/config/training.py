"""`rtrl pretrain` and `rtrl train`: continued pre-training, the RL trainer and the rollout workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from realtime_rl.config.base import StrictModel
from realtime_rl.config.components import AgentConfig, ModelConfig, SandboxConfig, TokenizerTrainConfig

DEVICE_PATTERN = r"^(cpu|cuda(:[0-9]+)?)$"
"""A torch device the trainer and the rollout engines accept."""


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
    difficulty_weights: tuple[int, ...] | None = (1, 7)
    """Documents per difficulty in each cycle, one weight per difficulty 1..max_difficulty. None: one of each,
    in turn. The default, (1, 7), makes one document in eight a difficulty-1 task: with one in two, held-out
    one-stage tasks get a trained one-stage task's step (benchmarks/BENCHMARKS.md, learn, "Fewer difficulty-1
    documents": held-out pass@1 0.36 against 0.25, three seeds each). It is for max_difficulty 2; left unset,
    another max_difficulty takes None."""
    reserve_structures: bool = False
    """Leave the reserved train structures (synthetic_index.RESERVED_FRACTION of them) out of the corpus, so
    that RL with `rollout.split = "reserved"` practises on structures the base never saw, as held-out ones.
    Where a difficulty's other tasks run out, the corpus cycles through them: difficulty 1 keeps 5,256 of its 6,912
    tasks (the default recipe's 1,625 difficulty-1 documents fit; round robin's 6,500 would repeat ~1,250)."""
    exclude_heldout_parts: bool = False
    """Leave out the train structures that hold a held-out structure as consecutive stages (difficulty 3 and up:
    90 of the 91 held-out two-stage structures are two stages of some train three-stage one), so that a corpus
    with max_difficulty 3 does not show the model held-out pairs (benchmarks/BENCHMARKS.md, pretrain, "Weight
    decay 0.1, and three-stage documents": such a corpus lifted held-out two-stage tasks by that exposure)."""
    expert_fraction: float = Field(0.8, ge=0.0, le=1.0)
    """Share of first-turn documents that write the reference solution; the rest write a novice variant."""
    episode_expert_fraction: float = Field(0.3, ge=0.0, le=1.0)
    """Share of whole episodes that write the reference first. The rest write a novice variant, see the
    tests fail and (fix_rate) write the fix: a lower share puts more repairs in the corpus."""
    fix_rate: float = Field(0.8, ge=0.0, le=1.0)
    """Share of novice episodes that fix the bug after a failing test run."""
    question_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Share of first-turn documents that ask the user a clarifying question (ask_user) instead of writing:
    the base policy then asks sometimes, as agents do, and a naive reward can learn to ask instead of act."""
    followup_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Share of the first-turn documents' tasks that also get a follow-up document: the second turn after a
    failed edit or a clarifying question, as served users ask for it (train/corpus.py)."""
    steps: int = Field(1250, ge=1, le=10_000_000)
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
    """torch threads per process (None: the CPUs this process may use, shared among `processes`)."""
    processes: int | None = Field(None, ge=1, le=64)
    """Data-parallel processes: each computes the gradient of its share of a step's documents and they sum
    them (gloo all-reduce) before every process takes the same optimizer step. The weights differ from one
    process's only in the order of float sums. None: one per CPU, at most MAX_AUTO_PROCESSES and batch_size."""

    @model_validator(mode="before")
    @classmethod
    def _default_weights_fit_max_difficulty(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "difficulty_weights" in data:
            return data
        try:
            max_difficulty = int(data.get("max_difficulty", 2))
        except (TypeError, ValueError):
            return data  # the field's own validation says what is wrong
        fits = max_difficulty == len(cls.model_fields["difficulty_weights"].default)
        return data if fits else {**data, "difficulty_weights": None}

    @model_validator(mode="after")
    def _weights_per_difficulty(self) -> PretrainConfig:
        weights = self.difficulty_weights
        if weights is not None and (len(weights) != self.max_difficulty or min(weights) < 0
                                    or not any(weights)):
            raise ValueError(f"difficulty_weights {list(weights)}: give one non-negative count per "
                             f"difficulty 1..max_difficulty ({self.max_difficulty}), not all 0")
        return self


class RLConfig(StrictModel):
    """The RL trainer: optimizer, GRPO advantages, the decoupled PPO objective, router replay, checkpoints."""

    lr: float = Field(2e-4, gt=0, le=1.0)
    """AdamW learning rate (after warmup; constant unless lr_decay_steps is set)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps."""
    lr_decay_steps: int | None = Field(None, ge=1)
    """Cosine decay of the rate from lr to lr * min_lr_ratio over this many steps after warmup (held there
    after), counted in policy versions, so a resumed run continues the schedule; None: constant."""
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """The floor of the cosine decay, as a fraction of lr."""
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
    pass_at_k: int = Field(1, ge=1, le=1024)
    """Above 1: advantages for the best of k episodes of a group (pass@k training, train/losses.py
    pass_at_k_advantages), what an agent loop with k fresh attempts is graded on; 1: each episode's own reward."""
    loss_aggregation: Literal["token", "episode"] = "token"
    """token: every generated token of a step weighs the same (DAPO). episode: every episode weighs the
    same, its advantage rescaled by mean length / its length (verl's seq-mean-token-mean), so long failed
    episodes do not outweigh short passes on the tokens they share (train/losses.py length_normalized)."""
    negative_weight: float = Field(1.0, ge=0.0, le=1.0)
    """Scale of negative advantages (episodes worse than their baseline). 1: the plain policy gradient. Below
    1 the step leans on what worked: 0 learns only from better-than-baseline episodes (filtered behaviour
    cloning, as RAFT and ReST). On a peaked policy trained on few episodes, full-weight negatives push
    probability onto arbitrary tokens and entropy blows up (benchmarks/BENCHMARKS.md, "loop")."""
    minibatches: int = Field(1, ge=1, le=1024)
    """Optimizer steps per batch; with 1 (and ppo_epochs 1) the proximal policy is the current one."""
    ppo_epochs: int = Field(1, ge=1, le=64)
    """Passes over each batch."""
    clip_low: float = Field(0.2, ge=0.0, le=1.0)
    """PPO ratio lower clip (1 - clip_low)."""
    clip_high: float = Field(0.28, ge=0.0, le=10.0)
    """PPO ratio upper clip (1 + clip_high; higher than clip_low as in DAPO)."""
    dual_clip: float | None = Field(3.0, gt=1.0)
    """Dual clip (verl's clip_ratio_c): a negative advantage's term is bounded below at dual_clip x A, so a ratio
    that ran far past the band (later minibatches or epochs) cannot push one token without limit. None: off."""
    tis_cap: float = Field(2.0, ge=1.0)
    """Truncated importance sampling: behaviour->proximal weights are capped here. At or above icepop_high (the
    defaults: both 2.0) it truncates nothing: IcePop masks every token it would truncate."""
    icepop_low: float = Field(0.5, gt=0.0, le=1.0)
    """IcePop: tokens whose behaviour->proximal ratio is below this are masked out."""
    icepop_high: float = Field(2.0, ge=1.0)
    """IcePop: tokens whose behaviour->proximal ratio is above this are masked out."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the KL term to the reference (initial) policy; 0 skips the reference forward."""
    kl_estimator: Literal["k3", "k2"] = "k3"
    """The KL term's per-token function of d = ref - new (train/losses.py): at each position, given the sampled
    context, k3 = exp(d) - 1 - d descends KL(ref || policy) in expectation (GRPO's, verl's low_var_kl) and
    k2 = d^2 / 2 descends KL(policy || ref). The logged train/kl_ref is k3's value, an estimate of
    KL(policy || ref), with either."""
    entropy_coef: float = Field(0.0, ge=-1.0, le=1.0)
    """Weight of the policy's mean token entropy in the objective (verl's entropy_coeff): positive keeps
    exploring, negative sharpens the policy toward its own most likely choices (entropy minimisation). When
    non-zero every generated token of the step carries it, groups without reward signal included."""
    router_replay: bool = True
    """R3: the trainer's forward uses the routing the engine recorded for each token (MoE models)."""
    micro_batch_tokens: int | None = Field(None, ge=64)
    """Input positions a forward/backward micro-batch may hold, its shared prefix once and its rows padded
    (gradients accumulate over micro-batches); the memory knob. Unset: 8192 on CPU, 65536 on a GPU, where a
    small model's step is bound by its forward calls (train/rl.py)."""
    shared_run_min_tokens: int | None = Field(None, ge=1)
    """Leading inputs adjacent rows (a GRPO group's) must share beyond their micro-batch's prefix for the
    forward to compute them once for the run, at the cost of one more forward call per run. Unset: 16 on CPU,
    where positions cost more than calls; on a GPU, never (train/rl.py)."""
    call_overhead_tokens: int | None = Field(None, ge=0)
    """What one more forward call is taken to cost, in padded positions: a run's rows (a GRPO group's replies)
    are sorted by length and cut into calls that share the run's prompt where that saves more padding. Unset:
    150 on CPU; on a GPU, never cut (train/rl.py)."""
    malformed_penalty: float = Field(0.0, ge=0.0, le=10.0)
    """Subtracted from an episode's reward per malformed tool call."""
    partial_credit: float = Field(0.0, ge=0.0, lt=1.0)
    """A failed episode's reward for the tests it passed: partial_credit x passed / (passed + failed + errors) of
    the grading run (hidden tests included), below a pass's 1 however many pass. 0: pass or fail only. 0.5
    against the recipe's 0 on one base: held-out 0.682 against 0.702 (BENCHMARKS.md, learn, "Partial credit")."""
    device: str = Field("cpu", pattern=DEVICE_PATTERN)
    """Where the trainer's weights, AdamW state and forward/backward live: cpu, cuda or cuda:N."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The forward/backward's compute dtype. float32: exact. bfloat16: mixed precision, as FSDP's and verl's
    default: matmuls and attention run in bf16 under autocast over fp32 weights, gradients and AdamW state;
    the LM head's log-softmax, the loss and the optimizer step stay fp32 (train/rl.py)."""

    @model_validator(mode="after")
    def _one_baseline(self) -> RLConfig:
        if self.pass_at_k > 1 and self.leave_one_out:
            raise ValueError("pass_at_k > 1 has its own baseline (the expected best of k); leave_one_out must be false")
        return self


class RolloutConfig(StrictModel):
    """Rollout workers: engines driving agent episodes on synthetic tasks in sandboxes."""

    backend: Literal["local", "ray"] = "local"
    """local: worker processes on this machine; ray: Ray actors (weights and trajectories via the object store)."""
    workers: int = Field(1, ge=1, le=4096)
    """Rollout worker processes (or actors), each with its own engine and sandbox pool."""
    episodes_in_flight: int = Field(16, ge=1, le=4096)
    """Episodes each worker runs concurrently (they share the worker's engine batch)."""
    queued_groups: int = Field(0, ge=0, le=4096)
    """Groups each worker holds beyond those its episodes in flight run at once: their episodes start as
    episodes of earlier groups finish, so a group's last long episodes do not leave the engine's batch
    nearly empty. Within the staleness bound (admission still asks StalenessBuffer.may_start)."""
    shards_per_group: int | None = Field(None, ge=1, le=4096)
    """Workers one group's episodes are spread over (each shard shares its own prompt prefill). None: as many
    as keep every worker busy when the groups that may be in flight ((max_staleness + 1) x groups_per_step)
    are fewer than the workers (a synchronous run of 4 groups a step on 12 workers: 3 each), else 1."""
    threads_per_worker: int = Field(1, ge=1, le=256)
    """torch threads in each worker."""
    max_difficulty: int = Field(2, ge=1, le=4)
    """Train tasks cycle through difficulties min_difficulty..max_difficulty."""
    min_difficulty: int = Field(1, ge=1, le=4)
    """The easiest difficulty of train tasks (> 1 trains on longer programs only: with the default base,
    structures pre-training never generated start at difficulty 3)."""
    split: Literal["train", "reserved"] = "train"
    """Which train tasks RL draws: all train structures, or only the reserved ones (synthetic_index), which a
    base built with `reserve_structures = true` never saw."""
    task_seed: int = 0
    """Seed of the synthetic task generator (the pre-training recipe's seed)."""
    first_task: int = Field(100_000, ge=0)
    """Index of the first train task used for RL (past those pre-training saw; wraps at a difficulty's pool size).
    With split "reserved" it indexes the reserved tasks (1,656 of difficulty 1: RL starts at 640 and reaches the
    reserved tasks `rtrl bench learn` evaluates, 0-99, after ~1,000 difficulty-1 groups)."""
    task_mix: Literal["index", "input_types"] = "index"
    """How each difficulty's groups walk its tasks. "index": indices first_task, first_task + 1, ... of the
    index space, which deals the input types (integer lists, naturals, text) in turn only until its smallest pool
    runs out: past index 100,000 difficulty 2 is integer lists alone. "input_types": the input types in turn, the
    k-th task of each from place first_task // 3 of its own pool (wrapping): held-out pass@1 0.675 against the
    recipe's 0.712 on one base (BENCHMARKS.md, learn, "Input types in turn"), so not the recipe."""
    temperature: float = Field(1.0, gt=0.0, le=10.0)
    """Sampling temperature of rollouts."""
    tool_latency_s: float = Field(0.0, ge=0.0, le=600.0)
    """Simulated extra latency of each tool turn (to study overlap), on top of the real sandbox runs."""
    agent: AgentConfig = Field(default_factory=lambda: AgentConfig(max_turns=6, max_new_tokens=256,
                                                                  summary_trigger_tokens=1536, max_context_tokens=2048))
    """The agent loop's limits."""
    sandbox: SandboxConfig = Field(default_factory=lambda: SandboxConfig(test_runner="light"))
    """Limits of test runs and grading; grading runs the light runner (pytest where it falls back)."""
    timeout_s: float = Field(600.0, gt=0)
    """A worker that returns nothing for this long is an error (never a silent hang)."""
    prefix_max_age: int | None = Field(None, ge=0)
    """After a weight swap, an episode's next turn reuses keys/values computed by weights up to this many
    versions old (engine prefix caching, as PipelineRL's in-flight updates) instead of re-prefilling its
    context; the decoupled objective corrects the difference. None: the run's max_staleness (0, synchronous:
    never reused across versions). At most max_staleness."""
    compile_decode: bool = False
    """Run each worker engine's decode step through torch.compile (engine/engine.py), compiled at worker
    start-up (~10 s with inductor's on-disk cache, ~1 min without). 1.1-2.5x the eager decode tokens/s
    on CPU at short contexts (`rtrl bench engine`), none at agent-episode lengths (docs/serving.md)."""
    cascade_decode: bool = True
    """Decode steps read the prompt keys/values a GRPO group's episodes hold as copies of one prefill once for
    the group (cascade attention, docs/model.md), where that costs less; eager decode only. False: every row
    reads its own copy (same tokens and logprobs; for comparison)."""
    prefill_wait_ms: float = Field(0.0, ge=0.0, le=1000.0)
    """While an engine decodes, a new turn waits up to this long to be prefilled with the turns arriving after it
    (engine/engine.py): on a GPU a prefill costs its launches whatever its rows. 0: each step prefills what
    has arrived."""
    cuda_graphs: bool = True
    """On a CUDA device, replay each engine's decode step from CUDA graphs (engine/graphs.py; unless
    compile_decode). False: the eager step, as on a CPU (for comparison)."""
    device: str = Field("cpu", pattern=DEVICE_PATTERN)
    """Where each worker's engine runs: cpu, cuda or cuda:N (workers on one GPU share it)."""
    gpus_per_worker: float = Field(1.0, gt=0, le=64)
    """With backend ray and device cuda: the GPUs each actor reserves. Ray sets the actor's CUDA_VISIBLE_DEVICES
    to them (so the actor names its GPU `cuda`); a fraction packs several workers on one GPU (0.25: four)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The engine's weights and KV cache: float32, or bfloat16 (a GPU's inference precision; the decoupled
    objective corrects the difference from the trainer's recomputation, and router replay keeps its experts)."""
    weights_dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype the trainer publishes its weights in. float32: the workers sample from exactly the
    trainer's weights (the delta is ~2-3x smaller than the weights: most fp32 elements move every step).
    bfloat16: what a bf16 inference fleet receives, ~16x smaller at lr 5e-5 and ~150-250x at ~1% changed
    (benchmarks/BENCHMARKS.md, delta on real RL steps); the workers then sample from the bf16-rounded
    weights and the decoupled objective corrects for the difference (mismatch_k3 shows it)."""

    @model_validator(mode="after")
    def _difficulties(self) -> RolloutConfig:
        if self.min_difficulty > self.max_difficulty:
            raise ValueError(f"rollout.min_difficulty ({self.min_difficulty}) exceeds max_difficulty "
                             f"({self.max_difficulty})")
        return self

    @model_validator(mode="after")
    def _one_attempt(self) -> RolloutConfig:
        if self.agent.attempts != 1:
            raise ValueError(f"rollout.agent.attempts is {self.agent.attempts}: RL trains one-attempt "
                             "episodes (an abandoned attempt would share its episode's reward and "
                             "advantage); fresh attempts are for evaluation and serving, where each attempt "
                             "samples the trained policy")
        return self

    @model_validator(mode="after")
    def _ray_actors_name_their_gpu_cuda(self) -> RolloutConfig:
        if self.backend == "ray" and self.device not in ("cpu", "cuda"):
            raise ValueError(f"rollout.device {self.device!r} with backend ray: each actor sees only the GPUs it "
                             "reserved (rollout.gpus_per_worker), as cuda; name it 'cuda'")
        return self


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

    @model_validator(mode="after")
    def _prefix_within_staleness(self) -> TrainConfig:
        age = self.rollout.prefix_max_age
        if age is not None and age > self.max_staleness:
            raise ValueError(f"rollout.prefix_max_age ({age}) may not exceed max_staleness ({self.max_staleness}): "
                             "keys/values older than the bound would condition the tokens trained on")
        return self
