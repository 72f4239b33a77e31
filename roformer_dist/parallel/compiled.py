"""``trainer.compile``: ``torch.compile`` of the model, once per curriculum stage, with static shapes.

    compiler = StageCompiler(engine.module, compile_cache_dir(cfg), cfg.trainer.compile_mode)  # sets the cache dir
    compiler.compile_stage(stage.name, seq_len, micro_batch)          # at setup and at each stage switch
    ...the stage's first training step...                              # compiles (or loads from the cache)
    compiler.first_step_done(seconds)                                  # logs what compiling took

What is compiled, and why there. A stage has a fixed (micro-batch, seq_len), so everything whose
shapes follow from them is compiled with ``dynamic=False``: ``model.stack`` (embeddings and layers),
fullgraph. Around it stays eager what has data-dependent shapes: the host-side planning of packed
documents (``layer_inputs``), the gather of the predicted rows (``select_predicted``: N rows, N from the loader's ``predicted`` index).
The head and the loss (``model.predict``) run on N predicted rows, N changing every batch: they are
compiled once per stage with N as the only dynamic size (``maybe_mark_dynamic``), not once per N.
A batch whose packed documents take the block plan (``documents.DocumentPlan``: blocks of data-dependent
shapes) or flex attention (``documents.FlexMask``; flex attention compiled on its own, as eager calls
it) runs its attention cores eagerly, and each layer's projections / FFN compiled
(``RoFormerLayer.project`` -> eager ``attend`` -> ``RoFormerLayer.finish``, one compiled graph shared by
all layers): the *split path*. A run that packs documents (``data.packing: document``,
:func:`splits_documents`) sends every training batch down the split path, a row of one document too, so that
a stage runs its attention cores, and with them the rotary kernel, one way: eagerly. The rotary backend is
measured the way it runs (:func:`rotary_runs_compiled`): compiled where the stage's batches go through the
whole compiled stack, eager where they take the split path. Evaluation (``eval()`` or no grad) calls the eager model: eval lengths differ from the
stage's, and compiling them would be a recompile per length for a few batches.

Mode (``trainer.compile_mode``): the layers' graph (``stack``) compiles in the configured mode, so that
``reduce-overhead`` replays a whole stage's forward (and AOT-autograd's backward) as CUDA graphs; the head,
with its changing number of rows, and the per-layer pieces of the split path stay in the default mode.

Numerics: inductor reorders and fuses float arithmetic, so losses equal the eager model's up to
rounding (tests/test_compile.py: relative 1e-4 over a short run). Dropout draws its masks through torch's
generator, as in eager (``fallback_random``: a dropout gives eager's mask; across a whole model the order
of the draws can differ, so a run with dropout follows the eager one only statistically). Inductor's own
random-number code is left off: on CPU it made a step with dropout slower compiled than eager.

Cache: inductor's FX-graph and AOT-autograd caches go to the cache dir (TORCHINDUCTOR_CACHE_DIR, set
in this process before its first compile), so a requeued job loads the stage's kernels instead of
recompiling them (dynamo still traces, a few seconds). Each stage starts from ``torch._dynamo.reset()``
and a recompile limit of :data:`RECOMPILE_LIMIT` per function: a stage sees at most a handful of
mask kinds (none, key padding, block-diagonal), and an unexpected shape falls back to eager after that
many instead of compiling without end.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

import torch

from roformer_dist.config import Config
from roformer_dist.nn.documents import DocumentPlan, FlexMask, flex_compiles
from roformer_dist.nn.model import rotary_kernel_of
from roformer_dist.runtime.rundir import RunDir

log = logging.getLogger(__name__)

RECOMPILE_LIMIT = 8
"""torch._dynamo's recompile limit while compiling a stage (its default, set explicitly)."""


def compile_cache_dir(cfg: Config) -> Path:
    """``trainer.compile_cache_dir``, or run_dir/compile_cache."""
    return Path(cfg.trainer.compile_cache_dir or RunDir.of(cfg).compile_cache)


def configure_inductor(path: Path) -> None:
    """Put inductor's on-disk caches (FX graphs, AOT-autograd graphs, the C++ kernels) under ``path``, and have
    compiled random ops (dropout) draw from torch's generator as eager ones do (``fallback_random``).
    Before this process's first compile: inductor reads TORCHINDUCTOR_CACHE_DIR when it first needs it."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    # inductor's own random-number code made a CPU step with dropout 0.1 slower compiled than eager (0.80x,
    # bench/step.py --compile --dropout 0.1 --threads 1); through torch's generator it is 1.01-1.08x, and a
    # dropout draws the same mask as in eager
    inductor_config.fallback_random = True


def _cache_counts() -> tuple[int, int]:
    """(hits, misses) of inductor's FX-graph cache and the AOT-autograd cache so far in this process."""
    from torch._dynamo.utils import counters

    hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
    misses = counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"]
    return hits, misses


def _layer_project(layer, hidden: torch.Tensor, kernel: Optional[str]):
    return layer.attention.project(hidden, kernel)


def _layer_finish(layer, hidden: torch.Tensor, ctx: torch.Tensor, out_weight: torch.Tensor) -> torch.Tensor:
    return layer.finish(hidden, ctx, out_weight)


def _embed(embeddings, input_ids, token_type_ids, positions) -> torch.Tensor:
    return embeddings(input_ids, token_type_ids, positions)


def splits_documents(cfg: Config) -> bool:
    """The run's training batches take the split path (see the module docstring): packed documents."""
    return cfg.data.packing == "document"


def rotary_runs_compiled(cfg: Config) -> bool:
    """The rotary kernel of a training step runs inside a compiled graph: ``trainer.compile`` without the split
    path. How ``model.rotary_backend: auto`` measures its candidates."""
    return cfg.trainer.compile and not splits_documents(cfg)


class StageCompiler:
    """Installs the compiled ``stack`` / ``predict`` on ``model`` (instance attributes over the methods;
    the model's ``forward`` calls them) and recompiles them per stage. ``model``: the engine's module, a
    ``RoFormerForMaskedLM`` (``parallel.tensor`` keeps its class)."""

    def __init__(self, model: torch.nn.Module, cache_dir: Path, mode: str = "default", split: bool = False):
        self.model, self.cache_dir, self.mode = model, cache_dir, mode
        self.split = split
        """Every training batch takes the split path (:func:`splits_documents`); else only those whose mask
        is a document plan or a flex mask."""
        configure_inductor(cache_dir)
        self.eager_stack, self.eager_predict = model.stack, model.predict
        model.stack, model.predict = self.stack, self.predict
        self._pending: Optional[tuple[str, int, int, int, int]] = None
        self._compiled: dict = {}

    def compile_stage(self, name: str, seq_len: int, micro_batch: int) -> None:
        """New compiled functions for a stage's shapes; they compile at the stage's first step. The rotary
        kernel must be chosen first (``model.set_rotary_kernel``): the traced forward only reads it."""
        if self.model.config.position_embedding == "rotary" and rotary_kernel_of(self.model) is None:
            raise RuntimeError("trainer.compile: choose the rotary kernel (model.set_rotary_kernel) before "
                               "compiling a stage")
        torch._dynamo.reset()  # the previous stage's graphs: not needed again, and not counted in the limit
        flex_compiles.reset()  # its graphs went with them: each shape family compiles (and says so) again
        torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
        static = dict(dynamic=False)
        self._compiled = {"stack": torch.compile(self.eager_stack, fullgraph=True, mode=self.mode, **static),
                          "predict": torch.compile(self.eager_predict, **static),
                          "embed": torch.compile(_embed, fullgraph=True, **static),
                          "project": torch.compile(_layer_project, fullgraph=True, **static),
                          "finish": torch.compile(_layer_finish, fullgraph=True, **static)}
        self._pending = (name, seq_len, micro_batch, *_cache_counts())

    def first_step_done(self, seconds: float) -> None:
        """After the stage's first training step (forward and backward, where the compiling happens)."""
        if self._pending is None:
            return
        name, seq_len, micro_batch, hits0, misses0 = self._pending
        self._pending = None
        hits, misses = (a - b for a, b in zip(_cache_counts(), (hits0, misses0)))
        log.info("compiled the model for stage %s (seq %d, micro-batch %d) in %.1f s (cache: %s, %d hits, "
                 "%d misses)", name, seq_len, micro_batch, seconds, self.cache_dir, hits, misses)

    # ------------------------------------------------------------------ what the model's forward calls
    def _compiling(self) -> bool:
        return bool(self._compiled) and self.model.training and torch.is_grad_enabled()

    def stack(self, input_ids, token_type_ids, mask, cos, sin, positions) -> torch.Tensor:
        if not self._compiling():
            return self.eager_stack(input_ids, token_type_ids, mask, cos, sin, positions)
        if not self.split and not isinstance(mask, (DocumentPlan, FlexMask)):
            return self._compiled["stack"](input_ids, token_type_ids, mask, cos, sin, positions)
        if self.model.gradient_checkpointing:
            return self.eager_stack(input_ids, token_type_ids, mask, cos, sin, positions)
        c = self._compiled
        hidden = c["embed"](self.model.embeddings, input_ids, token_type_ids, positions)
        for layer in self.model.layers:
            kernel = layer.attention.kernel_for(cos, hidden.device)
            qkv, out_weight = c["project"](layer, hidden, kernel)
            ctx = layer.attention.attend(qkv, mask, cos, sin, kernel)  # blocks, or flex (compiled on its own): eager
            hidden = c["finish"](layer, hidden, ctx, out_weight)
        return hidden

    def predict(self, h: torch.Tensor, target: torch.Tensor):
        if not self._compiling():
            return self.eager_predict(h, target)
        torch._dynamo.maybe_mark_dynamic(h, 0)  # N predicted rows: one graph for every N
        torch._dynamo.maybe_mark_dynamic(target, 0)
        return self._compiled["predict"](h, target)


__all__ = ["StageCompiler", "compile_cache_dir", "configure_inductor", "RECOMPILE_LIMIT", "splits_documents",
           "rotary_runs_compiled"]
