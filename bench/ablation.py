"""Rotary vs absolute position embeddings: the RoFormer paper's convergence claim (Fig. 3), measured.

Trains the same model twice on the same shards, seed and curriculum, once with
``model.position_embedding=rotary`` and once with ``=absolute`` (BERT's learned positions), each as
its own ``roformer-train`` run under one directory, so that one TensorBoard logdir overlays them:

    OUT/rotary/    OUT/absolute/      (run directories: tb/, checkpoints/, metrics.jsonl, ...)
    tensorboard --logdir OUT          (runs "rotary/tb" and "absolute/tb")

Then it prints the eval loss of both at every eval step and the difference, evaluates both final
checkpoints at every length of ``--lengths`` (``roformer-eval``: past the trained 512 tokens too,
see its notes on untrained positions), writes ``OUT/ablation.json`` and ``OUT/ablation.png`` (both
curves, and the loss by eval length) and ends with one JSON line.
A run that is already complete is not trained again (``roformer-train`` resumes), so re-running the
command only re-prints the report.

    python bench/ablation.py                                   # the demo's model, data and curriculum
    python bench/ablation.py --config configs/experiments/debug.yaml --out runs/ablation_debug \
        data.shards=... data.eval_shards=...                   # any experiment, with overrides
    python bench/ablation.py --tiny                            # the debug experiment at 1 rank on tiny shards, two
                                                               # stages of 2 steps, lengths 64 and 128, in a temp dir

With the default config the demo's shard sets are built first when missing (as ``make demo`` does).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import _common as C  # noqa: E402  (puts the checkout on sys.path)

from roformer_dist.config import parse_lengths  # noqa: E402

ENCODINGS = ("rotary", "absolute")


def train(config: str, run_dir: Path, encoding: str, overrides: list[str], log_path: Path) -> float:
    """One roformer-train run (resumes when run_dir has checkpoints); returns the wall time in seconds."""
    return C.train_run(config, [*overrides, f"run_dir={run_dir}", f"model.position_embedding={encoding}"], encoding,
                       log_path)


def eval_curves(run_dir: Path) -> dict[int, tuple[float, int]]:
    """step -> (eval/loss, seq_len of that step's stage) from the run's TensorBoard events."""
    from roformer_dist.runtime.events import read_scalars

    scalars = read_scalars(run_dir / "tb")
    seq = dict(scalars.get("train/seq_len", []))
    return {step: (value, int(seq.get(step, 0))) for step, value in scalars.get("eval/loss", [])}


def eval_table(curves: dict[str, dict[int, tuple[float, int]]]) -> tuple[list[dict], str]:
    steps = sorted(set(curves["rotary"]) & set(curves["absolute"]))
    rows, lines = [], [f"{'step':>6} {'length':>6} {'rotary':>8} {'absolute':>8} {'abs-rot':>8}"]
    for s in steps:
        (r, length), (a, _) = curves["rotary"][s], curves["absolute"][s]
        rows.append({"step": s, "seq_len": length, "rotary": r, "absolute": a, "difference": a - r})
        lines.append(f"{s:>6} {length:>6} {r:>8.4f} {a:>8.4f} {a - r:>+8.4f}")
    return rows, "\n".join(lines)


TINY_STAGES = ("curriculum.stages=[{name: a, seq_len: 64, global_batch_size: 4, steps: 2, eval_lengths: [64]}, "
               "{name: b, seq_len: 128, global_batch_size: 4, steps: 2, eval_lengths: [64, 128]}]")
"""--tiny: two short stages, an eval of 2 batches at the end of each."""


def main(argv=None) -> int:
    p = C.parser(__doc__)
    p.add_argument("--config", default=str(C.DEMO_CONFIG), help="experiment YAML (default: the demo's)")
    p.add_argument("--out", default="runs/ablation", help="parent directory of the two runs (the TensorBoard logdir)")
    p.add_argument("--lengths", type=parse_lengths, default=[128, 256, 512, 1024, 1536], metavar="L1,L2,...",
                   help="comma-separated lengths of the final length-generalisation eval (default 128,256,512,1024,1536)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides for both runs")
    C.tiny_defaults(p, argv, config=str(C.DEBUG_CONFIG), out=lambda: str(C.tiny_dir() / "ablation"),
                    lengths=[64, 128])
    args = p.parse_args(argv)
    if args.tiny:
        args.overrides = C.tiny_train_overrides(TINY_STAGES) + args.overrides
    out = Path(args.out)
    C.demo_data(C.load_experiment("ablation", args.config, args.overrides), args.config)
    seconds = {}
    for enc in ENCODINGS:
        seconds[enc] = train(args.config, out / enc, enc, args.overrides, out / f"{enc}.log")

    from roformer_dist.observe.length_report import evaluate_checkpoint, format_comparison, format_report

    curves = {enc: eval_curves(out / enc) for enc in ENCODINGS}
    rows, table = eval_table(curves)
    print("\neval loss at each eval step (the stage's own length; lower is better):")
    print(table)
    final = rows[-1] if rows else None
    if final:
        print(f"final (step {final['step']}, length {final['seq_len']}): rotary {final['rotary']:.4f}, absolute "
              f"{final['absolute']:.4f}, absolute - rotary = {final['difference']:+.4f} nats")

    print("\nlength generalisation of the final checkpoints:", flush=True)
    reports = {enc: evaluate_checkpoint(out / enc, args.lengths, progress=True) for enc in ENCODINGS}
    for enc in ENCODINGS:
        print(format_report(reports[enc]))
    print("\neval loss by length:")
    print(format_comparison([reports[e] for e in ENCODINGS], list(ENCODINGS)))

    result = {"bench": "ablation", "out": str(out), "config": args.config, "overrides": args.overrides,
              "train_seconds": {e: round(s, 1) for e, s in seconds.items()}, "eval_steps": rows,
              "final": final, "lengths": {e: reports[e].to_dict() for e in ENCODINGS},
              "tensorboard": f"tensorboard --logdir {out}"}
    from data_pipeline.atomic import atomic_write_text

    atomic_write_text(out / "ablation.json", json.dumps(result, indent=2) + "\n")
    png = out / "ablation.png"
    if rows and C.line_plot(png, [
            {"title": "eval loss at the stage's own length", "xlabel": "optimizer step", "ylabel": "loss (nats)",
             "series": {e: ([r["step"] for r in rows], [r[e] for r in rows]) for e in ENCODINGS}},
            {"title": "final checkpoints by eval length", "xlabel": "eval length (tokens)", "ylabel": "loss (nats)",
             "series": {e: ([r.length for r in reports[e].rows if r.loss is not None],
                            [r.loss for r in reports[e].rows if r.loss is not None]) for e in ENCODINGS}}],
            title="rotary vs absolute position embeddings (same model, data, seed and curriculum)"):
        print(f"plot: {png}")
    print(f"\nTensorBoard (both runs overlaid): {Path(sys.executable).with_name('tensorboard')} --logdir {out}")
    print(f"report: {out / 'ablation.json'}")
    summary = {"bench": "ablation", "final_step": final and final["step"],
               "rotary": final and round(final["rotary"], 4), "absolute": final and round(final["absolute"], 4),
               "absolute_minus_rotary": final and round(final["difference"], 4),
               "length_loss": {e: {str(r.length): (None if r.loss is None else round(r.loss, 4))
                                   for r in reports[e].rows} for e in ENCODINGS}}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
