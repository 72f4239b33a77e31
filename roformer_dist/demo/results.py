"""What the demo shows once pretraining is done: the last evals read back from TensorBoard, the eval curves as a
PNG, and the downstream comparisons (the export fine-tuned, the same architecture from random initialisation,
a baseline without a network), each fine-tuning kept with the command line that made it."""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from data_pipeline.atomic import atomic_write_text
from roformer_dist.finetune.run import run as finetune_run
from roformer_dist.observe.plots import line_plot
from roformer_dist.runtime.events import read_scalars
from roformer_dist.runtime.rundir import RunDir


def machine() -> dict:
    """What decides the demo's figures besides the code and the seeds (docs/guides/demo.md, "Reproducibility"):
    the CPU (vendor, family and model: the math libraries pick their kernels by it), the instruction set of
    torch's own kernels (``ATEN_CPU_CAPABILITY`` lowers it), the core count (a rank takes cores / ranks threads,
    fine-tuning one per core) and the torch build."""
    import torch

    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() in ("vendor_id", "cpu family", "model", "model name"):
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    cpu = info.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in info:
        cpu += f" ({info.get('vendor_id', '?')} family {info['cpu family']} model {info.get('model', '?')})"
    return {"cpu": cpu, "kernels": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count() or 1,
            "torch": torch.__version__}


def eval_results(run_dir: Path, prefix: str = "eval") -> dict:
    """The last eval of the run at each length: {length: {loss, unigram_loss, gap, mlm_acc, most_frequent_acc}};
    ``prefix``: ``eval`` (the combined held-out set) or ``eval_<source>``."""
    scalars = read_scalars(RunDir(run_dir).tb)
    out: dict[str, dict] = {}
    for tag, values in scalars.items():
        head, _, length = tag.rpartition("_")
        if not (tag.startswith(prefix + "/") and length.isdigit()):
            continue
        out.setdefault(length, {})[head[len(prefix) + 1:]] = round(values[-1][1], 4)
    for row in out.values():
        if "loss" in row and "unigram_loss" in row:
            row["gap"] = round(row["unigram_loss"] - row["loss"], 4)
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def write_curves(run_dir: Path, out: Path) -> bool:
    """``out`` (PNG): the eval loss at each length over the steps, beside the unigram baseline at that length;
    False (nothing written) without eval scalars or without matplotlib."""
    if not RunDir(run_dir).tb.is_dir():
        return False
    scalars = read_scalars(RunDir(run_dir).tb)
    lengths = sorted(int(t.rpartition("_")[2]) for t in scalars if t.startswith("eval/loss_"))
    if not lengths:
        return False
    series, hlines = {}, {}
    for n in lengths:
        steps, values = zip(*scalars[f"eval/loss_{n}"])
        series[f"eval loss, length {n}"] = (steps, values)
    for n in lengths:
        unigram = scalars.get(f"eval/unigram_loss_{n}")
        if unigram:
            hlines[f"unigram baseline, length {n}"] = unigram[-1][1]
    return line_plot(out, [{"title": "held-out MLM loss (both sources)", "xlabel": "optimizer step",
                            "ylabel": "loss (nats per masked token)", "series": series, "hlines": hlines}])


# --------------------------------------------------------------------------- downstream


def _finetune_variants(variants: dict, common: list[str], out_root: Path, scores: dict) -> dict:
    """Run roformer-finetune once per variant (``name -> its own flags``), each into ``out_root/<name>``.

    Each result is kept in ``out_root/<name>.json`` with the command line that produced it; a rerun of the
    demo reuses it only for the same command line (an interrupted or differently set run is redone).
    ``scores``: record key -> results.json key, read from the last epoch (the held-out set selects nothing)."""
    results: dict = {}
    for name, extra in variants.items():
        argv = [*extra, *common, "--out", str(out_root / name)]
        record_path = out_root / f"{name}.json"
        record = json.loads(record_path.read_text()) if record_path.exists() else {}
        if record.get("argv") != argv:
            print(f"-- fine-tuning: {out_root.name}/{name}", flush=True)
            t0 = time.monotonic()
            res = finetune_run(argv)
            record = {"argv": argv, **{k: round(float(res[v]), 4) for k, v in scores.items()},
                      "seconds": round(time.monotonic() - t0, 1),
                      "train_examples": res["train_examples"], "dev_examples": res["dev_examples"]}
            atomic_write_text(record_path, json.dumps(record, indent=2, ensure_ascii=False) + "\n")
        results[name] = {k: record[k] for k in (*scores, "seconds")}
        results["train_examples"], results["dev_examples"] = record["train_examples"], record["dev_examples"]
    return results


def _run_flags() -> list[str]:
    """The flags every fine-tuning of the demo shares: seed 0, no progress bar, one thread per core."""
    return ["--seed", "0", "--no-progress", "--threads", str(os.cpu_count() or 1)]


def downstream(paths: dict, hf_dir: Path, out_root: Path, args) -> dict:
    """Sentiment: fine-tune the export, the same architecture from random initialisation, and the n-gram
    baseline (see _finetune_variants); ``args``: ``make demo``'s ``--finetune-*`` settings."""
    common = ["--train", str(paths["sentiment"] / "train.jsonl"), "--dev", str(paths["sentiment"] / "dev.jsonl"),
              "--epochs", str(args.finetune_epochs), "--lr", str(args.finetune_lr),
              "--batch-size", str(args.finetune_batch_size), "--max-length", str(args.finetune_max_length),
              "--pooling", args.finetune_pooling, *_run_flags()]
    variants = {"pretrained": ["--model", str(hf_dir)],
                "random_init": ["--model", str(hf_dir), "--from-scratch"],
                "ngram_baseline": ["--baseline", "ngram"]}
    return _finetune_variants(variants, common, out_root,
                              {"accuracy": "last_dev_accuracy", "macro_f1": "last_dev_macro_f1"})


@dataclass(frozen=True)
class NerSettings:
    """The NER fine-tuning of the demo (the defaults of ``make demo``'s ``--ner-*`` flags)."""
    ner_epochs: int = 8
    ner_lr: float = 5e-4
    ner_batch_size: int = 32
    ner_max_length: int = 128


def ner_downstream(ner_dir: Path, hf_dir: Path, out_root: Path, args) -> dict:
    """NER: the export, random initialisation and the dictionary baseline; entity F1 of the last epoch;
    ``args``: ``make demo``'s ``--ner-*`` settings."""
    common = ["--task", "token", "--train", str(ner_dir / "train.jsonl"), "--dev", str(ner_dir / "dev.jsonl"),
              "--epochs", str(args.ner_epochs), "--lr", str(args.ner_lr), "--batch-size", str(args.ner_batch_size),
              "--max-length", str(args.ner_max_length), *_run_flags()]
    variants = {"pretrained": ["--model", str(hf_dir)],
                "random_init": ["--model", str(hf_dir), "--from-scratch"],
                "dictionary": ["--baseline", "dict"]}
    return _finetune_variants(variants, common, out_root, {"f1": "last_dev_f1", "precision": "last_dev_precision",
                                                           "recall": "last_dev_recall"})
