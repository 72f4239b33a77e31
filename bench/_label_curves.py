"""Label curves, the measurement of bench/finetune_reviews.py and bench/finetune_ner.py: ``roformer-finetune``
at growing training sizes (the first N examples of one training file), once per method and seed, every run
scored on one held-out set after its last epoch; the table, the PNG and the JSON line of the result; and
their ``--tiny`` stand-in for the demo's pretrained export."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from statistics import median

import _common as C


def curve_flags(p: argparse.ArgumentParser, *, out: str, epochs: int, lr: float) -> None:
    """The flags both label curves take (model, sizes, budget, seeds, threads), at this task's defaults."""
    p.add_argument("--model", default="runs/demo/hf", help="HF export directory or training checkpoint")
    p.add_argument("--sizes", default="300,1000,3000", help="training sizes, comma-separated")
    p.add_argument("--out", default=out)
    p.add_argument("--epochs", type=int, default=epochs)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--seeds", default="0,1,2", help="fine-tuning seeds, comma-separated")
    p.add_argument("--threads", type=int, default=2)


def common_flags(args, data: Path) -> list[str]:
    """The roformer-finetune flags every run of a label curve shares (dev set, budget, threads)."""
    return ["--dev", str(data / "dev.jsonl"), "--epochs", str(args.epochs), "--lr", str(args.lr),
            "--batch-size", str(args.batch_size), "--max-length", str(args.max_length),
            "--threads", str(args.threads), "--no-progress"]


def settings(args, data: Path, *extra: str) -> str:
    """The line printed above a label curve's table: model, dev set, budget, seeds, load."""
    return "; ".join([f"{args.model}", f"dev {data / 'dev.jsonl'}", ", ".join([
        f"{args.epochs} epochs", f"lr {args.lr:g}", f"batch {args.batch_size}", f"max length {args.max_length}",
        *extra, f"{args.threads} threads", f"seeds {args.seeds} (median, min-max)"]),
        f"load average {os.getloadavg()[0]:.1f}"])


def first_examples(src: Path, n: int, out: Path) -> Path:
    lines = src.read_text(encoding="utf-8").splitlines(keepends=True)
    if len(lines) < n:
        raise SystemExit(f"{src}: {len(lines)} examples, fewer than the training size {n}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(lines[:n]), encoding="utf-8")
    return out


def label_curve(methods: dict[str, list[str]], sizes: list[int], seeds: list[int], train_src: Path, out: Path,
                common: list[str], score: str, deterministic: set[str]) -> tuple[dict, dict]:
    """roformer-finetune for every size (the first N examples of ``train_src``), method (its flags) and seed
    (once for a method in ``deterministic``); ({size: {method: [results[score] per seed]}}, {size: seconds of
    the first "pretrained" run})."""
    from roformer_dist.finetune.run import run

    curve: dict[int, dict[str, list[float]]] = {}
    seconds: dict[int, float] = {}
    for n in sizes:
        train = first_examples(train_src, n, out / f"n{n}" / train_src.name)
        curve[n] = {name: [] for name in methods}
        for name, flags in methods.items():
            for seed in seeds[:1] if name in deterministic else seeds:
                print(f"== {n} training examples: {name}, seed {seed}", flush=True)
                t0 = time.perf_counter()
                res = run([*flags, "--train", str(train), *common, "--seed", str(seed),
                           "--out", str(out / f"n{n}" / f"{name.replace(' ', '_')}_{seed}")])
                if name == "pretrained" and n not in seconds:
                    seconds[n] = time.perf_counter() - t0
                curve[n][name].append(res[score])
    return curve, seconds


def report(bench: str, curve: dict, seconds: dict, score: str, unit: str, png: Path, title: str) -> None:
    """The table (median and min-max per size and method), the PNG (medians, min-max shaded) and the JSON
    line (ours: pretrained, baseline: from scratch, at the largest size)."""
    sizes, methods = list(curve), list(next(iter(curve.values())))

    def cell(xs: list[float]) -> str:
        return f"{median(xs):.4f}" + (f" ({min(xs):.3f}-{max(xs):.3f})" if len(xs) > 1 else "")

    med = {n: {m: median(v) for m, v in curve[n].items()} for n in sizes}
    rows = [[n, *(cell(curve[n][m]) for m in methods),
             f"{100 * (med[n]['pretrained'] - med[n]['from scratch']):+.1f}", f"{seconds[n]:.0f}"] for n in sizes]
    C.print_table(["labelled examples", *(f"{m} {score}" for m in methods), "pretrained - scratch (points)",
                   "seconds per pretrained run"], rows)
    drawn = C.line_plot(png, [{"title": title, "xlabel": "labelled training examples", "ylabel": unit, "logx": True,
                               "series": {m: (sizes, [med[n][m] for n in sizes]) for m in methods},
                               "bands": {m: (sizes, [min(curve[n][m]) for n in sizes],
                                             [max(curve[n][m]) for n in sizes]) for m in methods}}])
    if drawn:
        print(f"plot: {png}")
    top = sizes[-1]
    C.emit(bench, med[top]["pretrained"], med[top]["from scratch"], unit,
           med[top]["pretrained"] / med[top]["from scratch"] if med[top]["from scratch"] else float("inf"),
           curve={str(n): curve[n] for n in sizes}, png=str(png) if drawn else None,
           load_average=round(os.getloadavg()[0], 1))


def tiny_export(out: Path) -> Path:
    """An HF export (weights, config, tokenizer) of the debug model at random initialisation, its vocabulary
    the tokenizer of _common.tiny_shards in ``out``'s parent: a stand-in for the demo's pretrained export."""
    import torch

    from data_pipeline.tokenizer import Tokenizer
    from roformer_dist.config import load_config
    from roformer_dist.hf.export import ExportSource, export_hf_repository
    from roformer_dist.nn.model import RoFormerForMaskedLM

    train, _ = C.tiny_shards(out.parent / "shards")
    sp_model = train / "tokenizer.model"
    cfg = load_config(None, ["model=debug", f"model.vocab_size={Tokenizer(sp_model).vocab_size}"])
    torch.manual_seed(0)
    export_hf_repository(RoFormerForMaskedLM(cfg.model), out, tokenizer=sp_model, check_docs=0,
                         source=ExportSource("bench/finetune_reviews.py --tiny: random initialisation"))
    return out
