"""Longer context from a fork: the demo's 512-token model continued for a short phase at 1536 tokens with
(a) nothing changed, (b) a raised rotary base, (c) linear position interpolation, (d) YaRN, against the
parent itself (with and without the same rope settings applied untrained), at 512 / 1024 / 1536 / 3072
tokens beside the unigram baseline.

Needs ``make demo`` first (runs/demo and data/demo). Every fork is a real ``roformer-train --fork runs/demo``
(2 ranks, ZeRO-2, ``curriculum=extend_1536``: 60 steps at 1536 tokens, 4 sequences per step, constant
lr 3e-4 after 10 warm-up steps, model.max_position_embeddings=3072); every figure comes from
``roformer-eval`` (the trainer's eval batches and masks) on one long-document eval set.

Long documents: the demo's held-out People's Daily lines (the last 1500 lines of January 1998, never
pretrained on) are single paragraphs of at most ~560 tokens, so consecutive lines are concatenated, in
their order, and cut into documents of exactly ``L - 2`` tokens for L = 3072 (one document per eval row
at 3072; the shorter lengths read consecutive pieces of the same documents). They are built once into
data/demo/eval_long with the demo's tokenizer.

    python bench/context_extension.py                  # ~15 min on 2 cores (four forks, then the evals)
    python bench/context_extension.py --steps 20 --variants a,c

Writes runs/extend/report.json and prints the table (README "Longer context from a fork").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import _common as C  # noqa: F401  (puts the checkout on sys.path)

REPO = C.REPO
VARIANTS = {  # name -> (label, config overrides of the fork)
    "a": ("fork, nothing changed", []),
    "b": ("fork, rope_theta 40000", ["model.rope_theta=40000"]),
    "c": ("fork, linear x3", ["model.rope_scaling=linear", "model.rope_scaling_factor=3",
                               "model.rope_original_max_position=512"]),
    "d": ("fork, yarn x3", ["model.rope_scaling=yarn", "model.rope_scaling_factor=3",
                             "model.rope_original_max_position=512"]),
}
"""The parent trained at 512: the scalings extend 512 three times (to the phase's 1536)."""
LONGEST = 3072


def bin_(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def long_documents(corpus: Path, tokenizer: Path, tokens: int) -> list[str]:
    """Consecutive held-out lines joined and cut into texts that encode to exactly ``tokens`` ids."""
    from data_pipeline.corpus import read_documents
    from data_pipeline.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer)
    ids = [int(i) for d in read_documents([corpus]) for i in tok.encode(d.text)]
    out, start = [], 0
    while start + tokens + 24 <= len(ids):
        for cut in range(tokens, tokens + 24):  # the text of a cut re-encodes to as many ids or (merged) fewer
            text = tok.decode(ids[start:start + cut])
            if len(tok.encode(text)) == tokens:
                out.append(text)
                break
        start += tokens
    return out


def build_eval_set(data: Path) -> Path:
    out = data / "eval_long"
    if (out / "manifest.json").exists():
        return out
    texts = long_documents(data / "corpus" / "pd_eval.txt", data / "mix" / "tokenizer.model", LONGEST - 2)
    if not texts:
        sys.exit(f"context_extension: {data / 'corpus' / 'pd_eval.txt'} is too short for one {LONGEST}-token document")
    src = data / "corpus" / "pd_eval_long.txt"
    src.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    print(f"long eval set: {len(texts)} documents of {LONGEST - 2} tokens from {src}", flush=True)
    subprocess.run([bin_("roformer-data"), "shards", "--input", str(src), "--tokenizer",
                    str(data / "mix" / "tokenizer.model"), "--out", str(out), "--workers", "2"], check=True, cwd=REPO)
    return out


def fork(parent: Path, run_dir: Path, eval_set: Path, overrides: list[str], steps: int) -> float:
    """One fork phase (skipped when its last step is there); returns its wall time in minutes."""
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists() and metrics.read_text().strip() and \
            json.loads(metrics.read_text().splitlines()[-1])["step"] >= steps:
        return 0.0
    cmd = [bin_("roformer-train"), "--config", str(REPO / "configs/experiments/demo.yaml"), "--fork", str(parent),
           f"run_dir={run_dir}", "curriculum=extend_1536", f"model.max_position_embeddings={LONGEST}",
           f"data.eval_shards={eval_set}", "data.eval_sources=[]", "trainer.save_every=0", "trainer.eval_every=0",
           f"trainer.stop_at_step={steps}", *overrides]
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, cwd=REPO)
    return (time.monotonic() - t0) / 60


def evaluate(args, checkpoint: Path, out: Path, *extra: str) -> list:
    cmd = [bin_("roformer-eval"), str(checkpoint), "--lengths", args.lengths, "--eval-shards", str(args.eval_set),
           "--batches", str(args.batches), "--json", str(out), *extra]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=REPO)
    return json.loads(out.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parent", type=Path, default=REPO / "runs" / "demo")
    p.add_argument("--data", type=Path, default=REPO / "data" / "demo")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "extend")
    p.add_argument("--steps", type=int, default=60, help="steps of each fork phase (the preset has 60)")
    p.add_argument("--variants", default="a,b,c,d", help=f"comma-separated, of {','.join(VARIANTS)}")
    p.add_argument("--lengths", default="512,1024,1536,3072")
    p.add_argument("--batches", type=int, default=16, help="eval batches per length")
    args = p.parse_args(argv)
    if not (args.parent / "checkpoints").is_dir():
        sys.exit(f"context_extension: no run in {args.parent}: run `make demo` first")
    args.eval_set = build_eval_set(args.data)
    args.out.mkdir(parents=True, exist_ok=True)
    names = [v for v in args.variants.split(",") if v]
    minutes = {n: fork(args.parent, args.out / n, args.eval_set, VARIANTS[n][1], args.steps) for n in names}

    lengths = [int(x) for x in args.lengths.split(",")]
    sweep = evaluate(args, args.parent, args.out / "parent.json", "--rope-theta", "10000,40000",
                     "--rope-scaling", "none,linear:3,yarn:3")[0]
    rows = [(r["label"].replace(" (checkpoint)", "") + (" (parent)" if i == 0 else " (parent, untrained)"),
             r["loss"]) for i, r in enumerate(sweep["rows"])
            if i == 0 or r["label"] in ("theta 40000", "theta 10000, linear x3", "theta 10000, yarn x3 (L 512)")]
    for n in names:
        rep = evaluate(args, args.out / n, args.out / f"eval_{n}.json")[0]
        rows.append((f"({n}) {VARIANTS[n][0]}", [r["loss"] for r in rep["rows"]]))
    rows.append(("unigram baseline", sweep["unigram_loss"]))
    width = max(len(r[0]) for r in rows)
    print(f"\neval loss on {args.eval_set} (documents of {LONGEST - 2} tokens), {args.batches} batches per length; "
          f"forks: {args.steps} steps at 1536")
    print(f"{'':<{width}} " + " ".join(f"{n:>8}" for n in lengths))
    for label, losses in rows:
        print(f"{label:<{width}} " + " ".join(f"{x:>8.3f}" for x in losses))
    report = {"lengths": lengths, "steps": args.steps, "batches": args.batches, "eval_set": str(args.eval_set),
              "fork_minutes": minutes, "rows": [{"label": label, "loss": losses} for label, losses in rows]}
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
