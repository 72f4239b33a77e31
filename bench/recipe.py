"""Which parts of the 2025 encoder recipe pay at the demo's scale? Eval loss at 512 (masked at 15 %, beside the
unigram baseline) for five recipes on the demo's model, data and token budget, two seeds each.

    (a) a_today      the demo's recipe until this bench: warm-up, then linear decay; 15 % masking in every stage
    (b) b_mask30     30 % masking in every stage but the last, 15 % in the last (stages[i].mlm_probability)
    (c) c_wsd        warmup-stable-decay: the peak held, a 1-sqrt decay over the last 20 % of the steps
    (d) d_both       (b) and (c)
    (e) e_branches   one stable run (constant lr after the warm-up) and three decay branches off it
                     (``--fork CHECKPOINT --decay N``), finishing at 40 %, 70 % and 100 % of the budget: each
                     branches at 80 % of its budget and decays 1-sqrt over the last 20 %; beside them, separate
                     (c)-style runs of the 40 % and 70 % budgets (every stage's steps scaled)

Every run evaluates at its stages' eval lengths and at the final length in every stage (a branch of a small
budget ends in a short stage), with ``data.eval_mlm_probability`` 0.15, so the losses compare whatever the run
trained at; the figure is the final length's loss at the run's last step. (e) runs with the first seed only. Its
100 % branch is (c) of that seed by construction (the same steps at the peak, the same decay), and the report
checks that they end equal. With
``--ner`` (the default) the best recipe's first-seed model and (a)'s are exported and fine-tuned on the demo's
NER task (entity F1, beside random initialisation and the dictionary baseline, as ``make demo`` does).

    python bench/recipe.py                 # everything on 2 quiet cores: about 2.5 hours
    python bench/recipe.py --variants a,c --seeds 1 --no-ner
    python bench/recipe.py --tiny          # (a), (c) and (e): the debug model on tiny shards, 1 rank, 12 steps
                                           # a run (2 stages of 6), 2 seeds, no NER

Writes under OUT (default runs/recipe): a run directory per variant and seed (``a_today_s1234``, ...),
``e_stable``, ``e_branch40`` ... and ``e_separate40`` ...; ``recipe.json`` (every figure), ``recipe.png`` (final
eval loss at 512 per recipe, seeds as points; the branches against budget). A run already complete is not
trained again. The table also gives each seed's loss minus (a)'s at the same seed: runs of one seed share their
initial weights, data order and eval masks, so that difference is what the recipe alone changes. Ends with one
JSON line: ratio = (a)'s mean eval loss / the best recipe's (> 1: it beats (a)).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import _common as C  # noqa: E402  (puts the checkout on sys.path)

from roformer_dist.config import fork_overrides, to_dict  # noqa: E402

VARIANTS = {"a": "a_today", "b": "b_mask30", "c": "c_wsd", "d": "d_both", "e": "e_branches"}
WSD = ["optim.schedule=wsd", "optim.decay_fraction=0.2", "optim.decay_shape=1-sqrt"]
LINEAR = "optim.schedule=linear"
BUDGETS = (0.4, 0.7, 1.0)
"""(e): the budgets of the decay branches, as shares of the full run's steps."""
BRANCH_AT = 0.8
"""(e): a branch leaves the stable run at this share of its own budget."""
TINY_STAGES = ("curriculum.stages=[{name: s64, seq_len: 64, global_batch_size: 4, steps: 6}, "
               "{name: s128, seq_len: 128, global_batch_size: 2, steps: 6}]")


def evaluated_at(curriculum: dict, length: int) -> dict:
    """``curriculum`` (a to_dict) with ``length`` among every stage's eval lengths: a run that ends in an early
    stage (a decay branch of a small budget) is still evaluated at the final length."""
    return {**curriculum, "stages": [dict(st, eval_lengths=sorted(set(st.get("eval_lengths") or [st["seq_len"]])
                                                                   | {length})) for st in curriculum["stages"]]}


def masked_curriculum(curriculum: dict, early: float = 0.3, last: float = 0.15) -> dict:
    """``curriculum`` (a to_dict) with every stage but the last masking ``early`` and the last ``last``."""
    stages = [dict(st, mlm_probability=early) for st in curriculum["stages"]]
    stages[-1]["mlm_probability"] = last
    return {**curriculum, "stages": stages}


def scaled_curriculum(curriculum: dict, share: float) -> dict:
    """Every stage's steps times ``share`` (rounded, at least 1): a separate run of a smaller budget."""
    return {**curriculum, "stages": [dict(st, steps=max(1, round(st["steps"] * share))) for st in curriculum["stages"]]}


def branch_plan(total: int) -> list[tuple[float, int, int]]:
    """(budget share, branch step, decay steps) of each (e) branch of a ``total``-step run."""
    out = []
    for share in BUDGETS:
        budget = max(2, round(share * total))
        at = max(1, round(BRANCH_AT * budget))
        out.append((share, at, budget - at))
    return out


def final_eval(run_dir: Path, length: str) -> dict:
    from roformer_dist.demo.results import eval_results

    return eval_results(run_dir).get(length, {})


def done(run_dir: Path, steps: int) -> bool:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return False
    lines = metrics.read_text(encoding="utf-8").splitlines()
    return bool(lines) and json.loads(lines[-1]).get("step") == steps


def train(config: str, label: str, overrides: list[str], out: Path, run_dir: Path, steps: int) -> None:
    if done(run_dir, steps):
        print(f"== {label}: complete in {run_dir}, not trained again", flush=True)
        return
    C.train_run(config, [*overrides, f"run_dir={run_dir}"], label, out / f"{run_dir.name}.log")


def write_yaml(path: Path, data: dict) -> str:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return str(path)


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "spread": max(values) - min(values), "values": values}


def paired(values: list[float], baseline: list[float]) -> list[float]:
    """Each seed's loss minus the baseline's at the same seed. Runs of one seed share their initial weights, data
    order and eval masks (``trainer.seed``), so the difference leaves out what the seed alone moves."""
    return [v - b for v, b in zip(values, baseline)]


def ner_scores(config: str, overrides: list[str], run_dirs: dict[str, Path], out: Path) -> dict:
    """Each run exported to HF and fine-tuned on the demo's NER task (the demo's settings and baselines)."""
    from roformer_dist.demo.data import DataSettings, data_paths, prepare_ner, run
    from roformer_dist.demo.results import NerSettings, ner_downstream

    settings = argparse.Namespace(**vars(DataSettings()), **vars(NerSettings()))
    cfg = C.load_experiment("recipe", config, overrides)
    ner_dir = prepare_ner(data_paths(cfg), settings)
    scores = {}
    for name, run_dir in run_dirs.items():
        hf = run_dir / "hf"
        if not (hf / "config.json").exists():
            run([sys.executable, "-m", "roformer_dist.cli.convert", "to-hf", "--checkpoint", str(run_dir), "--out",
                 str(hf), "--force"])
        scores[name] = ner_downstream(ner_dir, hf, out / "ner" / name, settings)
    return scores


def ner_lines(ner: dict) -> list[str]:
    """One line per fine-tuned recipe: the entity F1 of each model (pretrained, random init, dictionary); the
    example counts beside them are left out."""
    return [f"NER ({n}), entity F1: " + ", ".join(f"{k} {v['f1']:.4f}" for k, v in scores.items()
                                                  if isinstance(v, dict)) for n, scores in ner.items()]


def plot(path: Path, table: dict, branches: list[dict], length: str) -> bool:
    from roformer_dist.observe.plots import line_plot

    series = {f"({n}) {VARIANTS[n]}": (list(range(1, len(t["values"]) + 1)), t["values"]) for n, t in table.items()}
    panels = [{"title": f"final eval loss at {length} (15 % masking), by seed", "xlabel": "seed (1, 2, ...)",
               "ylabel": "loss", "series": series}]
    if branches:
        panels.append({"title": "one stable run, decays branched off it vs separate runs", "xlabel": "budget (share "
                       "of the demo's steps)", "ylabel": "loss", "series": {
                           "decay branch": ([b["budget"] for b in branches], [b["loss"] for b in branches]),
                           "separate run": ([b["budget"] for b in branches if b.get("separate") is not None],
                                            [b["separate"] for b in branches if b.get("separate") is not None])}})
    return line_plot(path, panels)


def main(argv=None) -> int:
    p = C.parser(__doc__)
    p.add_argument("--config", default=str(C.DEMO_CONFIG), help="experiment YAML (default: the demo's)")
    p.add_argument("--out", default="runs/recipe", help="parent directory of the runs")
    p.add_argument("--variants", default="a,b,c,d,e", help="which recipes (default all five)")
    p.add_argument("--seeds", type=int, default=2, help="seeds per recipe (a)-(d): trainer.seed, +1, ... (default 2)")
    p.add_argument("--ner", action=argparse.BooleanOptionalAction, default=True,
                   help="fine-tune (a) and the best recipe on the demo's NER task (default on)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides for every run")
    C.tiny_defaults(p, argv, config=str(C.DEBUG_CONFIG), out=lambda: str(C.tiny_dir() / "recipe"), ner=False,
                    variants="a,c,e")
    args = p.parse_args(argv)
    wanted = [v for v in args.variants.split(",") if v]
    bad = [v for v in wanted if v not in VARIANTS]
    if bad or not wanted or args.seeds < 1:
        p.error(f"--variants: letters of {','.join(VARIANTS)}; --seeds >= 1 (got {args.variants!r}, {args.seeds})")
    if args.tiny:
        args.overrides = C.tiny_train_overrides(TINY_STAGES, "curriculum.tokens_per_micro_batch=256",
                                                "optim.warmup_steps=2", eval_every=None) + args.overrides
    out = Path(args.out).absolute()
    base = C.load_experiment("recipe", args.config, args.overrides)
    C.demo_data(base, args.config)
    length = str(base.curriculum.stages[-1].seq_len)
    # every rate set here: the experiment's own curriculum may mask otherwise (the demo's now does, as (d))
    curriculum = masked_curriculum(evaluated_at(to_dict(base.curriculum), int(length)), early=0.15)
    total = sum(st["steps"] for st in curriculum["stages"])
    seeds = [base.trainer.seed + k for k in range(args.seeds)]
    plain = f"curriculum={write_yaml(out / 'curricula' / 'plain.yaml', curriculum)}"
    masked = f"curriculum={write_yaml(out / 'curricula' / 'mask30.yaml', masked_curriculum(curriculum))}"
    own = {"a": [plain, LINEAR], "b": [masked, LINEAR], "c": [plain, *WSD], "d": [masked, *WSD]}
    print(f"recipe bench: {total} steps a run, eval at {length} (15 % masking), seeds {seeds}", flush=True)

    runs: dict[str, dict[int, Path]] = {}
    for n in (v for v in wanted if v != "e"):
        for seed in seeds:
            run_dir = out / f"{VARIANTS[n]}_s{seed}"
            train(args.config, f"({n}) seed {seed}", [*args.overrides, *own[n], f"trainer.seed={seed}"], out, run_dir,
                  total)
            runs.setdefault(n, {})[seed] = run_dir
    table = {}
    for n, by_seed in runs.items():
        losses = [final_eval(d, length).get("loss") for d in by_seed.values()]
        if None in losses:
            raise SystemExit(f"recipe: ({n}) has no eval at {length}; see its logs under {out}")
        unigram = statistics.fmean(final_eval(d, length).get("unigram_loss") for d in by_seed.values())
        table[n] = {**spread(losses), "unigram": unigram}   # the seeds' own (their eval masks differ)
    if "a" in table:
        for t in table.values():
            t["vs_a"] = paired(t["values"], table["a"]["values"])

    branches = []
    if "e" in wanted:
        plan = branch_plan(total)
        stable = out / "e_stable"
        points = sorted({at for _, at, _ in plan})
        every = math.gcd(*points)
        common = [*args.overrides, plain, "optim.schedule=constant", f"trainer.seed={seeds[0]}"]
        train(args.config, "(e) stable", [*common, f"trainer.save_every={every}", "checkpoint.keep_last=1000",
                                           f"trainer.stop_at_step={points[-1]}"], out, stable, points[-1])
        for share, at, decay in plan:
            tag = f"{round(share * 100)}"
            branch = out / f"e_branch{tag}"
            fork = fork_overrides(str(stable / "checkpoints" / f"step_{at:08d}"), decay, "1-sqrt")
            train(args.config, f"(e) branch {tag} %", [*common, *fork], out, branch, at + decay)
            row = {"budget": share, "branch_step": at, "decay_steps": decay,
                   "loss": final_eval(branch, length).get("loss")}
            if share < 1.0:
                separate = out / f"e_separate{tag}"
                scaled = write_yaml(out / "curricula" / f"scaled{tag}.yaml", scaled_curriculum(curriculum, share))
                steps = sum(st["steps"] for st in scaled_curriculum(curriculum, share)["stages"])
                warm = max(0, round(base.optim.warmup_steps * share))
                train(args.config, f"(e) separate {tag} %", [*args.overrides, *WSD, f"curriculum={scaled}",
                                                              f"optim.warmup_steps={warm}", f"trainer.seed={seeds[0]}"],
                      out, separate, steps)
                row["separate"] = final_eval(separate, length).get("loss")
            branches.append(row)

    print(f"\nfinal eval loss at {length} (15 % masking; nats per masked token), {len(seeds)} seed(s):")
    rows = [[f"({n}) {VARIANTS[n]}", " ".join(f"{x:.4f}" for x in t["values"]), f"{t['mean']:.4f}",
             f"{t['spread']:.4f}", f"{t['unigram']:.4f}", f"{t['unigram'] - t['mean']:+.4f}",
             " ".join(f"{x:+.4f}" for x in t.get("vs_a", []))] for n, t in table.items()]
    C.print_table(["recipe", "by seed", "mean", "spread", "unigram", "gain over unigram", "minus (a), same seed"],
                  rows)
    best = min(table, key=lambda n: table[n]["mean"]) if table else None
    if best and "a" in table:
        margin = table["a"]["mean"] - table[best]["mean"]
        noise = max(t["spread"] for t in table.values())
        print(f"best: ({best}) {VARIANTS[best]}, {margin:.4f} nats below (a); the largest seed spread is {noise:.4f}: "
              + ("it beats (a) by more than the spread" if best != "a" and margin > noise else
                 "no recipe beats (a) by more than the seed spread"))
    if branches:
        print("\n(e) decay branches off one stable run, and separate runs of the same budgets:")
        C.print_table(["budget", "branch at", "decay", "branch loss", "separate run"],
                      [[f"{b['budget']:.0%}", b["branch_step"], b["decay_steps"], f"{b['loss']:.4f}",
                        "-" if b.get("separate") is None else f"{b['separate']:.4f}"] for b in branches])
        if "c" in runs and seeds[0] in runs["c"]:
            c_loss = final_eval(runs["c"][seeds[0]], length).get("loss")
            same = branches[-1]["loss"] == c_loss
            print(f"the 100 % branch {'equals' if same else 'DIFFERS from'} (c) of seed {seeds[0]} "
                  f"({branches[-1]['loss']:.4f} vs {c_loss:.4f})")
    ner = ner_scores(args.config, args.overrides, {n: runs[n][seeds[0]] for n in sorted({"a", best}) if n in runs},
                     out) if args.ner and best else {}
    for line in ner_lines(ner):
        print(line)

    png = out / "recipe.png"
    plotted = plot(png, table, branches, length)
    report = {"bench": "recipe", "out": str(out), "config": args.config, "overrides": args.overrides, "seeds": seeds,
              "steps": total, "length": length, "table": table, "best": best, "branches": branches, "ner": ner,
              "runs": {n: {s: str(d) for s, d in by.items()} for n, by in runs.items()}}
    from data_pipeline.atomic import atomic_write_text

    atomic_write_text(out / "recipe.json", json.dumps(report, indent=2) + "\n")
    print(f"report: {out / 'recipe.json'}" + (f"; plot: {png}" if plotted else ""))
    if best and "a" in table:
        C.emit("recipe", table[best]["mean"], table["a"]["mean"], "nats", table["a"]["mean"] / table[best]["mean"],
               best=best, losses={n: t["values"] for n, t in table.items()}, branches=branches,
               minus_a={n: t["vs_a"] for n, t in table.items()})
    else:
        C.emit("recipe", 0.0, 0.0, "nats", 0.0, note="needs (a) and another recipe", branches=branches)
    return 0


if __name__ == "__main__":
    sys.exit(main())
