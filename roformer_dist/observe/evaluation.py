"""Masked-LM evaluation, in training and on a saved checkpoint, with the context-free baselines beside it.

The eval batches at a length L are one fixed stream: the eval shard set read as one data-parallel
rank with no workers, ``curriculum.tokens_per_micro_batch // L`` sequences per batch, seeded by
``trainer.seed``, masked at ``data.eval_mlm_probability`` whatever the training rate (whole words and
``data.mask_replace`` as in training); the first ``data.eval_batches`` batches of it count. Data-parallel
replica r forwards batches r, r + dp, ... (every replica runs the same number of forwards, as
ZeRO-3 and pipeline stages need; a replica without a batch left in the last round forwards one and
discards it), so the numbers do not depend on the world size, and ``roformer-eval`` on one process
reproduces the trainer's eval of the same checkpoint.

Beside the model's loss and accuracy, every length reports the unigram model's cross-entropy and
the most-frequent-token accuracy at the same predicted positions (:mod:`roformer_dist.observe.baselines`),
computed once per length and kept for later evals:

    eval/loss_<L>  eval/mlm_acc_<L>  eval/unigram_loss_<L>  eval/most_frequent_acc_<L>

and each held-out set of ``data.eval_sources`` the same under ``eval_<name>/`` (the unigram model
is the training mixture's, :func:`~roformer_dist.observe.baselines.count_mixture`).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

from roformer_dist.config import Config, RopeSettings, StageConfig, rope_settings, training_sources
from roformer_dist.nn.rotary import set_rope
from roformer_dist.observe.baselines import DEFAULT_MAX_TOKENS, BaselineSums, UnigramModel, count_mixture

log = logging.getLogger(__name__)

EvalStep = Callable[[dict], torch.Tensor]
"""batch -> float64 [loss * predicted, correct, predicted] (zero on ranks that do not report)."""


def eval_loader(cfg: Config, length: int, eval_shards: Optional[str] = None):
    """The eval stream at ``length`` (see the module docstring)."""
    from data_pipeline.loader import ShardLoader

    mbs = max(1, cfg.curriculum.tokens_per_micro_batch // length)
    return ShardLoader(eval_shards or cfg.data.eval_shards, seq_len=length, micro_batch_size=mbs, dp_rank=0,
                       dp_size=1, num_workers=0, seed=cfg.trainer.seed,
                       mlm_probability=cfg.data.eval_mlm_probability, mask_replace=cfg.data.mask_replace,
                       whole_word_mask=cfg.data.whole_word_mask, packing=cfg.data.packing)


def model_eval_step(model: torch.nn.Module, device: torch.device | str = "cpu") -> EvalStep:
    """An eval step for a plain (not distributed) :class:`RoFormerForMaskedLM`."""

    @torch.no_grad()
    def step(batch: dict) -> torch.Tensor:
        o = model(batch["input_ids"].to(device), batch["attention_mask"].to(device),
                  batch["token_type_ids"].to(device), labels=batch["labels"].to(device))
        k = int(o.num_predicted)
        return torch.tensor([float(o.loss) * k, float(o.accuracy) * k, k], dtype=torch.float64)

    return step


class Evaluator:
    """Evaluates at a list of lengths; holds the unigram model (counted once from the training shards)
    and each length's baseline sums (computed at the first eval at that length).

    ``training_shares``: source name -> share of the run's tokens, for a mixture's unigram model
    (default: the run's mixture plan); ``shared``: an Evaluator of the same run whose unigram model
    this one uses (one count for every eval set); ``batches``: batches per length (default
    ``data.eval_batches``)."""

    def __init__(self, cfg: Config, eval_shards: Optional[str] = None, max_unigram_tokens: int = DEFAULT_MAX_TOKENS,
                 training_shares: Optional[dict] = None, shared: Optional["Evaluator"] = None,
                 batches: Optional[int] = None):
        self.cfg = cfg
        self.eval_shards = eval_shards or cfg.data.eval_shards
        self.max_unigram_tokens = max_unigram_tokens
        self.training_shares, self.shared = training_shares, shared
        self.batches = batches or cfg.data.eval_batches
        self._unigram: Optional[UnigramModel] = None
        self._baselines: dict[int, BaselineSums] = {}

    @property
    def unigram(self) -> UnigramModel:
        if self.shared is not None:
            return self.shared.unigram
        if self._unigram is None:
            sources = training_sources(self.cfg.data)
            shares = self.training_shares
            if shares is None and len(sources) > 1:
                from roformer_dist.plan.data import source_manifests
                from roformer_dist.plan.mixture import plan_mixture

                shares = plan_mixture(self.cfg, source_manifests(self.cfg)).overall
            self._unigram = count_mixture({s.shards: (shares or {}).get(s.name, 1.0) for s in sources},
                                          self.max_unigram_tokens, self.cfg.trainer.seed)
            u = self._unigram
            log.info("unigram baseline: %d tokens counted in %d of %d training shards", u.num_tokens,
                     u.num_shards_counted, u.num_shards)
        return self._unigram

    def evaluate_length(self, length: int, step_fn: EvalStep, dp_rank: int = 0, dp_size: int = 1,
                        reduce: Optional[Callable[[torch.Tensor], None]] = None) -> dict:
        """Model and baselines at one length: {loss, mlm_acc, unigram_loss, most_frequent_acc, predicted}."""
        n = self.batches
        rounds = -(-n // dp_size)
        baseline = self._baselines.get(length)
        fresh = BaselineSums(self.unigram) if baseline is None else None
        sums = torch.zeros(3, dtype=torch.float64)  # loss * predicted, correct, predicted
        it = iter(eval_loader(self.cfg, length, self.eval_shards))
        for i in range(rounds * dp_size):
            batch = next(it)
            if fresh is not None and i < n:
                fresh.add(batch["labels"].numpy())
            if i % dp_size == dp_rank:
                out = step_fn(batch)
                if i < n:
                    sums += out
        if reduce is not None:
            reduce(sums)
        if fresh is not None:
            self._baselines[length] = baseline = fresh
        k = max(1.0, sums[2].item())
        return {"loss": sums[0].item() / k, "mlm_acc": sums[1].item() / k, "unigram_loss": baseline.unigram_loss,
                "most_frequent_acc": baseline.most_frequent_acc, "predicted": int(sums[2].item())}

    def evaluate_stage(self, stage: StageConfig, step_fn: EvalStep, dp_rank: int = 0, dp_size: int = 1,
                       reduce: Optional[Callable[[torch.Tensor], None]] = None, step: Optional[int] = None,
                       prefix: str = "eval") -> dict:
        """The trainer's eval: every eval length of ``stage``; TensorBoard tags as in the module docstring
        (under ``prefix``: ``eval_<name>`` for an eval source), plus ``<prefix>/loss`` and
        ``<prefix>/mlm_acc`` at the stage's own length (or its first eval length)."""
        lengths = stage.eval_lengths or (stage.seq_len,)
        out = {}
        which = "" if prefix == "eval" else f" of {prefix[len('eval_'):]}"
        for length in lengths:
            r = self.evaluate_length(length, step_fn, dp_rank, dp_size, reduce)
            for key in ("loss", "unigram_loss", "mlm_acc", "most_frequent_acc"):
                out[f"{prefix}/{key}_{length}"] = r[key]
            log.info("eval%s%s at length %d: loss %.4f, unigram %.4f (%.3f nats better), MLM accuracy %.4f "
                     "(most frequent token %.4f), %d predictions", which, f" step {step}" if step is not None else "",
                     length, r["loss"], r["unigram_loss"], r["unigram_loss"] - r["loss"], r["mlm_acc"],
                     r["most_frequent_acc"], r["predicted"])
        own = stage.seq_len if stage.seq_len in lengths else lengths[0]
        out[f"{prefix}/loss"], out[f"{prefix}/mlm_acc"] = out[f"{prefix}/loss_{own}"], out[f"{prefix}/mlm_acc_{own}"]
        return out


def evaluate_model(model: torch.nn.Module, cfg: Config, lengths: Sequence[int], evaluator: Optional[Evaluator] = None,
                   device: torch.device | str = "cpu") -> dict[int, dict]:
    """A plain model at each length (one process): length -> evaluate_length's dict."""
    evaluator = evaluator or Evaluator(cfg)
    was_training = model.training
    model.eval()
    try:
        step = model_eval_step(model, device)
        return {length: evaluator.evaluate_length(length, step) for length in lengths}
    finally:
        model.train(was_training)


def evaluate_rope_settings(model: torch.nn.Module, cfg: Config, lengths: Sequence[int], settings: Sequence[RopeSettings],
                           evaluator: Optional[Evaluator] = None, device: torch.device | str = "cpu"
                           ) -> list[dict[int, dict]]:
    """A plain rotary model under each of ``settings`` (applied with
    :func:`~roformer_dist.nn.rotary.set_rope`) at each length: one :func:`evaluate_model` result per
    settings, on the same batches (one evaluator: the baselines are computed once per length). The
    model's own settings are restored afterwards."""
    evaluator = evaluator or Evaluator(cfg)
    own = rope_settings(model.config)
    try:
        out = []
        for rope in settings:
            if not set_rope(model, rope):
                raise ValueError("evaluate_rope_settings: the model has no rotary cache (absolute positions)")
            out.append(evaluate_model(model, cfg, lengths, evaluator, device))
        return out
    finally:
        set_rope(model, own)


__all__ = ["Evaluator", "eval_loader", "model_eval_step", "evaluate_model", "evaluate_rope_settings"]
