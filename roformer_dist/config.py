"""The one config tree of roformer-dist.

Frozen dataclasses, one section per component, a docstring under each field.
Resolution order: dataclass defaults <- YAML file (``configs/experiments/*.yaml``)
<- ``key.sub=value`` overrides from the command line.

In YAML a section may be given as a preset name (``model: debug`` loads
``configs/model/debug.yaml``), as a path to a YAML file, or as a mapping of
fields. A mapping may name a preset too (``model: {preset: debug, hidden_size: 96}``):
the preset is applied first, then the other keys.

Every user error raises :class:`~roformer_dist.errors.ConfigError` (a ``ValueError``) whose
message names the key and what was expected. ``validate`` checks the combinations (stages vs positions, batch vs
world size, heads vs hidden size, ...) before any process is spawned.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from data_pipeline.mixture import DEFAULT_NAME, SOURCE_NAME
from roformer_dist.errors import ConfigError

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
"""Where presets live. Overridable with ROFORMER_CONFIGS for installed copies."""
if os.environ.get("ROFORMER_CONFIGS"):
    CONFIGS_DIR = Path(os.environ["ROFORMER_CONFIGS"])
DEFAULT_RUN_DIR_MODE = "0750"
"""``run_dir_mode``'s default: no write for the group or others (runtime/rundir.py)."""

# --------------------------------------------------------------------------- choice types
# Every field with a fixed set of values is typed with one of these; the loader (``_coerce``), the
# validator and the code that dispatches on the value (model.py, rotary.py) read the values from here.

HiddenAct = Literal["gelu", "gelu_new", "relu"]
PositionEmbedding = Literal["rotary", "absolute"]
RopeScaling = Literal["none", "linear", "ntk", "yarn"]
NewRows = Literal["mean", "init"]
RotaryBackend = Literal["auto", "reference", "compiled", "triton", "apex", "flash_attn"]
AttentionKind = Literal["softmax", "linear"]
Packing = Literal["document", "cross_document"]
DocumentPositions = Literal["restart", "continue"]
OptimizerName = Literal["adamw", "lamb"]
LRSchedule = Literal["linear", "cosine", "constant"]
ZeroStage = Literal[0, 1, 2, 3]
Precision = Literal["fp32", "bf16", "fp16"]
OffloadDevice = Literal["none", "cpu"]
DistBackend = Literal["auto", "gloo", "nccl"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]


def choices(choice_type: Any) -> tuple:
    """The allowed values of a choice type, in declaration order: ``choices(AttentionKind)``."""
    return typing.get_args(choice_type)



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
    attention: AttentionKind = "softmax"
    """softmax (scaled dot-product, O(S^2)) | linear (the paper's section 3.3: feature map elu(x)+1,
    rotary on the feature maps, O(S) time and memory; see roformer_dist/nn/attention.py)."""
    document_positions: DocumentPositions = "restart"
    """Positions in rows that carry document numbers (``data.packing: document``): restart (each
    document counts from 0, as if it were alone) | continue (the row's positions). No parameters: a
    resumed run may change it."""
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
    """Fraction of non-special tokens chosen for MLM prediction."""
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
    weights: dict[str, float] = field(default_factory=dict)
    """Mixture weights of this stage by source name (``{news: 0.3, books: 0.7}``); a source not named keeps
    its data.sources weight."""
    rope_theta: Optional[float] = None
    """This stage's rotary base; None = model.rope_theta."""
    rope_scaling: Optional[RopeScaling] = None
    """This stage's rotary scaling; None = model.rope_scaling."""
    rope_scaling_factor: Optional[float] = None
    """This stage's scaling factor; None = model.rope_scaling_factor."""
    rope_original_max_position: Optional[int] = None
    """This stage's original length; None = model.rope_original_max_position."""


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
    """Decay after warmup: linear | cosine | constant."""
    min_lr_ratio: float = 0.0
    """Final LR as a fraction of lr."""
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
    compile: bool = False
    """``torch.compile`` the model once per curriculum stage (static shapes); not with pipeline stages,
    tensor parallelism or ZeRO-3."""
    compile_cache_dir: str = ""
    """Where compiled artefacts are cached across restarts ("" = run_dir/compile_cache)."""
    profile: ProfileConfig = ProfileConfig()
    """A ``torch.profiler`` window: steps [start_step, start_step + steps) of rank 0."""


@dataclass(frozen=True)
class CheckpointConfig:
    keep_last: int = 3
    """Complete checkpoints to keep (older ones are deleted)."""
    resume: bool = True
    """Resume from the newest complete, undamaged checkpoint in run_dir/checkpoints when there is one."""
    async_: bool = False
    """YAML key ``async``. The step loop goes on while a checkpoint is written: a host-memory snapshot, then
    a background writer per rank; COMPLETE and ``latest`` still follow only when every rank's files are
    durable, and a stop or the end of the run waits for the save in flight."""


@dataclass(frozen=True)
class LoggingConfig:
    tensorboard: bool = True
    """Write TensorBoard events to run_dir/tb (rank 0)."""
    level: str = "INFO"
    """Python logging level."""


@dataclass(frozen=True)
class SlurmConfig:
    partition: str = ""
    """SLURM partition ('' = cluster default)."""
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
    setup: tuple[str, ...] = ()
    """Shell lines run in the batch script before the job (e.g. module load): shell by design, one line each."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables for the job (e.g. NCCL settings). ``$NAME`` and ``${NAME}`` in a value are
    expanded by the batch shell; command substitution (``$(...)``, backticks) is refused; any other
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


# Sections that can be given as a preset name: section -> configs/<dir>/<name>.yaml
PRESET_DIRS = {
    "model": "model",
    "curriculum": "curriculum",
    "deepspeed": "deepspeed",
    "slurm": "cluster",
}

# --------------------------------------------------------------------------- building


_YAML_KEYS = {"from_": "from", "async_": "async"}
"""Fields whose YAML key is a Python keyword: field name -> the key written and read (the field name is
read too)."""
_FIELD_OF = {v: k for k, v in _YAML_KEYS.items()}


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert a YAML/CLI value to the field type ``tp`` or raise naming ``key``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if _is_dataclass_type(tp):
        return _build(tp, value, key)
    if origin is Literal:
        return _coerce_choice(value, args, key)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ValueError:
                continue
        names = " or ".join(_type_name(a) for a in args)
        raise ConfigError(f"{key}: expected {names}, got {value!r}")
    if origin is tuple:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            value = [value] if value not in (None, "") else []
        inner = args[0] if args else Any
        return tuple(_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        inner = args[1] if len(args) == 2 else str
        return {str(k): _coerce(v, inner, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str, float)):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
        if not f.is_integer():
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return int(f)
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return "" if value is None else str(value)
    return value


def _choice_error(key: str, allowed: tuple, value: Any) -> ConfigError:
    return ConfigError(f"{key}: expected one of {', '.join(map(str, allowed))}, got {value!r}")


def _coerce_choice(value: Any, allowed: tuple, key: str) -> Any:
    """A value of a choice type: converted to the choices' type (``zero_stage="2"`` -> 2), then checked."""
    kinds = {type(a) for a in allowed}
    if isinstance(value, bool) and kinds != {bool}:
        raise _choice_error(key, allowed, value)
    if len(kinds) == 1 and not isinstance(value, tuple(kinds)):
        try:
            value = _coerce(value, next(iter(kinds)), key)
        except ConfigError:
            raise _choice_error(key, allowed, value) from None
    if value not in allowed:
        raise _choice_error(key, allowed, value)
    return value


def _load_yaml(path: Path, key: str) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{key}: file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{key}: {path} must hold a mapping, got {type(data).__name__}")
    return data


def _preset_path(section: str, name: str) -> Path:
    p = Path(name)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    return CONFIGS_DIR / PRESET_DIRS[section] / f"{name}.yaml"


def _expand_preset(section: str, value: Any) -> Any:
    """``debug`` / ``path.yaml`` / ``{preset: debug, ...}`` -> a plain mapping."""
    if section not in PRESET_DIRS:
        return value
    if isinstance(value, str):
        path = _preset_path(section, value)
        if not path.exists():
            available = sorted(p.stem for p in (CONFIGS_DIR / PRESET_DIRS[section]).glob("*.yaml"))
            raise ConfigError(f"{section}: no preset {value!r} (looked for {path}); available: {available}")
        return _load_yaml(path, section)
    if isinstance(value, dict) and "preset" in value:
        rest = {k: v for k, v in value.items() if k != "preset"}
        return _merge(_expand_preset(section, value["preset"]), rest)
    return value


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _build(cls: type, data: Any, prefix: str = "") -> Any:
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    data = {(_FIELD_OF[k] if _FIELD_OF.get(k) in names else k): v for k, v in data.items()}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(
            f"unknown config key {where}{unknown[0]}"
            f" (known keys{' of ' + prefix if prefix else ''}: {', '.join(sorted(names))})"
        )
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        if cls is Config:
            value = _expand_preset(name, value)
        kwargs[name] = _coerce(value, hints[name], key)
    return cls(**kwargs)


def build(cls: type, data: Any, where: str = "", error: type[Exception] = ConfigError) -> Any:
    """A dataclass of this module from a plain mapping (a YAML file, a saved config, the model config of
    a weights file), every value checked against its field's type. The one builder of these types:
    a :class:`ConfigError` names the key; with ``where`` (a file) the error is ``error`` and names it."""
    try:
        return _build(cls, data)
    except ConfigError as e:
        if not where:
            raise
        raise error(f"{where}: {e}") from None


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        nxt = node.get(part)
        if not isinstance(nxt, dict):
            nxt = {} if nxt is None else _expand_preset(part, nxt) if node is tree else nxt
            if not isinstance(nxt, dict):
                raise ConfigError(f"{dotted}: {part} is not a section")
            node[part] = nxt
        node = nxt
    node[parts[-1]] = value


def _check_override_key(dotted: str) -> Any:
    """Fail early on a key that does not exist, naming its first unknown part; returns the key's type."""
    cls: Any = Config
    path = []
    for part in dotted.split("."):
        if not _is_dataclass_type(cls):
            raise ConfigError(f"unknown config key {dotted}: {'.'.join(path)} has no sub-keys")
        hints = typing.get_type_hints(cls)
        part = _FIELD_OF.get(part, part)
        if part not in hints:
            raise ConfigError(f"unknown config key {'.'.join(path + [part])} (in override {dotted})")
        path.append(part)
        cls = hints[part]
    return cls


def parse_overrides(items: list[str]) -> dict:
    """``["a.b=1", "c=x"]`` -> nested mapping with YAML-parsed values (a string key's value is taken as
    written: ``run_dir_mode=0770`` is not the YAML integer 504)."""
    tree: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key.sub=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        try:
            value = raw if _check_override_key(key) is str else yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key, value)
    return tree


def load_config(path: Optional[str | os.PathLike] = None, overrides: list[str] = ()) -> Config:
    """Defaults <- YAML file <- overrides, then ``validate``."""
    data: dict = {}
    if path is not None:
        data = _load_yaml(Path(path), str(path))
    data = {k: _expand_preset(k, v) for k, v in data.items()}
    if overrides:
        data = _merge(data, {k: _expand_preset(k, v) for k, v in parse_overrides(list(overrides)).items()})
    cfg = _build(Config, data)
    validate(cfg)
    return cfg


def from_dict(data: dict) -> Config:
    """A saved config (``to_dict`` output, e.g. from a checkpoint) -> validated ``Config``."""
    cfg = _build(Config, data)
    validate(cfg)
    return cfg


def to_dict(cfg: Any) -> Any:
    if dataclasses.is_dataclass(cfg):
        return {_YAML_KEYS.get(f.name, f.name): to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config atomically (temporary file, fsync, rename)."""
    from data_pipeline.atomic import atomic_write_text

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, dump_yaml(cfg))


def replace(cfg: Any, **changes: Any) -> Any:
    """``dataclasses.replace`` that accepts dotted keys: replace(cfg, **{"model.vocab_size": 8000})."""
    nested: dict[str, dict] = {}
    flat = {}
    for k, v in changes.items():
        head, _, rest = k.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = v
        else:
            flat[head] = v
    for head, sub in nested.items():
        flat[head] = replace(getattr(cfg, head), **sub)
    return dataclasses.replace(cfg, **flat)


# --------------------------------------------------------------------------- validation
# One function per section; the rules that combine sections (positions vs stages, layout vs model and
# ZeRO) live with the section they constrain: ``validate_layout`` holds every parallel-layout rule.


def _positive(value: float, key: str, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}: expected a {'non-negative' if allow_zero else 'positive'} value, got {value!r}")


def _check_choices(section: Any, prefix: str) -> None:
    """Every choice-typed field of a section holds one of its values (also for configs made with
    ``replace``, which skips the loader's coercion)."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        if typing.get_origin(hints[f.name]) is Literal:
            allowed = choices(hints[f.name])
            value = getattr(section, f.name)
            if value not in allowed or (isinstance(value, bool) and not isinstance(allowed[0], bool)):
                raise _choice_error(f"{prefix}.{f.name}", allowed, value)


def data_parallel_size(cfg: Config, world_size: Optional[int] = None) -> int:
    ws = cfg.dist.world_size if world_size is None else world_size
    return ws // (cfg.parallel.tensor * cfg.parallel.pipeline)


def micro_batch_size(cfg: Config, stage: StageConfig, world_size: Optional[int] = None) -> int:
    """Micro-batch of a stage: explicit, or the token budget divided by seq_len, made to divide the batch."""
    if stage.micro_batch_size is not None:
        return stage.micro_batch_size
    dp = max(1, data_parallel_size(cfg, world_size))
    per_rank = max(1, stage.global_batch_size // dp)
    mbs = max(1, min(per_rank, cfg.curriculum.tokens_per_micro_batch // stage.seq_len))
    while per_rank % mbs:
        mbs -= 1
    return mbs


def validate_model(m: ModelConfig) -> None:
    """The model section on its own (the model checks its config with this too)."""
    _check_choices(m, "model")
    if isinstance(m.vocab_size, str):
        if m.vocab_size != "auto":
            raise ConfigError(f"model.vocab_size: expected a positive integer or 'auto', got {m.vocab_size!r}")
    else:
        _positive(m.vocab_size, "model.vocab_size")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings", "type_vocab_size"):
        _positive(getattr(m, key), f"model.{key}")
    if m.embedding_size is not None:
        _positive(m.embedding_size, "model.embedding_size")
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model.num_attention_heads: {m.num_attention_heads} does not divide model.hidden_size {m.hidden_size}")
    if (m.hidden_size // m.num_attention_heads) % 2:
        raise ConfigError("model.num_attention_heads: head size hidden_size/heads must be even for rotary pairs")
    for key in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
        if not 0.0 <= getattr(m, key) < 1.0:
            raise ConfigError(f"model.{key}: expected a probability in [0, 1), got {getattr(m, key)}")
    validate_rope(rope_settings(m), m, "model")


ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_scaling_factor", "rope_original_max_position")
"""The rotary settings (no parameters): a model's, overridden per curriculum stage."""


def rope_settings(m: ModelConfig, stage: Optional[StageConfig] = None) -> dict[str, Any]:
    """The rotary settings in force: the model's, with a stage's own values (not None) over them."""
    out = {k: getattr(m, k) for k in ROPE_KEYS}
    if stage is not None:
        out.update({k: getattr(stage, k) for k in ROPE_KEYS if getattr(stage, k) is not None})
    return out


def validate_rope(rope: dict[str, Any], m: ModelConfig, where: str) -> None:
    """``rope`` (:func:`rope_settings`) makes sense for model ``m``; errors name ``where`` (model or a stage)."""
    theta, kind, factor, original = (rope[k] for k in ROPE_KEYS)
    if kind not in choices(RopeScaling):
        raise ConfigError(f"{where}.rope_scaling: expected one of {', '.join(choices(RopeScaling))}, got {kind!r}")
    if not (isinstance(theta, (int, float)) and math.isfinite(theta) and theta > 1.0):
        raise ConfigError(f"{where}.rope_theta: expected a number > 1, got {theta!r}")
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor >= 1.0):
        raise ConfigError(f"{where}.rope_scaling_factor: expected a number >= 1 (how many times longer), "
                          f"got {factor!r}")
    if kind == "none" and factor != 1.0:
        raise ConfigError(f"{where}.rope_scaling_factor: {factor} has no effect with rope_scaling none; choose "
                          "linear, ntk or yarn")
    if original is not None:
        _positive(original, f"{where}.rope_original_max_position")
    if kind != "none" and m.position_embedding != "rotary":
        raise ConfigError(f"{where}.rope_scaling: {kind} needs model.position_embedding rotary")


def training_sources(d: DataConfig) -> tuple[SourceConfig, ...]:
    """The training mixture: data.sources, or data.shards as one source named ``main`` (weight 1)."""
    return d.sources or ((SourceConfig(DEFAULT_NAME, d.shards, 1.0),) if d.shards else ())


def _validate_sources(cfg: Config) -> None:
    d = cfg.data
    if d.sources and d.shards:
        raise ConfigError("data.sources: give data.shards (one shard set) or data.sources (a mixture), not both")
    names = []
    for i, s in enumerate(d.sources):
        key = f"data.sources[{i}]"
        if not SOURCE_NAME.fullmatch(s.name):
            raise ConfigError(f"{key}.name: expected letters, digits, '_' or '-', got {s.name!r}")
        if s.name in names:
            raise ConfigError(f"{key}.name: {s.name!r} is given twice")
        names.append(s.name)
        if not s.shards:
            raise ConfigError(f"{key}.shards: source {s.name!r} has no shard set")
        if s.weight is None and d.size_alpha is None and len(d.sources) > 1:
            raise ConfigError(f"{key}.weight: source {s.name!r} has no weight (give each source a weight, or "
                              "data.size_alpha to weigh them by size)")
        if s.weight is not None and not 0 <= s.weight < float("inf"):
            raise ConfigError(f"{key}.weight: expected a finite number >= 0, got {s.weight!r}")
        if s.max_epochs is not None and not s.max_epochs > 0:
            raise ConfigError(f"{key}.max_epochs: expected a positive number, got {s.max_epochs!r}")
    if d.sources and sum(s.weight or 0 for s in d.sources) <= 0 and d.size_alpha is None:
        raise ConfigError("data.sources: the weights sum to 0; expected a positive sum")
    if d.size_alpha is not None and not 0 <= d.size_alpha <= 1:
        raise ConfigError(f"data.size_alpha: expected a value in [0, 1], got {d.size_alpha!r}")
    known = [s.name for s in training_sources(d)]
    for i, st in enumerate(cfg.curriculum.stages):
        for name, w in st.weights.items():
            key = f"curriculum.stages[{i}].weights.{name}"
            if name not in known:
                raise ConfigError(f"{key}: no source {name!r} (the sources are {', '.join(known) or 'none'})")
            if not 0 <= w < float("inf"):
                raise ConfigError(f"{key}: expected a finite number >= 0, got {w!r}")
    eval_names = []
    for i, e in enumerate(d.eval_sources):
        key = f"data.eval_sources[{i}]"
        if not SOURCE_NAME.fullmatch(e.name) or e.name in eval_names:
            raise ConfigError(f"{key}.name: expected a new name of letters, digits, '_' or '-', got {e.name!r}")
        if not e.shards:
            raise ConfigError(f"{key}.shards: eval source {e.name!r} has no shard set")
        if e.batches is not None:
            _positive(e.batches, f"{key}.batches")
        eval_names.append(e.name)


def _validate_data(d: DataConfig) -> None:
    _check_choices(d, "data")
    if not 0.0 < d.mlm_probability < 1.0:
        raise ConfigError(f"data.mlm_probability: expected a value in (0, 1), got {d.mlm_probability}")
    _positive(d.num_workers, "data.num_workers", allow_zero=True)
    _positive(d.url_retries, "data.url_retries")
    _positive(d.url_retry_wait_s, "data.url_retry_wait_s", allow_zero=True)
    _positive(d.url_timeout_s, "data.url_timeout_s")


def _validate_optim(o: OptimConfig) -> None:
    _check_choices(o, "optim")
    _positive(o.lr, "optim.lr")
    _positive(o.warmup_steps, "optim.warmup_steps", allow_zero=True)
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio: expected a value in [0, 1], got {o.min_lr_ratio}")


def _validate_deepspeed(d: DeepSpeedConfig) -> None:
    _check_choices(d, "deepspeed")
    if d.offload_optimizer == "cpu" and d.zero_stage == 0:
        raise ConfigError("deepspeed.offload_optimizer: cpu offload needs deepspeed.zero_stage >= 1")


def check_tensor_split(m: ModelConfig, tensor: int) -> None:
    """Tensor parallelism splits heads, the FFN and the vocabulary ``tensor`` ways: they must divide."""
    if tensor == 1:
        return
    if m.num_attention_heads % tensor:
        raise ConfigError(f"parallel.tensor: {tensor} does not divide model.num_attention_heads "
                          f"{m.num_attention_heads}")
    if m.intermediate_size % tensor:
        raise ConfigError(f"parallel.tensor: {tensor} does not divide model.intermediate_size "
                          f"{m.intermediate_size}")
    if isinstance(m.vocab_size, int) and m.vocab_size < 2 * tensor:
        raise ConfigError(f"parallel.tensor: {tensor} too large for model.vocab_size {m.vocab_size}")


def _check_compilable(cfg: Config) -> None:
    """The layouts ``trainer.compile`` does not cover."""
    if not cfg.trainer.compile:
        return
    if cfg.parallel.pipeline > 1:
        raise ConfigError("trainer.compile: pipeline stages (parallel.pipeline > 1) are not compiled; set "
                          "trainer.compile=false or parallel.pipeline=1")
    if cfg.parallel.tensor > 1:
        raise ConfigError("trainer.compile: tensor parallelism (parallel.tensor > 1) is not compiled (its "
                          "collectives inside autograd functions are not traced); set trainer.compile=false "
                          "or parallel.tensor=1")
    if cfg.deepspeed.zero_stage == 3:
        raise ConfigError("trainer.compile: ZeRO-3 (deepspeed.zero_stage=3) is not compiled (DeepSpeed's "
                          "parameter-gathering hooks are excluded from compilation: the static graph breaks); "
                          "set trainer.compile=false or deepspeed.zero_stage <= 2")


def validate_layout(cfg: Config, world_size: Optional[int] = None) -> None:
    """Every rule of the parallel layout: world size vs tensor x pipeline, ZeRO vs pipeline/tensor,
    pipeline stages vs layers, heads/FFN/vocabulary vs tensor (``parallel.topology`` relies on it)."""
    p, d, m = cfg.parallel, cfg.deepspeed, cfg.model
    _positive(p.tensor, "parallel.tensor")
    _positive(p.pipeline, "parallel.pipeline")
    ws = cfg.dist.world_size if world_size is None else world_size
    _positive(ws, "dist.world_size")
    _check_choices(cfg.dist, "dist")
    if ws % (p.tensor * p.pipeline):
        raise ConfigError(
            f"dist.world_size: {ws} is not divisible by parallel.tensor x parallel.pipeline = {p.tensor * p.pipeline}")
    _check_compilable(cfg)
    if p.pipeline > 1 and d.zero_stage > 1:
        raise ConfigError("deepspeed.zero_stage: pipeline parallelism (parallel.pipeline > 1) supports ZeRO 0 or 1 only")
    if p.pipeline > m.num_hidden_layers:
        raise ConfigError(
            f"parallel.pipeline: {p.pipeline} stages but model.num_hidden_layers is {m.num_hidden_layers}")
    check_tensor_split(m, p.tensor)
    if p.tensor > 1 and d.zero_stage == 3:
        # ZeRO-3 would partition each tensor shard again across the data ranks; its checkpoint
        # consolidation (zero_to_fp32) knows only one model-parallel rank.
        raise ConfigError("deepspeed.zero_stage: 3 is not supported with parallel.tensor > 1; use 1 or 2")


def _validate_curriculum(cfg: Config, world_size: Optional[int] = None) -> None:
    c, m = cfg.curriculum, cfg.model
    if not c.stages:
        raise ConfigError("curriculum.stages: expected at least one stage")
    _positive(c.tokens_per_micro_batch, "curriculum.tokens_per_micro_batch")
    ws = cfg.dist.world_size if world_size is None else world_size
    dp = data_parallel_size(cfg, ws)
    for i, st in enumerate(c.stages):
        key = f"curriculum.stages[{i}] ({st.name})"
        _positive(st.steps, f"{key}.steps")
        _positive(st.global_batch_size, f"{key}.global_batch_size")
        if st.seq_len <= 0 or st.seq_len % 8:
            raise ConfigError(f"{key}.seq_len: expected a positive multiple of 8, got {st.seq_len}")
        if st.seq_len > m.max_position_embeddings:
            raise ConfigError(f"{key}.seq_len: {st.seq_len} is longer than model.max_position_embeddings "
                              f"{m.max_position_embeddings}")
        for ln in st.eval_lengths:
            if ln <= 0 or ln % 8 or ln > m.max_position_embeddings:
                raise ConfigError(f"{key}.eval_lengths: {ln} must be a positive multiple of 8 <= "
                                  f"model.max_position_embeddings {m.max_position_embeddings}")
        if st.micro_batch_size is None and st.seq_len > c.tokens_per_micro_batch:
            # the derived micro-batch would be one sequence larger than the memory budget
            raise ConfigError(f"{key}.seq_len: {st.seq_len} tokens exceed curriculum.tokens_per_micro_batch "
                              f"{c.tokens_per_micro_batch}: raise the budget or set the stage's micro_batch_size")
        mbs = micro_batch_size(cfg, st, ws)
        _positive(mbs, f"{key}.micro_batch_size")
        if st.global_batch_size % (mbs * dp):
            raise ConfigError(
                f"{key}.global_batch_size: {st.global_batch_size} is not a multiple of micro_batch_size {mbs} x "
                f"data-parallel size {dp} (dist.world_size {ws} / (parallel.tensor x parallel.pipeline))")
        if st.lr is not None:
            _positive(st.lr, f"{key}.lr")
        validate_rope(rope_settings(m, st), m, key)


def _validate_init(i: InitConfig) -> None:
    _check_choices(i, "init")
    if i.load_optimizer and not i.from_:
        raise ConfigError("init.load_optimizer: true needs init.from (the checkpoint whose optimizer state to take)")


def _validate_trainer(t: TrainerConfig) -> None:
    for key in ("stop_at_step", "save_every", "eval_every"):
        _positive(getattr(t, key), f"trainer.{key}", allow_zero=True)
    _positive(t.log_every, "trainer.log_every")
    _positive(t.max_nonfinite_steps, "trainer.max_nonfinite_steps")
    _positive(t.profile.start_step, "trainer.profile.start_step", allow_zero=True)
    _positive(t.profile.steps, "trainer.profile.steps")


def _validate_checkpoint(c: CheckpointConfig) -> None:
    _positive(c.keep_last, "checkpoint.keep_last")


def _validate_logging(lg: LoggingConfig) -> None:
    if lg.level.upper() not in choices(LogLevel):
        raise _choice_error("logging.level", choices(LogLevel), lg.level)


# What the launcher writes into a batch script (launcher/profiles.py) must stay on its line and mean what
# it says: SLURM names in a safe character set, environment names that are names, no control characters.
SLURM_NAME_CHARS = "letters, digits and _ - . , (a comma separates several)"
_SLURM_NAME = re.compile(r"[A-Za-z0-9_.,-]*")
SLURM_CONSTRAINT_CHARS = "feature names (letters, digits, _ - .) and the operators & | , ! * : [ ] ( )"
_SLURM_CONSTRAINT = re.compile(r"[A-Za-z0-9_.,&|!*:\[\]()-]*")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")
"""C0 control characters and DEL: a newline or CR would start a line of its own in a shell script."""
_ENV_SUBST = re.compile(r"\$\(|`")
_ENV_BRACED = re.compile(r"\$\{([^}]*)\}?")


def check_line(value: str, key: str) -> None:
    """ConfigError naming ``key`` when ``value`` holds a control character (newline, CR, NUL, tab, ...)."""
    m = CONTROL_CHARS.search(value)
    if m:
        raise ConfigError(f"{key}: control character {m.group()!r} in {value!r}: expected one line of printable "
                          "text (it is written into the SLURM batch script)")


def _check_env_value(value: str, key: str) -> None:
    check_line(value, key)
    if _ENV_SUBST.search(value):
        raise ConfigError(f"{key}: command substitution ($(...) or backticks) in {value!r}: the batch shell expands "
                          "only $NAME and ${NAME} in slurm.env; run commands in slurm.setup, or take a value from "
                          "the submitting environment with slurm.env_from")
    for m in _ENV_BRACED.finditer(value):
        if not (m.group().endswith("}") and ENV_NAME.fullmatch(m.group(1))):
            raise ConfigError(f"{key}: {m.group()!r} in {value!r}: only $NAME and ${{NAME}} are expanded")


def _validate_slurm(s: SlurmConfig) -> None:
    for key in ("nodes", "tasks_per_node", "cpus_per_task", "time_min"):
        _positive(getattr(s, key), f"slurm.{key}")
    if s.signal_delay_s >= s.time_min * 60:
        raise ConfigError(f"slurm.signal_delay_s: {s.signal_delay_s} s is not shorter than slurm.time_min "
                          f"{s.time_min} min")
    for key in ("partition", "account", "qos", "constraint"):
        pattern, what = ((_SLURM_CONSTRAINT, SLURM_CONSTRAINT_CHARS) if key == "constraint" else
                         (_SLURM_NAME, SLURM_NAME_CHARS))
        value = getattr(s, key)
        check_line(value, f"slurm.{key}")
        if not pattern.fullmatch(value):
            raise ConfigError(f"slurm.{key}: expected {what}, got {value!r}")
    for i, line in enumerate(s.setup):
        check_line(line, f"slurm.setup[{i}]")
    for section in ("env", "env_from"):
        for name, value in getattr(s, section).items():
            if not ENV_NAME.fullmatch(name):
                raise ConfigError(f"slurm.{section}: {name!r} is not an environment variable name (expected "
                                  "letters, digits and _, not starting with a digit)")
            if section == "env":
                _check_env_value(value, f"slurm.env.{name}")
            elif not ENV_NAME.fullmatch(value):
                raise ConfigError(f"slurm.env_from.{name}: expected the name of a variable of the submitting "
                                  f"environment (letters, digits and _, not starting with a digit), got {value!r}")
    both = sorted(set(s.env) & set(s.env_from))
    if both:
        raise ConfigError(f"slurm.env_from.{both[0]}: also set in slurm.env; give it in one of them")


def parse_mode(text: str, key: str = "run_dir_mode") -> int:
    """``"0750"`` -> 0o750; the owner must keep rwx (the run writes there). ConfigError naming ``key``."""
    if not isinstance(text, str) or not re.fullmatch(r"0[0-7]{3}", text):
        raise ConfigError(f"{key}: expected an octal mode with its leading 0 such as 0750 (quoted in YAML: "
                          f"'0750'), got {text!r}")
    mode = int(text, 8)
    if mode & 0o700 != 0o700:
        raise ConfigError(f"{key}: {text} takes from the owner the rwx a run needs on its own directory")
    return mode


def validate(cfg: Config, world_size: Optional[int] = None) -> None:
    """Every section, then the layout and the curriculum at ``world_size`` (default: dist.world_size).
    Raises ConfigError naming the first bad key."""
    parse_mode(cfg.run_dir_mode)
    validate_model(cfg.model)
    _validate_data(cfg.data)
    _validate_sources(cfg)
    _validate_optim(cfg.optim)
    _validate_deepspeed(cfg.deepspeed)
    validate_layout(cfg, world_size)
    _validate_curriculum(cfg, world_size)
    _validate_init(cfg.init)
    _validate_trainer(cfg.trainer)
    _validate_checkpoint(cfg.checkpoint)
    _validate_logging(cfg.logging)
    _validate_slurm(cfg.slurm)
