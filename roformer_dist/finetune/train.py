"""The fine-tuning loop of every task: dynamic padding, length-grouped batches, AdamW with linear warm-up
and decay, one pass over dev per epoch, TensorBoard scalars, the best model (by the task's dev scores:
accuracy then macro-F1, or entity F1) kept. What differs between the tasks is in ``tasks.py``.

Under ``torchrun`` (WORLD_SIZE > 1) each rank trains on its share of every epoch's batches inside
DistributedDataParallel and evaluates the whole dev set itself (the replicas are identical); rank 0
alone writes files and prints.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from data_pipeline.atomic import StagedDir
from roformer_dist.finetune.tasks import Encoded
from roformer_dist.hf.export import share_with_group
from roformer_dist.observe.sinks import SinkContext, open_sinks
from roformer_dist.runtime.rundir import RunDir

FINETUNE_SINKS = ("tensorboard",)
"""Where fine-tuning's curves go (``observe.sinks``): TensorBoard under ``out_dir/tb``; the epochs' records are
``results.json``."""

__all__ = ["Dist", "fit", "predict", "GROUP_BATCHES"]

GROUP_BATCHES = 50
"""Examples are sorted by length within windows of this many batches (less padding, still shuffled)."""


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def _collate(data: Encoded, idx: np.ndarray, pad_id: int, device) -> dict:
    """Pad the selected examples to their longest (B, S_max)."""
    n = max(len(data.ids[i]) for i in idx)
    ids = torch.full((len(idx), n), pad_id, dtype=torch.long)
    types = torch.zeros((len(idx), n), dtype=torch.long)
    mask = torch.zeros((len(idx), n), dtype=torch.long)
    for row, i in enumerate(idx):
        k = len(data.ids[i])
        ids[row, :k] = torch.as_tensor(data.ids[i])
        types[row, :k] = torch.as_tensor(data.type_ids[i])
        mask[row, :k] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "token_type_ids": types.to(device)}


def train_batches(data: Encoded, batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """One epoch's batches: shuffled, sorted by length within windows, batch order shuffled."""
    order = rng.permutation(len(data))
    lengths = np.fromiter((len(x) for x in data.ids), np.int64, len(data))
    window = batch_size * GROUP_BATCHES
    batches = []
    for start in range(0, len(order), window):
        chunk = order[start:start + window]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def eval_batches(data: Encoded, batch_size: int) -> list[np.ndarray]:
    order = np.argsort([len(x) for x in data.ids], kind="stable")
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


@torch.no_grad()
def predict(clf, task, data: Encoded, batch_size: int, device) -> list:
    """The task's prediction for every example of ``data``, in order."""
    clf.model.eval()
    pred: list = [None] * len(data)
    for idx in eval_batches(data, batch_size):
        logits = clf.logits(clf.model, _collate(data, idx, clf.tokenizer.pad_token_id, device))
        for i, p in zip(idx, task.predictions(logits, data, idx)):
            pred[i] = p
    return pred


def _optimizer(model, lr: float, weight_decay: float = 0.01) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr)


def fit(clf, task, train: Encoded, dev: Encoded, *, epochs: int, lr: float, batch_size: int, seed: int,
        out_dir: Path, device, dist: Dist, progress: bool, warmup: float = 0.1,
        on_epoch: Optional[Callable[[dict], None]] = None, say: Callable[[str], None] = print) -> list[dict]:
    """Train for ``epochs`` on ``task`` (tasks.SequenceTask or TokenTask); returns one record per epoch
    (train loss, the task's dev scores, seconds). The best model goes to ``out_dir/best``."""
    from tqdm import tqdm

    model = clf.model.to(device)
    wrapped = model
    if dist.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = _optimizer(model, lr)
    rng = np.random.default_rng(seed)
    per_epoch = len(train_batches(train, batch_size, np.random.default_rng(seed))) // dist.world_size
    if per_epoch == 0:
        raise ValueError(f"{len(train)} training examples make no batch per rank at world size {dist.world_size}")
    total = per_epoch * epochs
    warm = max(1, int(warmup * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else max(0.0, (total - s) / max(1, total - warm)))
    sinks = []
    if dist.main:
        shutil.rmtree(RunDir(out_dir).tb, ignore_errors=True)  # a fine-tuning run starts afresh
        sinks = open_sinks(FINETUNE_SINKS, SinkContext(out_dir))
    pad = clf.tokenizer.pad_token_id
    records, best, step = [], None, 0
    try:
        for epoch in range(1, epochs + 1):
            t0 = time.perf_counter()
            batches = train_batches(train, batch_size, rng)[: per_epoch * dist.world_size][dist.rank::dist.world_size]
            model.train()
            loss_sum = torch.zeros(2, dtype=torch.float64)  # sum of example losses, examples
            bar = tqdm(batches, desc=f"epoch {epoch}/{epochs}", unit="batch", disable=not (progress and dist.main),
                       mininterval=1.0, leave=False)
            for idx in bar:
                batch = _collate(train, idx, pad, device)
                y = task.targets(train, idx, batch["input_ids"].shape[1]).to(device)
                loss = task.loss(clf.logits(wrapped, batch), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                step += 1
                loss_sum += torch.tensor([loss.item() * len(idx), len(idx)], dtype=torch.float64)
                for sink in sinks:
                    sink.log_scalars(step, {"train/loss": loss.item(), "train/lr": sched.get_last_lr()[0]})
                bar.set_postfix_str(f"loss {loss_sum[0].item() / loss_sum[1].item():.4f}", refresh=False)
            bar.close()
            if dist.world_size > 1:
                torch.distributed.all_reduce(loss_sum)
            pred = predict(clf, task, dev, batch_size * 2, device)
            rec = {"epoch": epoch, **task.scores(pred),
                   "train_loss": loss_sum[0].item() / max(1.0, loss_sum[1].item()),
                   "seconds": round(time.perf_counter() - t0, 2)}
            records.append(rec)
            key = tuple(rec[k] for k in task.selects)
            improved = best is None or key > best
            if dist.main:
                epoch_scalars = {"dev/" + k[4:]: v for k, v in rec.items() if k.startswith("dev_") and isinstance(v, float)}
                for sink in sinks:
                    sink.log_scalars(epoch, {**epoch_scalars, "train/epoch_loss": rec["train_loss"]})
                    sink.flush()
                say(f"epoch {epoch}/{epochs}: train loss {rec['train_loss']:.4f}  {task.describe(rec)}  "
                    f"({rec['seconds']:.1f} s)" + ("  best so far" if improved and epoch > 1 else ""))
                if improved:
                    save_best(clf, out_dir)
            if improved:
                best = key
            if on_epoch is not None and dist.main:
                on_epoch(rec)
    finally:
        for sink in sinks:
            sink.close()
    return records


def save_best(clf, out_dir: Path) -> None:
    """Replace ``out_dir/best`` with the current model: built aside, then swapped into place."""
    with StagedDir(out_dir / "best") as stage:
        clf.save(stage.path)
        share_with_group(stage.path)
        stage.commit()


def default_threads(local_world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, local_world_size))
