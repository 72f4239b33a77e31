"""The config tree's schema: one frozen dataclass per section, a docstring under each field.

``Config`` is the root; its sections are ``ModelConfig``, ``DataConfig`` (with ``SourceConfig`` and
``EvalSourceConfig``), ``CurriculumConfig`` (of ``StageConfig``), ``InitConfig``, ``OptimConfig``,
``DeepSpeedConfig``, ``ParallelConfig``, ``DistConfig``, ``TrainerConfig`` (with ``ProfileConfig``),
``CheckpointConfig``, ``LoggingConfig`` and ``SlurmConfig``. Every field with a fixed set of values is typed
with one of the ``Literal`` aliases below. Loading is ``load.py``, the rules ``validate.py``, values
computed from a config ``derived.py``.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from roformer_dist.errors import ConfigError

DEFAULT_RUN_DIR_MODE = "0750"
"""``run_dir_mode``'s default: no write for the group or others (runtime/rundir.py)."""

# --------------------------------------------------------------------------- choice types
# Every field with a fixed set of values is typed with one of these; the loader (``load._coerce``), the
# validator and the code that dispatches on the value (nn/model.py, nn/rotary.py) read the values from here.

HiddenAct = Literal["gelu", "gelu_new", "relu"]
PositionEmbedding = Literal["rotary", "absolute"]
RopeScaling = Literal["none", "linear", "ntk", "yarn"]
NewRows = Literal["mean", "init"]
RotaryBackend = Literal["auto", "reference", "compiled", "triton", "apex", "flash_attn"]
Packing = Literal["document", "cross_document"]
DocumentPositions = Literal["restart", "continue"]
DocumentAttention = Literal["auto", "blocks", "flex", "varlen"]
OptimizerName = Literal["adamw", "lamb"]
LRSchedule = Literal["linear", "cosine", "constant", "wsd"]
DecayShape = Literal["linear", "cosine", "1-sqrt"]
ZeroStage = Literal[0, 1, 2, 3]
Precision = Literal["fp32", "bf16", "fp16"]
OffloadDevice = Literal["none", "cpu"]
DistBackend = Literal["auto", "gloo", "nccl"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"]


def choices(choice_type: Any) -> tuple:
    """The allowed values of a choice type, in declaration order: ``choices(HiddenAct)``."""
    return typing.get_args(choice_type)


def choice_error(key: str, allowed: tuple, value: Any) -> ConfigError:
    """The one message of a value outside its choices (the loader's and the validator's)."""
    return ConfigError(f"{key}: expected one of {', '.join(map(str, allowed))}, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: Union[int, str] = "auto"
    """Vocabulary size, or ``auto`` to take it from the shard manifest."""
    embedding_size: Optional[int] = None
    """Embedding width; None = hidden_size. Otherwise a linear projection maps it to hidden_size."""
    hidden_size: int = 768
    """Width of every transformer layer."""
    num_hidden_layers: int = 12
    """Number of transformer layers."""
    num_attention_heads: int = 12
    """Attention heads per layer; must divide hidden_size, head size must be even (rotary pairs)."""
    intermediate_size: int = 3072
    """Inner width of the feed-forward block."""
    hidden_act: HiddenAct = "gelu"
    """Feed-forward activation: gelu | gelu_new (tanh approximation) | relu."""
    hidden_dropout_prob: float = 0.1
    """Dropout after embeddings, attention output and feed-forward output."""
    attention_probs_dropout_prob: float = 0.1
    """Dropout on attention probabilities (softmax attention; linear attention forms none)."""
    max_position_embeddings: int = 1536
    """Longest sequence the model accepts (sizes the rotary cache / absolute table)."""
    type_vocab_size: int = 2
    """Number of token-type (segment) ids."""
    layer_norm_eps: float = 1e-12
    """LayerNorm epsilon (post-LN BERT layers)."""
    rotary_value: bool = False
    """Also rotate the values (RoFormer's ``rotary_value``)."""
    pad_token_id: int = 0
    """Id of [PAD]; its embedding row is kept zero at init."""
    initializer_range: float = 0.02
    """Std of the normal initialiser."""
    position_embedding: PositionEmbedding = "rotary"
    """rotary (RoFormer) | absolute (the BERT baseline, learned absolute positions)."""
    rotary_backend: RotaryBackend = "auto"
    """auto | reference | compiled | triton | apex | flash_attn (see roformer_dist/nn/rotary.py)."""
    attention: str = "softmax"
    """An attention kind of ``nn/attention_kinds/`` (checked where the model is built, and by ``roformer-train``
    before anything starts): softmax (scaled dot-product, O(S^2)) | linear (the paper's section 3.3: feature
    map elu(x)+1, rotary on the feature maps, O(S) time and memory)."""
    document_positions: DocumentPositions = "restart"
    """Positions in rows that carry document numbers (``data.packing: document``): restart (each
    document counts from 0, as if it were alone) | continue (the row's positions). No parameters: a
    resumed run may change it."""
    document_attention: DocumentAttention = "auto"
    """The kernel that keeps packed documents apart (softmax attention; see roformer_dist/nn/documents.py):
    blocks (documents of similar length gathered into dense batches, or one block-diagonal mask: the CPU's
    choice) | flex (torch's flex attention with a block-sparse mask, one call per layer; trains on CUDA only)
    | varlen (flash-attn's varlen kernel, documents end to end; CUDA, half precision, flash-attn installed) |
    auto (varlen where flash-attn is installed, else flex on CUDA, blocks on CPU). No parameters: a resumed
    run may change it."""
    rope_theta: float = 10000.0
    """Rotary base: pair i turns by ``m / rope_theta**(2i/d)`` at position m (RoFormer: 10000). Raising it
    slows every rotation (ModernBERT's context extension). No parameters: a stage, a resume or a fork may
    change it (as the three rope_* keys below and, with rotary positions, max_position_embeddings)."""
    rope_scaling: RopeScaling = "none"
    """Context extension of the rotary angles: none | linear (position interpolation: positions divided by
    the factor) | ntk (NTK-aware: the base raised by ``factor**(d/(d-2))``) | yarn (YaRN: per-pair blend of
    interpolation and extrapolation by wavelength, and attention temperature ``0.1 ln(factor) + 1``)."""
    rope_scaling_factor: float = 1.0
    """How many times longer than rope_original_max_position the model should read (>= 1)."""
    rope_original_max_position: Optional[int] = None
    """The length the model was trained at before the extension (yarn's wavelength bounds); None =
    max_position_embeddings / rope_scaling_factor."""


@dataclass(frozen=True)
class SourceConfig:
    """One source of a corpus mixture (``data.sources``)."""
    name: str = ""
    """Its name (letters, digits, '_', '-'): in logs, metrics (``data/<name>/...``) and stage weights."""
    shards: str = ""
    """Its shard set (a directory or URL prefix, as data.shards)."""
    weight: Optional[float] = None
    """Its share of the training *tokens*, relative to the other sources' weights (0.5/0.3/0.2, or 5/3/2);
    None = 1, or with data.size_alpha its size^alpha. A curriculum stage may override it (``weights``)."""
    max_epochs: Optional[float] = None
    """Repetition cap: the run draws at most this many epochs of this source (the planner lowers its
    share and raises the others', with a warning; the loader never starts an epoch past it)."""


@dataclass(frozen=True)
class EvalSourceConfig:
    """One held-out set of ``data.eval_sources``."""
    name: str = ""
    """Its name: eval tags ``eval_<name>/loss_<L>``."""
    shards: str = ""
    """Its shard set (the training sources' tokenizer)."""
    batches: Optional[int] = None
    """Batches per eval length; None = data.eval_batches."""


@dataclass(frozen=True)
class DataConfig:
    shards: str = ""
    """Training shard set: a directory (manifest.json + shard-*.tar) or a URL prefix (http://, https://,
    pipe:COMMAND, file:; ``{name}`` in it is replaced by the file name, else ``/<name>`` is appended).
    Or, instead, data.sources."""
    sources: tuple[SourceConfig, ...] = ()
    """A corpus mixture instead of data.shards: ``[{name, shards, weight, max_epochs}, ...]``, weights as
    shares of training tokens, interleaved row by row in every micro-batch (data_pipeline/mixture.py)."""
    size_alpha: Optional[float] = None
    """Size smoothing of the mixture: a source's weight is multiplied by (its tokens)^alpha (1 = in
    proportion to size, 0 = the weights alone; 0.3-0.7 as multilingual encoders use). None = off."""
    eval_sources: tuple[EvalSourceConfig, ...] = ()
    """Held-out sets evaluated one by one beside data.eval_shards (``eval_<name>/loss_<L>``)."""
    eval_shards: str = ""
    """Held-out shard set (a directory or URL prefix, as data.shards); empty = no eval."""
    packing: Packing = "document"
    """document (attention and positions stay inside each packed document: block-diagonal, see
    roformer_dist/nn/documents.py) | cross_document (every token of a row attends to the whole row).
    The rows are the same either way; eval uses the same packing. A resumed run may change it."""
    num_workers: int = 1
    """DataLoader worker processes per rank (0 = load in the training process)."""
    mlm_probability: float = 0.15
    """Fraction of non-special tokens chosen for MLM prediction in training (a stage's own
    ``mlm_probability`` overrides it)."""
    eval_mlm_probability: float = 0.15
    """The masking rate of every evaluation, whatever the training rate (so that eval curves compare across
    stages and runs); the unigram baseline is scored at the same positions."""
    mask_replace: tuple[float, float, float] = (0.8, 0.1, 0.1)
    """What the chosen tokens become: shares that are [MASK], a random token and left unchanged (sum 1)."""
    whole_word_mask: bool = True
    """Mask whole words when the shards carry word-start marks (.wwm)."""
    skip_bad_shards: bool = False
    """Skip (and count, and log) a corrupt shard instead of stopping."""
    eval_batches: int = 8
    """Batches per eval length."""
    url_retries: int = 5
    """Reads of a manifest, tokenizer or shard at a URL before giving up (transient failures only:
    HTTP 5xx/408/429, connection errors, a failing pipe: command); 1 = no retry."""
    url_retry_wait_s: float = 1.0
    """Wait before the first retry of a URL; doubled before each further one (at most 30 s)."""
    url_timeout_s: float = 600.0
    """One read of a URL (curl, a pipe: command) that has not finished after this many seconds is killed
    and counts as a transient failure (retried)."""


def stage_override(key: str) -> Any:
    """A stage's own value of the run's setting ``key`` (``section.name``); None: the run's. Checked as ``key`` is,
    resolved into each stage's plan (``StagePlan.settings``), logged when a resume changes it; where it takes
    effect is the stage switch's (``loop/stage.py``): docs/architecture/changing-things.md."""
    return field(default=None, metadata={"overrides": key})


@dataclass(frozen=True)
class StageConfig:
    name: str = "stage"
    """Stage name, shown in logs and TensorBoard."""
    seq_len: int = 512
    """Packed sequence length (multiple of 8, <= model.max_position_embeddings)."""
    global_batch_size: int = 256
    """Sequences per optimizer step, over all data-parallel ranks."""
    steps: int = 1000
    """Optimizer steps in this stage."""
    micro_batch_size: Optional[int] = None
    """Sequences per rank per forward; None = curriculum.tokens_per_micro_batch // seq_len."""
    lr: Optional[float] = None
    """Peak LR of this stage (re-warmed up over warmup_steps); None = the global schedule continues."""
    warmup_steps: int = 0
    """Re-warmup steps when lr is set."""
    eval_lengths: tuple[int, ...] = ()
    """Eval sequence lengths in this stage; empty = the stage's own seq_len."""
    mlm_probability: Optional[float] = stage_override("data.mlm_probability")
    """This stage's masking rate in training; None = data.mlm_probability."""
    weights: dict[str, float] = field(default_factory=dict)
    """Mixture weights of this stage by source name (``{news: 0.3, books: 0.7}``); a source not named keeps
    its data.sources weight."""
    rope_theta: Optional[float] = stage_override("model.rope_theta")
    """This stage's rotary base; None = model.rope_theta."""
    rope_scaling: Optional[RopeScaling] = stage_override("model.rope_scaling")
    """This stage's rotary scaling; None = model.rope_scaling."""
    rope_scaling_factor: Optional[float] = stage_override("model.rope_scaling_factor")
    """This stage's scaling factor; None = model.rope_scaling_factor."""
    rope_original_max_position: Optional[int] = stage_override("model.rope_original_max_position")
    """This stage's original length; None = model.rope_original_max_position."""
    hidden_dropout_prob: Optional[float] = stage_override("model.hidden_dropout_prob")
    """This stage's dropout on the embeddings' and layers' outputs; None = model.hidden_dropout_prob."""


@dataclass(frozen=True)
class CurriculumConfig:
    stages: tuple[StageConfig, ...] = (StageConfig(),)
    """The stages, run in order."""
    tokens_per_micro_batch: int = 4096
    """Token budget of a micro-batch when a stage does not fix micro_batch_size."""


@dataclass(frozen=True)
class InitConfig:
    """Where a new run's weights come from (a warm start; a fork is one from a run of ours)."""
    from_: str = ""
    """YAML key ``from``: '' = random initialisation; else a Hugging Face repository directory
    (``RoFormerForMaskedLM``, or ``BertForMaskedLM`` with model.position_embedding: absolute), a
    roformer-dist run directory (its newest complete checkpoint), a checkpoint directory, or a weights file
    of ``roformer-convert from-hf``. Read only when the run has no checkpoint of its own: a restart resumes
    the run, never re-initialises it."""
    load_optimizer: bool = False
    """Also take the optimizer state (Adam moments) from the checkpoint: only from a checkpoint of ours with
    the same ZeRO format, tensor x pipeline layout and world size. The step counter, schedule and data
    position always start afresh."""
    new_rows: NewRows = "mean"
    """Rows of a vocabulary that grew (ids beyond the parent's vocabulary): mean (the mean of the parent's
    rows) | init (the normal initialiser, model.initializer_range)."""
    decay_steps: int = 0
    """> 0: a decay branch. init.from names a checkpoint of ours taken at its peak lr, which this run resumes
    whole (weights, optimizer, step, data position) and ends with a wsd decay of this many steps
    (optim.decay_shape); the curriculum is cut or lengthened to end there (roformer_dist/plan/decay_branch.py).
    0 = a warm start."""
    check_tokenizer: bool = True
    """Refuse a parent of ours trained on shards of another tokenizer (sha256 of its model); false when the
    new vocabulary extends the parent's with the old pieces at their old ids."""


@dataclass(frozen=True)
class OptimConfig:
    name: OptimizerName = "adamw"
    """adamw | lamb."""
    lr: float = 1e-4
    """Peak learning rate."""
    warmup_steps: int = 1000
    """Linear warmup steps from 0 to lr."""
    schedule: LRSchedule = "linear"
    """After the warmup: linear | cosine (decay over all the remaining steps) | constant | wsd (warmup-stable-
    decay: lr held until the last decay_steps steps, which decay with decay_shape)."""
    min_lr_ratio: float = 0.0
    """Final LR as a fraction of lr."""
    decay_steps: int = 0
    """wsd: the steps of the decay, at the end of the run; 0 = decay_fraction of the run's steps."""
    decay_fraction: float = 0.2
    """wsd with decay_steps 0: the decay's share of the run's steps (rounded, at least 1)."""
    decay_shape: DecayShape = "1-sqrt"
    """wsd: the decay's shape, linear | cosine | 1-sqrt (lr falls as 1 - sqrt(progress))."""
    weight_decay: float = 0.01
    """Decoupled weight decay (not on norms and biases)."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.999
    """Adam beta2."""
    eps: float = 1e-6
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0 = off."""


@dataclass(frozen=True)
class DeepSpeedConfig:
    zero_stage: ZeroStage = 2
    """ZeRO stage 0-3."""
    precision: Precision = "fp32"
    """fp32 | bf16 | fp16 (fp16 uses dynamic loss scaling)."""
    offload_optimizer: OffloadDevice = "none"
    """none | cpu."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in backward."""
    initial_loss_scale_power: int = 16
    """fp16: initial loss scale is 2**this."""
    reduce_bucket_size: int = 500_000_000
    """ZeRO 1-3: gradient elements reduced per collective (DeepSpeed's ``reduce_bucket_size``; its default).
    Smaller buckets start reducing earlier in backward (with ``overlap_comm``) at more calls' latency."""
    allgather_bucket_size: int = 500_000_000
    """ZeRO 1-2: parameter elements gathered per collective after the optimizer step (DeepSpeed's default)."""
    overlap_comm: bool = False
    """ZeRO 1-3: reduce gradient buckets on a side stream while backward goes on (DeepSpeed's
    ``overlap_comm``), at the price of a second gradient buffer. Off until measured on GPUs (docs/guides/
    parallelism.md, "ZeRO buckets")."""


@dataclass(frozen=True)
class ParallelConfig:
    tensor: int = 1
    """Tensor-parallel degree (1 = off)."""
    pipeline: int = 1
    """Pipeline-parallel degree (1 = off)."""


@dataclass(frozen=True)
class DistConfig:
    world_size: int = 1
    """Processes roformer-train starts on this machine (ignored when launched by SLURM/torchrun)."""
    backend: DistBackend = "auto"
    """auto (nccl with CUDA, else gloo) | gloo | nccl."""
    timeout_s: int = 1800
    """Collective timeout in seconds."""
    straggler_factor: float = 1.5
    """A rank whose own time (forward passes, data wait) exceeds this many times the ranks' median is slow
    (observe/stragglers.py)."""
    straggler_log_steps: int = 3
    """Log steps in a row a rank must be slow before a warning names it."""
    hang_timeout_s: float = 300.0
    """A rank that makes no progress (no step, eval batch or save) for this long ends the launch with exit
    status 76, its stacks and a report in run_dir/hang/ (runtime/heartbeat.py); 0 = off. Well under
    ``timeout_s``; longer than the slowest single save or eval batch."""
    first_step_timeout_s: float = 1200.0
    """The hang watchdog's allowance for a curriculum stage's switch and first training step where they measure
    or compile: on a GPU (the rotary kernel, ``model.rotary_backend: auto``; flex attention's kernels) and with
    ``trainer.compile`` (the stage, minutes with ``max-autotune``); elsewhere a first step is an ordinary one.
    The watchdog takes the larger of it and ``hang_timeout_s``; below ``timeout_s`` (a rank that compiled sooner
    waits for the others in a collective)."""


@dataclass(frozen=True)
class ProfileConfig:
    start_step: int = 0
    """First step traced by ``torch.profiler`` on rank 0 (0 = no profiling)."""
    steps: int = 3
    """Steps traced from start_step on; the trace goes to run_dir/profile/."""


@dataclass(frozen=True)
class TrainerConfig:
    seed: int = 1234
    """Seeds model init, data order and masking."""
    stop_at_step: int = 0
    """Stop cleanly with a checkpoint after this step (0 = run the whole curriculum)."""
    save_every: int = 1000
    """Checkpoint every N steps (0 = only at stage ends, stop and the end)."""
    eval_every: int = 1000
    """Evaluate every N steps (0 = only at stage ends)."""
    log_every: int = 10
    """Console line and TensorBoard scalars every N steps. The steps' losses are read from the device at
    log steps (and saves and stops) only: a read waits for the device, so a GPU runs ahead in between."""
    max_nonfinite_steps: int = 5
    """Stop (with a checkpoint of the last good state) when this many consecutive NaN/inf losses end the
    steps read so far: checked where the losses are read (log steps, saves, stops), so a run of non-finite
    steps that later steps recovered from before the read is counted, warned about, and not stopped for."""
    spike: SpikePolicy = "none"
    """none | skip | rollback: a step whose loss exceeds ``spike_factor`` x the median of the last
    ``spike_window`` kept steps' losses is a spike (loop/spikes.py). ``skip`` drops its update, as a non-finite
    step does; ``rollback`` reloads the newest checkpoint before it and skips the batches from there up to the
    spike (loop/callbacks/spikes.py; needs ``save_every``)."""
    spike_factor: float = 5.0
    """How many times the recent median loss makes a spike (> 1)."""
    spike_window: int = 100
    """Steps of the median, and of the ``spike_max`` count."""
    spike_max: int = 10
    """Spikes within ``spike_window`` steps that stop the run (exit 3; the last step's checkpoint saved)."""
    compile: bool = False
    """``torch.compile`` the model once per curriculum stage (static shapes); not with pipeline stages,
    tensor parallelism or ZeRO-3."""
    compile_cache_dir: str = ""
    """Where compiled artefacts are cached across restarts ("" = run_dir/compile_cache)."""
    compile_mode: CompileMode = "default"
    """``torch.compile``'s mode for the model's layers (the part with static shapes): default |
    reduce-overhead (CUDA graphs: one replay instead of a launch per kernel; CUDA only, ignored on CPU) |
    max-autotune-no-cudagraphs (inductor tries kernel configurations, a longer compile) | max-autotune (both).
    The head and loss, whose number of rows changes every batch, always compile in the default mode."""
    profile: ProfileConfig = ProfileConfig()
    """A ``torch.profiler`` window: steps [start_step, start_step + steps) of rank 0."""


@dataclass(frozen=True)
class CheckpointConfig:
    keep_last: int = 3
    """Complete checkpoints to keep (older ones are deleted)."""
    resume: bool = True
    """Resume from the newest complete, undamaged checkpoint in run_dir/checkpoints when there is one."""
    checksums: bool = True
    """Record each file's content hash (XXH3-128) in COMPLETE; resume, ``to-hf``, ``roformer-eval``, forks and
    ``roformer-convert verify`` compare it. ``false`` only where reading a save back costs too much."""
    async_: bool = False
    """YAML key ``async``. The step loop goes on while a checkpoint is written: a host-memory snapshot, then
    a background writer per rank; COMPLETE and ``latest`` still follow only when every rank's files are
    durable, and a stop or the end of the run waits for the save in flight."""


WandbMode = Literal["", "offline", "online", "disabled"]
SpikePolicy = Literal["none", "skip", "rollback"]


@dataclass(frozen=True)
class WandbSettings:
    """The ``wandb`` sink's settings; an empty value takes W&B's own environment variable, then the default."""
    mode: WandbMode = ""
    """offline (files under run_dir/wandb; ``wandb sync`` afterwards) | online | disabled; '' = ``WANDB_MODE``,
    else offline."""
    project: str = ""
    """'' = ``WANDB_PROJECT``, else roformer-dist."""
    entity: str = ""
    """'' = ``WANDB_ENTITY``, else the account's default."""


@dataclass(frozen=True)
class MlflowSettings:
    """The ``mlflow`` sink's settings; an empty value takes MLflow's own environment variable, then the default."""
    tracking_uri: str = ""
    """A server (``http(s)://``), a database or a file store; '' = ``MLFLOW_TRACKING_URI``, else a SQLite file
    in the run directory (run_dir/mlflow.db; a run directory that has a file store, run_dir/mlruns, keeps it)."""
    experiment: str = ""
    """'' = ``MLFLOW_EXPERIMENT_NAME``, else roformer-dist."""


@dataclass(frozen=True)
class LoggingConfig:
    tensorboard: bool = True
    """Write TensorBoard events to run_dir/tb (rank 0). ``false`` takes ``tensorboard`` out of the sinks in
    force (``derived.effective_sinks``): the same as leaving it out of ``sinks``."""
    level: str = "INFO"
    """Python logging level."""
    sinks: tuple[str, ...] = ("jsonl", "tensorboard")
    """Where metrics and text go: jsonl (metrics.jsonl, the run's record: always on), tensorboard, wandb
    (offline by default, under the run directory), mlflow (a SQLite file in the run directory by default), and
    any other registered sink; validated against the sink table (and the sinks' packages) at start. Without ``tensorboard`` here (or with
    ``tensorboard: false``) no TensorBoard events are written."""
    wandb: WandbSettings = WandbSettings()
    """logging.wandb.mode / project / entity."""
    mlflow: MlflowSettings = MlflowSettings()
    """logging.mlflow.tracking_uri / experiment."""


@dataclass(frozen=True)
class SlurmConfig:
    """The SLURM job of ``roformer-submit`` (``roformer-train`` ignores it). ``validate`` checks its shape;
    what may be written into a batch script (character sets, one line per value, ``$NAME`` only) is the
    launcher's rule, checked where the script is made (``launcher/slurm_settings.py``)."""
    partition: str = ""
    """SLURM partition ('' = cluster default); letters, digits and ``_ - . ,``, as account and qos."""
    account: str = ""
    """SLURM account."""
    qos: str = ""
    """SLURM QoS."""
    constraint: str = ""
    """SLURM --constraint."""
    nodes: int = 1
    """Nodes per job."""
    gpus_per_node: int = 0
    """GPUs per node (0 = CPU job)."""
    tasks_per_node: int = 1
    """Ranks per node (one per GPU on GPU clusters)."""
    cpus_per_task: int = 1
    """CPUs per rank."""
    mem_gb: int = 0
    """Memory per node in GB (0 = cluster default)."""
    time_min: int = 60
    """Time limit in minutes."""
    signal_delay_s: int = 120
    """Seconds before the time limit at which SLURM sends USR2."""
    max_num_timeout: int = 20
    """Requeues allowed after time-limit stops (submitit's count; a stop before min(0.8 x time_min,
    time_min - 10) minutes of an attempt counts as a preemption, which does not spend it)."""
    exclude: tuple[str, ...] = ()
    """SLURM nodes the job never runs on (``--exclude``): nodes known to be bad. A list that leaves the partition
    fewer nodes than ``nodes`` is refused at submission (the job could never start)."""
    max_hang_requeues: int = 3
    """Requeues after the hang watchdog ended an attempt (``dist.hang_timeout_s``); each excludes the nodes of the
    ranks that went silent. The next hang past it ends the job (``roformer-submit --wait``: exit status 77)."""
    setup: tuple[str, ...] = ()
    """Shell lines run in the batch script before the job (e.g. module load): shell by design, one line each."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables for the job (e.g. NCCL settings). ``$NAME`` and ``${NAME}`` in a value are
    expanded by the batch shell; command substitution (``$(...)``, backticks) is refused by roformer-submit; any other
    character is literal. Values are written into config.yaml, the batch script and the job's pickle:
    no secrets here, use ``env_from``."""
    env_from: dict[str, str] = field(default_factory=dict)
    """Environment variables the job takes from the environment ``roformer-submit`` runs in, by name:
    ``{WANDB_API_KEY: WANDB_API_KEY}`` (job variable: submitting variable). Only the names are written
    anywhere; the value reaches the job through the environment sbatch exports. The variable must be
    set when submitting."""


@dataclass(frozen=True)
class Config:
    run_dir: str = "runs/default"
    """Where the run lives: config.yaml, tb/, checkpoints/, logs/."""
    run_dir_mode: str = DEFAULT_RUN_DIR_MODE
    """Mode of the directories a run creates (octal); a run directory writable by the group or others
    beyond it, or owned by another user, is refused (0770: a team shares run directories)."""
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    curriculum: CurriculumConfig = CurriculumConfig()
    init: InitConfig = InitConfig()
    optim: OptimConfig = OptimConfig()
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()
    parallel: ParallelConfig = ParallelConfig()
    dist: DistConfig = DistConfig()
    trainer: TrainerConfig = TrainerConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    slurm: SlurmConfig = SlurmConfig()
