"""Does the staged sequence-length curriculum save time? Eval loss at the final length against tokens and
against training wall time, for three orders of lengths on the same token budget.

Three ``roformer-train`` runs of the same model, data, seed, optimizer and LR schedule, each under one
directory, so that one TensorBoard logdir overlays them. The base is the config's own curriculum (after the
overrides): its stages must all take the same tokens per step (length x global batch), and its last
stage's length is the final length. With the default config (the demo's model and data, 2 ranks, ZeRO-2,
configs/curriculum/demo.yaml: 600 steps at 128 tokens, 160 at 256, 240 at 512, 4096 tokens per step) every
variant takes 1000 optimizer steps of 4096 tokens, 4.1 M tokens in all:

    (a) a_curriculum   the base curriculum as it is: 128 x 600, 256 x 160, 512 x 240 (length x steps;
                       batches of 32, 16, 8 sequences)
    (b) b_fixed        the final length from the first step: 512 x 1000, 8 sequences per step
    (c) c_paper        the order of the RoFormer paper's six stages (configs/curriculum/paper_zh.yaml: 512, 1536,
                       256, 128, 1536, 512) with its proportions of steps (200000 : 12500 : 120000 : 80000 :
                       10000 : 30000; of 1000 steps, by largest remainder: 442, 28, 265, 177, 22, 66), every stage
                       at the base's tokens per step (the paper's batches of 512 in its stages 4 and 6 are not kept)

Variant (c)'s lengths are the paper's scaled by (final length / 512), and its 1536-token stages are capped
at ``--long`` (default: the final length, 512): 4096 tokens do not make a whole number of 1536-token
sequences, and the demo's documents (People's Daily paragraphs, reviews) are at most ~560 tokens, so a
longer row only packs more documents in. Consecutive stages that end up at the same length are run as one
stage. With the defaults (c) is 512 x 470, 256 x 265, 128 x 177, 512 x 88 (the paper's stages 1-2 and 5-6
merged); ``--long 1024`` keeps the six stages, the second and fifth at 1024 tokens (4 sequences per step),
longer than the final length.

All three take the same tokens per step and the same steps, hence the same tokens (to be exact, the
non-padding tokens of packed rows differ by well under a percent; the report gives them), under the same
LR schedule (warm-up, then linear decay over the same total steps).

Eval: every stage of every variant evaluates at the final length only (``eval_lengths: [512]``; the per-
source held-out sets are dropped: ``data.eval_sources=[]``), on the same fixed eval batches, every
``--eval-every`` steps (default 20 x ``--scale``, at least 1): the same steps, hence the same tokens, in
every variant. The trainer also evaluates at each stage end; those extra points are kept in the curves.

Training wall time at step n is the sum over steps 1..n of ``step_time_s`` in the run's metrics.jsonl:
rank 0's time for each optimizer step, from the trainer's call of the runner to its return -- the wait
for the batches (with the DataLoader's restart at each new stage), the forwards and backwards of every
micro-batch, the gradient reduction and the optimizer step. Not counted: the evals, the checkpoint
saves, the start-up of roformer-train (ranks, DeepSpeed, model build) and the bookkeeping between steps
(the metrics line, TensorBoard scalars, the console line: milliseconds). A resumed run adds up the same
way. As a check the report gives each run's span (its last step's ``time`` - its first step's ``time``
+ the first step's ``step_time_s``) beside it: the difference is what the evals and saves took.

Report: a table of eval loss at 512 and training seconds at each eval step all variants share; each
variant's final loss, training time, the training time it needs to reach (b)'s final eval loss
(interpolated linearly between the eval points around the first one at or below it; "never" when none
is) and that time over (b)'s own time to the same loss (the goal: the curriculum needs at most 0.7x;
printed either way), and each variant's loss at equal wall time (the training time of the variant that
finished first; interpolated, "-" before a variant's first eval).

    python bench/curriculum.py                        # the three variants on the demo (~50 min on 2 quiet cores)
    python bench/curriculum.py --scale 0.25 --out runs/curriculum_quarter   # a quarter of the steps
    python bench/curriculum.py --variants a,b --long 1024 trainer.seed=7    # with config overrides
    python bench/curriculum.py --tiny                 # the debug model at 1 rank on tiny shards in a temporary
                                                      # directory: 8 steps of 256 tokens per variant (32 x 4,
                                                      # 64 x 2, 128 x 2 / 128 x 8 / 128 x 3, 64 x 2, 32 x 1,
                                                      # 128 x 2), evals at 128 every 2 steps

Writes, under OUT (default runs/curriculum):

    OUT/a_curriculum/ OUT/b_fixed/ OUT/c_paper/   the runs (tb/, checkpoints/, metrics.jsonl, config.yaml)
    OUT/<variant>.log                             each run's console output
    OUT/curricula/<variant>.yaml                  each variant's curriculum as given to roformer-train
    OUT/compare/<variant>/                        TensorBoard scalars eval_loss_512/by_tokens (step = tokens
                                                  seen) and eval_loss_512/by_train_ms (step = training ms)
    OUT/curriculum.json, OUT/curriculum.png       the report; the plot: loss vs tokens, loss vs training seconds
    tensorboard --logdir OUT                      all of it overlaid

A run that is already complete is not trained again (a partial one resumes), so re-running the command
re-prints the report; a run directory made with other settings (scale, eval steps, --long) is refused: use
another --out. With the default config the demo's shard sets are built first when missing (as ``make demo``
does). Wall times on a shared machine vary with its load (the report prints the load averages). Ends with
one JSON line: ratio = (b)'s training time to its final eval loss / (a)'s training time to the same loss
(> 1: the curriculum is faster; 0 when (a) never gets there).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Optional

import _common as C  # noqa: E402  (puts the checkout on sys.path)

from roformer_dist.config import CONFIGS_DIR, load_config, to_dict  # noqa: E402

VARIANTS = {"a": "a_curriculum", "b": "b_fixed", "c": "c_paper"}
"""Letter -> run directory name under OUT (the TensorBoard run)."""
GOAL = 0.7
"""The curriculum should reach the fixed-length run's final eval loss in at most this share of its time."""
DEFAULT_EVAL_EVERY = 20
PAPER = CONFIGS_DIR / "curriculum" / "paper_zh.yaml"


# ----------------------------------------------------------------------------------------- the variants

def scaled_steps(steps: list[int], scale: float) -> list[int]:
    """Each stage's steps times ``scale``, rounded, at least 1."""
    return [max(1, round(s * scale)) for s in steps]


def apportion(weights: list[float], total: int) -> list[int]:
    """``total`` steps shared in proportion to ``weights`` by largest remainder, every share at least 1 (a
    share of 0 takes one step from the largest share)."""
    if total < len(weights):
        raise ValueError(f"{total} steps cannot give each of {len(weights)} stages one step")
    exact = [w * total / sum(weights) for w in weights]
    out = [math.floor(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: (out[i] - exact[i], i))[:total - sum(out)]:
        out[i] += 1
    while 0 in out:
        out[out.index(max(out))] -= 1
        out[out.index(0)] = 1
    return out


def tokens_per_step(stages: list[dict]) -> int:
    """The tokens of one optimizer step, the same in every stage (else ValueError)."""
    per = {st["seq_len"] * st["global_batch_size"] for st in stages}
    if len(per) != 1:
        shown = ", ".join(f"{st['name']}: {st['seq_len']} x {st['global_batch_size']}" for st in stages)
        raise ValueError(f"the curriculum's stages take different tokens per step ({shown}); this bench compares "
                         "orders of lengths at equal tokens per step")
    return per.pop()


def _stage(name: str, seq_len: int, per_step: int, steps: int, target: int) -> dict:
    if per_step % seq_len:
        raise ValueError(f"stage {name}: {per_step} tokens per step are not a whole number of {seq_len}-token "
                         "sequences")
    return {"name": name, "seq_len": seq_len, "global_batch_size": per_step // seq_len, "steps": steps,
            "eval_lengths": [target]}


def paper_lengths(paper: list[dict], target: int, long: int) -> list[int]:
    """The paper's lengths scaled by target / 512, each capped at ``long`` (its 1536 stages)."""
    return [min(st["seq_len"] * target // 512, long) for st in paper]


def variant_curricula(base: dict, paper: list[dict], scale: float = 1.0, long: Optional[int] = None) -> dict:
    """letter -> curriculum mapping (``tokens_per_micro_batch``, ``stages``) of each variant.

    ``base``: the config's curriculum (``to_dict``), variant (a) with its steps scaled; its last stage's
    length is the final length (the eval length of every stage of every variant). ``paper``: the stages of
    paper_zh.yaml (their lengths and step proportions); consecutive stages that end up at the same length
    are one stage of (c) (a stage switch restarts the DataLoader, a cost one stage per length does not pay).
    Every stage of every variant masks at ``data.mlm_probability``: the base's own per-stage rates are dropped,
    so the variants differ in their lengths only."""
    stages = [dict(st) for st in base["stages"]]
    per_step = tokens_per_step(stages)
    target = stages[-1]["seq_len"]
    long = target if long is None else long
    steps = scaled_steps([st["steps"] for st in stages], scale)
    for st, n in zip(stages, steps):
        st.update(steps=n, eval_lengths=[target], mlm_probability=None)   # every variant masks at one rate
    total = sum(steps)
    tpmb = base["tokens_per_micro_batch"]
    shares = apportion([st["steps"] for st in paper], total)
    lengths = paper_lengths(paper, target, long)
    merged: list[tuple[list[str], int, int]] = []  # (paper stage names, length, steps)
    for st, ln, n in zip(paper, lengths, shares):
        if merged and merged[-1][1] == ln:
            merged[-1] = (merged[-1][0] + [st["name"]], ln, merged[-1][2] + n)
        else:
            merged.append(([st["name"]], ln, n))
    return {
        "a": {"tokens_per_micro_batch": tpmb, "stages": stages},
        "b": {"tokens_per_micro_batch": tpmb, "stages": [_stage(f"s{target}", target, per_step, total, target)]},
        "c": {"tokens_per_micro_batch": tpmb,
              "stages": [_stage(f"{'+'.join(names)}_{ln}", ln, per_step, n, target) for names, ln, n in merged]},
    }


def describe(curriculum: dict) -> str:
    """'128 x 500, 256 x 120, 512 x 120' (length x steps)."""
    return ", ".join(f"{st['seq_len']} x {st['steps']}" for st in curriculum["stages"])


# ----------------------------------------------------------------------------------------- the curves

def read_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's step records in step order (a line cut by a crash is skipped)."""
    out = []
    path = Path(run_dir) / "metrics.jsonl"
    if path.exists():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return sorted(out, key=lambda r: r["step"])


def train_seconds(records: list[dict]) -> dict[int, float]:
    """step -> training wall time after it: the sum of ``step_time_s`` over steps 1..step (module docstring)."""
    out, total = {}, 0.0
    for r in records:
        total += r["step_time_s"]
        out[r["step"]] = total
    return out


def span_seconds(records: list[dict]) -> float:
    """From the start of the first step to the end of the last: evals and saves included."""
    if not records:
        return 0.0
    return records[-1]["time"] - records[0]["time"] + records[0]["step_time_s"]


def curve(records: list[dict], evals: list[tuple[int, float]], per_step: int) -> list[dict]:
    """One point per eval: step, tokens (step x tokens per step), tokens_seen (non-padding), train_s, loss."""
    by_step = {r["step"]: r for r in records}
    seconds = train_seconds(records)
    return [{"step": s, "tokens": s * per_step, "tokens_seen": by_step[s]["tokens_seen"],
             "train_s": round(seconds[s], 3), "loss": loss}
            for s, loss in sorted(evals) if s in by_step]


def time_to_reach(points: list[dict], target: float) -> Optional[float]:
    """Training seconds at which the eval loss first gets down to ``target``: linear between the eval point
    before and the first point at or below it (the first point's time when that is the first eval);
    None when no point gets there."""
    prev = None
    for p in points:
        if p["loss"] <= target:
            if prev is None or prev["loss"] == p["loss"]:
                return p["train_s"]
            f = (prev["loss"] - target) / (prev["loss"] - p["loss"])
            return prev["train_s"] + f * (p["train_s"] - prev["train_s"])
        prev = p
    return None


def loss_at(points: list[dict], seconds: float) -> Optional[float]:
    """Eval loss at ``seconds`` of training, linear between the eval points around it; None outside them."""
    for a, b in zip(points, points[1:]):
        if a["train_s"] <= seconds <= b["train_s"]:
            if b["train_s"] == a["train_s"]:
                return b["loss"]
            f = (seconds - a["train_s"]) / (b["train_s"] - a["train_s"])
            return a["loss"] + f * (b["loss"] - a["loss"])
    if points and math.isclose(points[-1]["train_s"], seconds, abs_tol=1e-9):
        return points[-1]["loss"]
    return None


def compare(curves: dict[str, list[dict]], baseline: str = "b") -> dict:
    """The report's figures from each variant's points: final loss and time, time to the baseline's final
    loss and its share of the baseline's own time to it (None without the baseline), loss at equal wall
    time (the training time of the first variant to finish)."""
    out: dict = {"variants": {}}
    target = curves[baseline][-1]["loss"] if curves.get(baseline) else None
    base_time = time_to_reach(curves[baseline], target) if target is not None else None
    equal = min(pts[-1]["train_s"] for pts in curves.values() if pts) if any(curves.values()) else None
    out.update(target_loss=target, baseline_time_s=base_time, equal_wall_s=equal)
    for name, pts in curves.items():
        reach = time_to_reach(pts, target) if target is not None and pts else None
        out["variants"][name] = {
            "final_loss": pts[-1]["loss"] if pts else None, "train_s": pts[-1]["train_s"] if pts else None,
            "time_to_target_s": reach,
            "share_of_baseline": reach / base_time if reach is not None and base_time else None,
            "loss_at_equal_wall": loss_at(pts, equal) if equal is not None else None}
    return out


# ----------------------------------------------------------------------------------------- the runs

def tb_evals(run_dir: Path, target: int) -> list[tuple[int, float]]:
    """[(step, eval loss at ``target``)] from the run's TensorBoard events."""
    from roformer_dist.runtime.events import read_scalars

    tb = Path(run_dir) / "tb"
    return read_scalars(tb).get(f"eval/loss_{target}", []) if tb.is_dir() else []


def settings_of(cfg) -> dict:
    """What makes two runs of a variant the same experiment: its curriculum, eval steps and warm-up."""
    return {"curriculum": to_dict(cfg.curriculum), "eval_every": cfg.trainer.eval_every,
            "warmup_steps": cfg.optim.warmup_steps}


def check_run_dir(run_dir: Path, cfg) -> None:
    """Refuse a run directory whose run was made with other settings (its config.yaml)."""
    saved = run_dir / "config.yaml"
    if not saved.exists():
        return
    have, want = settings_of(load_config(saved)), settings_of(cfg)
    if have != want:
        shown = {"curriculum": lambda c: describe(c) + " (length x steps)"}
        diff = "; ".join(f"{k} {shown.get(k, str)(have[k])} there, {shown.get(k, str)(want[k])} here"
                         for k in want if have[k] != want[k])
        raise SystemExit(f"curriculum: {run_dir} holds a run made with other settings ({diff}): use another --out "
                         "or remove it")


def complete(run_dir: Path, total: int, target: int) -> bool:
    records = read_records(run_dir)
    return bool(records) and records[-1]["step"] >= total and any(s == total for s, _ in tb_evals(run_dir, target))


def train(config: str, label: str, overrides: list[str], log_path: Path) -> float:
    """One roformer-train run (it resumes when its run_dir has checkpoints); returns its seconds, start-up
    and evals included."""
    return C.train_run(config, overrides, label, log_path, show=lambda line: (
        "at length" in line and " eval" in line) or ("stage " in line and "seq_len" in line))


def write_tb(out: Path, name: str, points: list[dict], target: int) -> None:
    """OUT/compare/<name>: the eval loss with tokens seen and training milliseconds as TensorBoard steps."""
    from torch.utils.tensorboard import SummaryWriter

    d = out / "compare" / name
    shutil.rmtree(d, ignore_errors=True)
    w = SummaryWriter(str(d))
    for p in points:
        w.add_scalar(f"eval_loss_{target}/by_tokens", p["loss"], p["tokens_seen"])
        w.add_scalar(f"eval_loss_{target}/by_train_ms", p["loss"], int(round(p["train_s"] * 1000)))
    w.close()


# ----------------------------------------------------------------------------------------- the report

def fmt(x: Optional[float], spec: str = ".4f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def report_tables(curves: dict[str, list[dict]], figures: dict, labels: dict[str, str], target: int,
                  per_step: int, runs: dict[str, dict]) -> None:
    names = list(curves)
    common = sorted(set.intersection(*[{p["step"] for p in curves[n]} for n in names])) if names else []
    at = {n: {p["step"]: p for p in curves[n]} for n in names}
    print(f"\neval loss at {target} tokens (lower is better) and training seconds, at the eval steps all variants "
          "share:")
    C.print_table(["step", "tokens M"] + [h for n in names for h in (f"({n}) loss", f"({n}) train s")],
                  [[str(s), f"{s * per_step / 1e6:.4g}"]
                   + [c for n in names for c in (f"{at[n][s]['loss']:.4f}", f"{at[n][s]['train_s']:.1f}")]
                   for s in common])
    t = figures["target_loss"]
    print(f"\nper variant (target: (b)'s final eval loss {fmt(t)}; equal wall time: "
          f"{fmt(figures['equal_wall_s'], '.1f')} training s, the first variant to finish):")
    rows = []
    for n in names:
        v, r = figures["variants"][n], runs[n]
        never = "never" if t is not None else "-"
        rows.append([f"({n}) {labels[n]}", fmt(v["final_loss"]), fmt(v["train_s"], ".1f"), fmt(r["span_s"], ".1f"),
                     f"{r['tokens_seen'] / 1e6:.3f}", fmt(v["time_to_target_s"], ".1f", never),
                     fmt(v["share_of_baseline"], ".2f", never), fmt(v["loss_at_equal_wall"])])
    C.print_table(["variant", "final loss", "train s", "span s", "tokens seen M", "s to target", "x (b)'s",
                   "loss at equal s"], rows)
    print("load averages (1, 5, 15 min) at the end of each run: "
          + "; ".join(f"({n}) {runs[n]['load_average']}" for n in names))


def verdicts(figures: dict, labels: dict[str, str]) -> list[str]:
    """One line per variant other than (b): does it reach (b)'s final loss within GOAL x (b)'s time?"""
    out = []
    t, base = figures["target_loss"], figures["baseline_time_s"]
    if t is None:
        return ["variant (b), the fixed-length baseline, was not run: no target loss"]
    for n, v in figures["variants"].items():
        if n == "b":
            continue
        if v["time_to_target_s"] is None:
            out.append(f"({n}) {labels[n]} never reaches (b)'s final eval loss {t:.4f} "
                       f"(its own final: {v['final_loss']:.4f}): not within the {GOAL}x goal")
        else:
            share = v["share_of_baseline"]
            out.append(f"({n}) {labels[n]} reaches (b)'s final eval loss {t:.4f} after {v['time_to_target_s']:.1f} "
                       f"training s, {share:.2f}x (b)'s {base:.1f} s: "
                       f"{'within' if share <= GOAL else 'not within'} the {GOAL}x goal")
    return out


def plot(path: Path, curves: dict[str, list[dict]], labels: dict[str, str], target: int, figures: dict,
         title: str) -> bool:
    series_t = {f"({n}) {labels[n]}": ([p["tokens_seen"] / 1e6 for p in pts], [p["loss"] for p in pts])
                for n, pts in curves.items()}
    series_s = {f"({n}) {labels[n]}": ([p["train_s"] for p in pts], [p["loss"] for p in pts])
                for n, pts in curves.items()}
    hlines = {"(b)'s final loss": figures["target_loss"]} if figures["target_loss"] is not None else {}
    return C.line_plot(path, [
        {"title": f"eval loss at {target} vs tokens", "xlabel": "tokens seen (M)", "ylabel": f"eval loss at {target}",
         "series": series_t, "hlines": hlines},
        {"title": f"eval loss at {target} vs training time", "xlabel": "training wall time (s, evals excluded)",
         "ylabel": f"eval loss at {target}", "series": series_s, "hlines": hlines},
    ], title=title, width=6.0)


# ----------------------------------------------------------------------------------------- main

TINY_STAGES = ("curriculum.stages=[{name: s32, seq_len: 32, global_batch_size: 8, steps: 4}, "
               "{name: s64, seq_len: 64, global_batch_size: 4, steps: 2}, "
               "{name: s128, seq_len: 128, global_batch_size: 2, steps: 2}]")
"""--tiny: a 32 -> 64 -> 128 base curriculum of 256 tokens per step (8 steps)."""


def parse_variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(VARIANTS)}, got {text!r}")
    return [v for v in VARIANTS if v in names]


def main(argv=None) -> int:
    p = C.parser(__doc__)
    p.add_argument("--config", default=str(C.DEMO_CONFIG), help="experiment YAML (default: the demo's)")
    p.add_argument("--out", default="runs/curriculum", help="parent directory of the runs (the TensorBoard logdir)")
    p.add_argument("--variants", type=parse_variants, default=list(VARIANTS), metavar="a,b,c",
                   help="which variants to run (default all three)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiplies every stage's steps (rounded, at least 1) and optim.warmup_steps (default 1.0)")
    p.add_argument("--eval-every", type=int, default=None, metavar="N",
                   help=f"eval every N steps in every variant (default {DEFAULT_EVAL_EVERY} x --scale, at least 1)")
    p.add_argument("--long", type=int, default=None, metavar="L",
                   help="the length of (c)'s stages that stand for the paper's 1536 (default: the final length)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides for every run")
    C.tiny_defaults(p, argv, config=str(C.DEBUG_CONFIG), out=lambda: str(C.tiny_dir() / "curriculum"), eval_every=2)
    args = p.parse_args(argv)
    if args.scale <= 0:
        p.error("--scale must be positive")
    if args.eval_every is not None and args.eval_every < 1:
        p.error("--eval-every must be at least 1 (every variant is evaluated at the same steps)")
    if args.tiny:
        args.overrides = C.tiny_train_overrides(TINY_STAGES, "curriculum.tokens_per_micro_batch=256",
                                                eval_every=None) + args.overrides
    out = Path(args.out).absolute()
    base = C.load_experiment("curriculum", args.config, args.overrides)
    import yaml

    paper = yaml.safe_load(PAPER.read_text(encoding="utf-8"))["stages"]
    try:
        curricula = variant_curricula(to_dict(base.curriculum), paper, args.scale, args.long)
    except ValueError as e:
        print(f"curriculum: {e}", file=sys.stderr)
        return 2
    target = curricula["a"]["stages"][-1]["seq_len"]
    per_step = tokens_per_step(curricula["a"]["stages"])
    total = sum(st["steps"] for st in curricula["a"]["stages"])
    eval_every = args.eval_every or max(1, round(DEFAULT_EVAL_EVERY * args.scale))
    warmup = round(base.optim.warmup_steps * args.scale)
    long = args.long or target
    labels = {"a": " -> ".join(str(st["seq_len"]) for st in curricula["a"]["stages"]),
              "b": f"{target} only",
              "c": "paper order " + ",".join(str(st["seq_len"]) for st in curricula["c"]["stages"])}

    print(f"curriculum bench: {total} steps of {per_step} tokens ({total * per_step:,} tokens) per variant, "
          f"eval at {target} every {eval_every} steps; scale {args.scale:g}, warm-up {warmup} steps", flush=True)
    paper_text = ", ".join(str(st["seq_len"]) for st in paper)
    print(f"(c): the paper's {paper_text} scaled by {target}/512, 1536 capped at {long}, consecutive equal lengths "
          f"merged: {describe(curricula['c'])} (length x steps)", flush=True)
    for n in args.variants:
        print(f"({n}) {VARIANTS[n]}: {describe(curricula[n])}", flush=True)

    C.demo_data(base, args.config)

    (out / "curricula").mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict] = {}
    for n in args.variants:
        name = VARIANTS[n]
        run_dir = out / name
        cur_path = out / "curricula" / f"{name}.yaml"
        cur_path.write_text(yaml.safe_dump(curricula[n], sort_keys=False), encoding="utf-8")
        # the bench's defaults first (the command line may change them), the variant's own settings last; the
        # command line's curriculum overrides are in the variant's file already
        own = [o for o in args.overrides if o.split("=")[0].split(".")[0] != "curriculum"]
        overrides = ["data.eval_sources=[]", *own, f"curriculum={cur_path}", f"trainer.eval_every={eval_every}",
                     f"optim.warmup_steps={warmup}", f"run_dir={run_dir}"]
        try:
            cfg = load_config(args.config, overrides)
        except ValueError as e:
            print(f"curriculum: variant ({n}): config error: {e}", file=sys.stderr)
            return 2
        check_run_dir(run_dir, cfg)
        if complete(run_dir, total, target):
            print(f"== ({n}) {name}: complete in {run_dir}, not trained again", flush=True)
            seconds = None
        else:
            seconds = train(args.config, f"({n}) {name}", overrides, out / f"{name}.log")
        records = read_records(run_dir)
        runs[n] = {"run_dir": str(run_dir), "process_s": seconds, "span_s": span_seconds(records),
                   "tokens_seen": records[-1]["tokens_seen"] if records else 0, "load_average": C.load_average(),
                   "records": records}

    curves = {n: curve(runs[n].pop("records"), tb_evals(out / VARIANTS[n], target), per_step) for n in args.variants}
    empty = [n for n, pts in curves.items() if not pts]
    if empty:
        raise SystemExit(f"curriculum: no eval at {target} in the run(s) {', '.join(empty)}")
    figures = compare(curves)
    report_tables(curves, figures, labels, target, per_step, runs)
    print()
    for line in verdicts(figures, labels):
        print(line)

    for n, pts in curves.items():
        write_tb(out, VARIANTS[n], pts, target)
    png = out / "curriculum.png"
    plotted = plot(png, curves, labels, target, figures,
                   f"{total * per_step:,} tokens per variant, eval at {target}")
    result = {"bench": "curriculum", "out": str(out), "config": args.config, "overrides": args.overrides,
              "scale": args.scale, "eval_every": eval_every, "warmup_steps": warmup, "target_length": target,
              "long_length": long, "tokens_per_step": per_step, "total_steps": total, "goal": GOAL,
              "figures": figures,
              "variants": {n: {"name": VARIANTS[n], "label": labels[n], "curriculum": curricula[n], **runs[n],
                               "points": curves[n]} for n in args.variants},
              "tensorboard": f"tensorboard --logdir {out}"}
    from data_pipeline.atomic import atomic_write_text

    atomic_write_text(out / "curriculum.json", json.dumps(result, indent=2) + "\n")
    print(f"\nTensorBoard (the runs and OUT/compare overlaid): {Path(sys.executable).with_name('tensorboard')} "
          f"--logdir {out}")
    print(f"report: {out / 'curriculum.json'}" + (f"; plot: {png}" if plotted else ""))

    v = figures["variants"]

    def each(key: str, digits: int) -> dict:
        return {n: None if v[n][key] is None else round(v[n][key], digits) for n in curves}

    extra = {"variants": list(curves), "target_loss": figures["target_loss"], "final_loss": each("final_loss", 4),
             "train_s": each("train_s", 1), "share_of_b": each("share_of_baseline", 3),
             "equal_wall_s": round(figures["equal_wall_s"], 1), "loss_at_equal_wall": each("loss_at_equal_wall", 4),
             "eval_points": {n: [[p["step"], round(p["train_s"], 3), round(p["loss"], 4)] for p in curves[n]]
                             for n in curves},
             "tokens": total * per_step, "scale": args.scale, "load_average": C.load_average()}
    a, b = v.get("a"), v.get("b")
    if a is not None and b is not None and figures["baseline_time_s"]:
        reached = a["time_to_target_s"] is not None
        ours = a["time_to_target_s"] if reached else a["train_s"]
        base_s = figures["baseline_time_s"]
        C.emit("curriculum", ours, base_s, "s", base_s / ours if reached else 0.0, reached=reached,
               goal_met=reached and a["share_of_baseline"] <= GOAL, **extra)
    else:
        C.emit("curriculum", 0.0, 0.0, "s", 0.0, note="needs variants a and b", **extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
