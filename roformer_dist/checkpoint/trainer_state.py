"""What a checkpoint holds besides DeepSpeed's files: ``trainer_state_rank<r>.pt``, one per rank.

:class:`TrainerState` is the payload (format :data:`FORMAT_VERSION`): the trainer's counters, the
loader's position, the RNG streams, who wrote it (world size, rank), the resolved config, the
tokenizer's sha256 and the curriculum stage. ``to_dict`` is what ``torch.save`` writes (plain types
and tensors only, loadable with ``weights_only=True``); ``from_dict`` checks it and raises
:class:`CheckpointError` naming the file and the field for anything unreadable.

Format history: 1 = the first format (``format`` key). A payload of another version is refused
with a message naming it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, fields
from typing import Any

from roformer_dist.errors import CheckpointError

FORMAT_VERSION = 1


@dataclass
class TrainCounters:
    """The trainer's own counters; saved and restored exactly."""

    step: int = 0
    """Optimizer steps done."""
    tokens_seen: int = 0
    """Non-padding tokens consumed, all ranks."""
    samples_seen: int = 0
    """Sequences consumed, all ranks."""
    nonfinite_total: int = 0
    """Steps skipped because of a non-finite loss."""
    consecutive_nonfinite: int = 0
    """Non-finite steps in a row up to now."""
    rolled_back_steps: int = 0
    """Steps' worth of batches that loss-spike rollbacks skipped (``trainer.spike: rollback``): the batches
    drawn so far are those of ``step + rolled_back_steps`` steps."""

    def state_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def load_state_dict(self, sd: dict) -> None:
        for f in fields(self):
            newer = f.name == "rolled_back_steps" and f.name not in sd  # a checkpoint written before the field
            setattr(self, f.name, f.default if newer else int(sd[f.name]))


def rng_state() -> dict:
    """Every RNG stream this process draws from (torch, Python, NumPy, CUDA)."""
    import numpy as np  # (in the functions: the launcher imports this module, and a fresh run needs no torch)
    import torch

    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
             "python_pos": random.getstate()[2],
             "numpy": torch.from_numpy(np_state[1].astype(np.int64)), "numpy_pos": int(np_state[2])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@dataclass
class TrainerState:
    """The payload of ``trainer_state_rank<r>.pt``."""

    trainer: TrainCounters
    loader: dict
    """``ShardLoader.state_dict()`` of this rank: what it consumed."""
    rng: dict
    """:func:`rng_state` of this rank."""
    world_size: int
    """Ranks of the job that wrote it."""
    rank: int
    """The rank that wrote it."""
    config: dict
    """The resolved config (``config.to_dict``)."""
    tokenizer_sha256: str
    """sha256 of the shard set's tokenizer model."""
    stage_index: int
    """Curriculum stage of the step saved."""
    source_tokens_logged: dict = field(default_factory=dict)
    """Each mixture source's tokens at the last log step (the start of the next ``data/<name>/share``
    window); optional: after a resume from a payload without it, the first window starts at step 0."""
    eval_due: bool = False
    """The eval scheduled at this step was skipped (a stop): the launch that resumes runs it first."""
    spikes: dict = field(default_factory=dict)
    """``loop.spikes.SpikeGuard.state_dict()`` (``trainer.spike``); empty in a payload from before it."""
    format: int = field(default=FORMAT_VERSION)
    """Payload format version."""

    def to_dict(self) -> dict:
        return {"format": FORMAT_VERSION, "trainer": self.trainer.state_dict(), "loader": self.loader,
                "rng": self.rng, "world_size": self.world_size, "rank": self.rank, "config": self.config,
                "tokenizer_sha256": self.tokenizer_sha256, "stage_index": self.stage_index,
                "source_tokens_logged": dict(self.source_tokens_logged), "eval_due": self.eval_due,
                "spikes": dict(self.spikes)}

    @classmethod
    def from_dict(cls, data: Any, where: str = "trainer state") -> "TrainerState":
        """Check and convert a loaded payload; ``where`` names the file in error messages."""
        if not isinstance(data, dict):
            raise CheckpointError(f"{where}: expected a mapping, got {type(data).__name__}")
        version = data.get("format")
        if version != FORMAT_VERSION:
            raise CheckpointError(f"{where}: payload format {version!r} is not the one this version reads "
                                  f"({FORMAT_VERSION}); was it written by another roformer-dist?")
        need = {"trainer": dict, "loader": dict, "rng": dict, "world_size": int, "rank": int, "config": dict,
                "stage_index": int}
        for key, tp in need.items():
            if key not in data:
                raise CheckpointError(f"{where}: field {key!r} is missing (format {version})")
            if not isinstance(data[key], tp):
                raise CheckpointError(f"{where}: field {key!r}: expected {tp.__name__}, got "
                                      f"{type(data[key]).__name__}")
        logged = data.get("source_tokens_logged", {})
        if not isinstance(logged, dict) or not all(isinstance(k, str) and isinstance(v, (int, float))
                                                   for k, v in logged.items()):
            raise CheckpointError(f"{where}: field 'source_tokens_logged': expected a mapping of source names to "
                                  "token counts")
        if not isinstance(data.get("spikes", {}), dict):
            raise CheckpointError(f"{where}: field 'spikes': expected a mapping, got {type(data['spikes']).__name__}")
        if not isinstance(data.get("eval_due", False), bool):
            raise CheckpointError(f"{where}: field 'eval_due': expected bool, got {type(data['eval_due']).__name__}")
        counters = TrainCounters()
        try:
            counters.load_state_dict(data["trainer"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: field 'trainer': {e!r} (expected {counters.state_dict()} keys)") from None
        return cls(trainer=counters, loader=data["loader"], rng=data["rng"], world_size=data["world_size"],
                   rank=data["rank"], config=data["config"], tokenizer_sha256=str(data.get("tokenizer_sha256") or ""),
                   stage_index=data["stage_index"], source_tokens_logged={k: float(v) for k, v in logged.items()},
                   eval_due=data.get("eval_due", False), spikes=data.get("spikes", {}), format=version)

    @property
    def step(self) -> int:
        return self.trainer.step
