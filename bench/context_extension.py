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
    python bench/context_extension.py --tiny           # the whole path in about a minute: a 2-step parent of the
                                                       # debug model on tiny shards, a 2-step yarn fork at 256, lengths
                                                       # up to 512 (temporary directory)

Writes runs/extend/report.json and prints the table (docs/guides/new-phases.md, "Longer context from a fork").
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import _common as C  # noqa: E402  (puts the checkout on sys.path)

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
UNTRAINED = {(40000.0, "none"), (10000.0, "linear"), (10000.0, "yarn")}
"""The parent's own rows of the sweep shown beside the forks: (rope_theta, rope_scaling)."""


def run(cmd: list[str], **kwargs) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, env=C.child_env(), **kwargs)


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


def build_eval_set(held_out: Path, tokenizer: Path, out: Path, longest: int) -> Path:
    if (out / "manifest.json").exists():
        return out
    texts = long_documents(held_out, tokenizer, longest - 2)
    if not texts:
        sys.exit(f"context_extension: {held_out} is too short for one {longest}-token document")
    src = out.parent / f"{out.name}.txt"
    src.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    print(f"long eval set: {len(texts)} documents of {longest - 2} tokens from {src}", flush=True)
    run([*C.DATA, "shards", "--input", str(src), "--tokenizer", str(tokenizer), "--out", str(out),
         "--workers", "2", "--no-progress"])
    return out


def fork(args, run_dir: Path, overrides: list[str]) -> float:
    """One fork phase (skipped when its last step is there); returns its wall time in minutes."""
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists() and metrics.read_text().strip() and \
            json.loads(metrics.read_text().splitlines()[-1])["step"] >= args.steps:
        return 0.0
    t0 = time.monotonic()
    run([*C.TRAIN, "--config", str(args.config), "--fork", str(args.parent), f"run_dir={run_dir}",
         f"curriculum={args.curriculum}", f"model.max_position_embeddings={args.longest}",
         f"data.eval_shards={args.eval_set}", "data.eval_sources=[]", "trainer.save_every=0", "trainer.eval_every=0",
         f"trainer.stop_at_step={args.steps}", *args.overrides, *overrides])
    return (time.monotonic() - t0) / 60


def evaluate(args, checkpoint: Path, out: Path, *extra: str) -> list:
    run([*C.EVAL, str(checkpoint), "--lengths", args.lengths, "--eval-shards", str(args.eval_set),
         "--batches", str(args.batches), "--json", str(out), *extra], stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def tiny_setup(args) -> None:
    """A 2-step parent of the debug model on tiny shards, and a one-stage curriculum at 256, in a temp dir."""
    d = C.tiny_dir()
    train, evals = C.tiny_shards(d / "shards")
    args.held_out, args.tokenizer = d / "shards" / "pd_eval.txt", d / "shards" / "tok" / "sp.model"
    args.overrides = [f"data.shards={train}", "dist.world_size=1", "data.eval_batches=2"]
    run([*C.TRAIN, "--config", str(args.config), f"run_dir={args.parent}", f"data.eval_shards={evals}",
         "trainer.stop_at_step=2", *args.overrides])
    args.curriculum = d / "extend.yaml"
    args.curriculum.write_text("tokens_per_micro_batch: 1024\nstages:\n  - {name: s256, seq_len: 256, "
                               "global_batch_size: 2, steps: 2, lr: 3.0e-4, warmup_steps: 1}\n")


def main(argv=None) -> int:
    p = C.parser(__doc__)
    p.add_argument("--parent", type=Path, default=REPO / "runs" / "demo", help="the run forked (default: the demo's)")
    p.add_argument("--config", type=Path, default=C.DEMO_CONFIG,
                   help="the forks' experiment (the parent's model)")
    p.add_argument("--held-out", type=Path, default=REPO / "data" / "demo" / "corpus" / "pd_eval.txt",
                   help="held-out text the long documents are cut from")
    p.add_argument("--tokenizer", type=Path, default=REPO / "data" / "demo" / "mix" / "tokenizer.model")
    p.add_argument("--eval-set", type=Path, default=REPO / "data" / "demo" / "eval_long",
                   help="the long documents' shard set (built when missing)")
    p.add_argument("--curriculum", default="extend_1536", help="the forks' curriculum (a preset or a YAML file)")
    p.add_argument("--longest", type=int, default=3072, help="the eval documents' length (and the forks' positions)")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "extend")
    p.add_argument("--steps", type=int, default=60, help="steps of each fork phase (the preset has 60)")
    p.add_argument("--variants", default="a,b,c,d", help=f"comma-separated, of {','.join(VARIANTS)}")
    p.add_argument("--lengths", default="512,1024,1536,3072")
    p.add_argument("--batches", type=int, default=16, help="eval batches per length")
    C.tiny_defaults(p, argv, parent=lambda: C.tiny_dir() / "parent", config=C.DEBUG_CONFIG,
                    eval_set=lambda: C.tiny_dir() / "eval_long", out=lambda: C.tiny_dir() / "extend", longest=512,
                    steps=2, variants="d", lengths="128,256,512", batches=2)
    args = p.parse_args(argv)
    args.overrides = []
    if args.tiny:
        tiny_setup(args)
    if not (args.parent / "checkpoints").is_dir():
        sys.exit(f"context_extension: no run in {args.parent}: run `make demo` first")
    args.eval_set = build_eval_set(args.held_out, args.tokenizer, args.eval_set, args.longest)
    args.out.mkdir(parents=True, exist_ok=True)
    names = [v for v in args.variants.split(",") if v]
    minutes = {n: fork(args, args.out / n, VARIANTS[n][1]) for n in names}

    lengths = [int(x) for x in args.lengths.split(",")]
    sweep = evaluate(args, args.parent, args.out / "parent.json", "--rope-theta", "10000,40000",
                     "--rope-scaling", "none,linear:3,yarn:3")[0]
    rows = [(r["label"].replace(" (checkpoint)", "") + (" (parent)" if i == 0 else " (parent, untrained)"),
             r["loss"]) for i, r in enumerate(sweep["rows"])
            if i == 0 or (r["rope"]["rope_theta"], r["rope"]["rope_scaling"]) in UNTRAINED]
    for n in names:
        rep = evaluate(args, args.out / n, args.out / f"eval_{n}.json")[0]
        rows.append((f"({n}) {VARIANTS[n][0]}", [r["loss"] for r in rep["rows"]]))
    rows.append(("unigram baseline", sweep["unigram_loss"]))
    width = max(len(r[0]) for r in rows)
    print(f"\neval loss on {args.eval_set.name} (documents of {args.longest - 2} tokens), {args.batches} batches per "
          f"length; forks: {args.steps} steps of curriculum {Path(str(args.curriculum)).stem}")
    print(f"{'':<{width}} " + " ".join(f"{n:>8}" for n in lengths))
    for label, losses in rows:
        print(f"{label:<{width}} " + " ".join(f"{x:>8.3f}" for x in losses))
    report = {"bench": "context_extension", "lengths": lengths, "steps": args.steps, "batches": args.batches,
              "fork_minutes": minutes, "rows": [{"label": label, "loss": losses} for label, losses in rows]}
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    C.result(**report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
