"""``roformer-finetune`` (its parser and :func:`run`): fine-tune and evaluate a sequence classifier (single
sentences or sentence pairs) or, with ``--task token``, a token classifier (named entities, BIO tags).

    roformer-finetune --model runs/demo/hf --train train.jsonl --dev dev.jsonl --out runs/sst
    roformer-finetune --model runs/demo/checkpoints --train ... --dev ... --out ...       # a training checkpoint
    roformer-finetune --model runs/demo/hf --from-scratch ...       # same architecture, random initialisation
    roformer-finetune --model runs/demo/hf --pooling mean ...       # head on the mean state, not [CLS]
    roformer-finetune --baseline ngram --train ... --dev ... --out ...   # naive Bayes on character 1-2-grams
    roformer-finetune --task token --model runs/demo/hf --train ner_train.jsonl --dev ner_dev.jsonl --out runs/ner
    roformer-finetune --task token --baseline dict ...              # longest match of the training entities

Sentence tasks. Input: jsonl ``{"sentence", "label"}`` / ``{"sentence1", "sentence2", "label"}`` or tsv
with a header row (see roformer_dist/finetune/data.py). Prints dev accuracy and macro-F1 after every epoch
and, last, ``dev accuracy X.XXXX  macro-F1 Y.YYYY  (best epoch N)``.

Token task. Input: jsonl ``{"tokens", "tags"}`` (BIO) or ``{"text", "entities": [{"start", "end",
"label"}]}`` (character spans), or CoNLL columns (see roformer_dist/finetune/token_data.py). Each
SentencePiece piece gets a BIO tag through its character offsets; predictions are decoded back to
character spans and scored as entities (exact span and type; micro-averaged precision, recall, F1, and
per type). Pieces that straddle an entity boundary and entities no piece boundary can express are
counted and printed. Prints ``dev entity F1 X.XXXX  precision P.PPPP  recall R.RRRR  (best epoch N)``.

Writes OUT_DIR/results.json (every epoch's record; the best epoch and the last one), OUT_DIR/best/ (the
best epoch's model with its tokenizer: HF format, loadable with AutoModelForSequenceClassification or
AutoModelForTokenClassification and AutoTokenizer; with --pooling mean or a model HF cannot express,
classifier.pt for roformer_dist.finetune.models.load_native_classifier) and OUT_DIR/tb/ (TensorBoard:
train/loss, train/lr, dev/<score>). An existing OUT_DIR is reused: those three are replaced.

Exit status: 0 done, 2 bad flags (ConfigError), 4 bad input files (DataError), 5 model or checkpoint
missing or unreadable (CheckpointError), 74 the output cannot be written (disk full, read-only).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Optional

import torch

from roformer_dist.errors import ConfigError
from roformer_dist.finetune.data import encode_labels, label_list, read_examples
from roformer_dist.finetune.dictionary import Dictionary
from roformer_dist.finetune.entities import bio_labels, entity_scores
from roformer_dist.finetune.metrics import accuracy, macro_f1
from roformer_dist.finetune.models import describe, load_classifier, write_json
from roformer_dist.finetune.ngram import NaiveBayes
from roformer_dist.finetune.tasks import SequenceTask, TokenTask, encode, encode_token_examples
from roformer_dist.finetune.token_data import entity_types, read_token_examples
from roformer_dist.finetune.train import Dist, default_threads, fit
from roformer_dist.runtime.process_group import DistEnv, init_process_group

__all__ = ["build_parser", "run"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="roformer-finetune",
                                description="Fine-tune and evaluate a sequence classifier (single sentences "
                                            "or sentence pairs) or a token classifier (named entities) on a "
                                            "pretrained RoFormer.",
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF export directory, training checkpoint (step_XXXXXXXX/, checkpoints/ or "
                                   "run directory) or weights file; not needed with --baseline")
    p.add_argument("--task", choices=["sequence", "token"], default="sequence",
                   help="sequence: a label per sentence or sentence pair (single or pair: read from the data); "
                        "token: a BIO tag per token, scored as entities")
    p.add_argument("--train", required=True, help="training examples (sequence: .jsonl, or .tsv with a header "
                                                  "row; token: .jsonl or CoNLL columns)")
    p.add_argument("--dev", required=True, help="dev examples, evaluated after every epoch")
    p.add_argument("--out", required=True, help="output directory (results.json, best/, tb/)")
    p.add_argument("--from-scratch", action="store_true",
                   help="the same architecture from random initialisation (what pretraining buys)")
    p.add_argument("--pooling", choices=["cls", "mean"], default="cls",
                   help="what the classification head reads: cls, the [CLS] state (HF's "
                        "RoFormerForSequenceClassification; best/ in HF format); mean, the mean of the non-padding "
                        "states (MLM pretraining trains every token's output, never the [CLS] one; our encoder, "
                        "best/classifier.pt)")
    p.add_argument("--baseline", choices=["ngram", "dict"], default=None,
                   help="ngram (sequence task): multinomial naive Bayes on character unigrams + bigrams (add-one "
                        "smoothing); dict (token task): longest match of the training entities")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=5e-5, help="peak learning rate (10%% linear warm-up, linear decay)")
    p.add_argument("--batch-size", type=int, default=32, help="examples per optimizer step (per rank)")
    p.add_argument("--max-length", type=int, default=128, help="tokens per example incl. [CLS]/[SEP]; longer "
                                                                "examples are truncated (and counted)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: all cores, divided among the ranks under torchrun)")
    p.add_argument("--tokenizer", default=None,
                   help="SentencePiece .model or shard set, for a checkpoint whose shard set moved or a "
                        "weights file (default: the model's own)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where to train: auto = CUDA when a GPU is visible, else CPU (default); under torchrun, "
                        "cuda puts each rank on its local GPU over NCCL")
    return p


def _check_args(args) -> None:
    if args.baseline is None and not args.model:
        raise ConfigError("--model is required (an HF export, a training checkpoint or a weights file) unless "
                          "--baseline ngram (sequence task) or dict (token task)")
    want = {"sequence": "ngram", "token": "dict"}[args.task]
    if args.baseline is not None and args.baseline != want:
        raise ConfigError(f"--baseline {args.baseline} does not apply to --task {args.task} (its baseline: {want})")
    if args.task == "token" and args.pooling != "cls":
        raise ConfigError("--pooling applies to sentence tasks: a token classifier reads every token's state")
    if args.baseline is not None and args.from_scratch:
        raise ConfigError("--from-scratch and --baseline exclude each other")
    for name, ok in (("epochs", args.epochs >= 1), ("batch_size", args.batch_size >= 1),
                     ("lr", args.lr > 0), ("max_length", args.max_length >= 4)):
        if not ok:
            raise ConfigError(f"--{name.replace('_', '-')}: got {getattr(args, name)}, expected "
                              f"{'> 0' if name == 'lr' else '>= 4' if name == 'max_length' else '>= 1'}")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads: got {args.threads}, expected >= 1")


def _dist_setup(device_kind: str) -> tuple[Dist, "torch.device"]:
    """Dist for this process; joins the process group (the project's one bootstrap) when launched by
    torchrun with WORLD_SIZE > 1."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Dist(), torch.device(device_kind if device_kind != "cuda" else "cuda:0")
    env = DistEnv.from_environ()
    init_process_group(env, "nccl" if device_kind == "cuda" else "gloo")
    device = torch.device(f"cuda:{env.local_rank}") if device_kind == "cuda" else torch.device("cpu")
    return Dist(env.rank, env.world_size), device


def _results(task, labels, train, dev, records, selects, *, truncated, model, from_scratch, baseline,
             extra) -> dict:
    """results.json: every epoch's record, and the best (by ``selects``, then the earliest) and the last
    epoch's dev scores as ``best_<score>`` / ``last_<score>``."""
    best = max(records, key=lambda r: (*[r[k] for k in selects], -r["epoch"]))
    scores = [k for k in records[-1] if k.startswith("dev_")]
    return {"task": task, "num_labels": len(labels), "labels": list(labels), "train_examples": len(train),
            "dev_examples": len(dev), "truncated": truncated, "epochs": records, "best_epoch": best["epoch"],
            **{f"best_{k}": best[k] for k in scores}, **{f"last_{k}": records[-1][k] for k in scores},
            "model": model, "from_scratch": from_scratch, "baseline": baseline, **extra}


def _final_line(task, res: dict) -> str:
    best = {k[5:]: v for k, v in res.items() if k.startswith("best_dev_")}
    return f"{task.describe(best)}  (best epoch {res['best_epoch']})"


def _per_label_lines(per_label: dict) -> list[str]:
    return [f"  {label}: F1 {s['f1']:.4f}  precision {s['precision']:.4f}  recall {s['recall']:.4f}  "
            f"({s['gold']} gold, {s['predicted']} predicted, {s['correct']} correct)" for label, s in per_label.items()]


def _run_baseline(args, train, dev, labels, out: Path, say) -> dict:
    t0 = time.perf_counter()
    if args.baseline == "dict":
        d = Dictionary().fit((e.text, e.spans) for e in train.examples)
        s = entity_scores([e.spans for e in dev.examples], [d.tag(e.text) for e in dev.examples])
        rec = {"epoch": 1, "dev_f1": s["f1"], "dev_precision": s["precision"], "dev_recall": s["recall"],
               "dev_per_label": s["per_label"], "seconds": round(time.perf_counter() - t0, 2)}
        model, extra, task = "longest match of the training entities", {"dictionary_entries": len(d)}, TokenTask
        say(f"dictionary of {len(d):,} training entity strings: {task.describe(rec)}  ({rec['seconds']:.1f} s)")
    else:
        y_train, y_dev = encode_labels(train, labels), encode_labels(dev, labels)
        pairs = lambda ds: [(e.text_a, e.text_b) for e in ds.examples]  # noqa: E731
        nb = NaiveBayes().fit(pairs(train), y_train, len(labels))
        pred = nb.predict(pairs(dev))
        rec = {"epoch": 1, "dev_accuracy": accuracy(y_dev, pred), "dev_macro_f1": macro_f1(y_dev, pred),
               "train_loss": nb.mean_nll(pairs(train), y_train), "seconds": round(time.perf_counter() - t0, 2)}
        model, extra, task = "naive Bayes, character unigrams + bigrams, add-one smoothing", {}, SequenceTask
        say(f"naive Bayes on character unigrams + bigrams: {len(nb.vocab):,} features; {task.describe(rec)}  "
            f"({rec['seconds']:.1f} s)")
    res = _results(train.task, labels, train, dev, [rec], task.selects, truncated=0, model=model,
                   from_scratch=False, baseline=args.baseline, extra=extra)
    write_json(out / "results.json", res)
    return res


def _read(args) -> tuple:
    """(train, dev, labels): the datasets of the task and its labels (BIO tags for the token task)."""
    if args.task == "token":
        train, dev = read_token_examples(args.train), read_token_examples(args.dev)
        types, unseen = entity_types(train, dev)
        for label, line in unseen.items():
            n = sum(s.label == label for e in dev.examples for s in e.spans)
            print(f"{dev.path}:{line}: entity type {label!r} does not occur in {train.path} (its types: "
                  f"{', '.join(types)}): its {n} dev entities are scored as missed")
        return train, dev, bio_labels(types)
    train, dev = read_examples(args.train), read_examples(args.dev)
    return train, dev, label_list(train, dev)


def _describe_data(train, dev, labels) -> str:
    if train.task == "token":
        types = ", ".join(t[2:] for t in labels[1::2])
        return (f"token task, {(len(labels) - 1) // 2} entity types ({types}); {len(train)} "
                f"training sentences ({train.num_entities} entities), {len(dev)} dev sentences "
                f"({dev.num_entities} entities)")
    return f"{train.task} task, {len(labels)} labels; {len(train)} training and {len(dev)} dev examples"


def run(argv: Optional[list[str]] = None) -> dict:
    """Run roformer-finetune with command-line ``argv``; returns the content of results.json.

    Raises ConfigError / DataError / CheckpointError (see the exit statuses) on bad input."""
    args = build_parser().parse_args(argv)
    _check_args(args)
    train, dev, labels = _read(args)
    out = Path(args.out)
    say = print
    if args.baseline is not None:
        out.mkdir(parents=True, exist_ok=True)
        say(_describe_data(train, dev, labels))
        res = _run_baseline(args, train, dev, labels, out, say)
        say(_final_line(TokenTask if args.task == "token" else SequenceTask, res))
        for line in _per_label_lines(res.get("best_dev_per_label", {})):
            say(line)
        return res
    return _run_model(args, train, dev, labels, out)


def _run_model(args, train, dev, labels, out: Path) -> dict:
    device_kind = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device_kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    dist, device = _dist_setup(device_kind)
    threads = args.threads or (default_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
                               if dist.world_size > 1 else None)
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _train_and_report(args, train, dev, labels, out, dist, device)
    finally:
        torch.set_num_threads(before)  # run() may be called in-process (the demo): leave torch as it was


def _encode(args, clf, train, dev, labels, say) -> tuple:
    """(task, encoded train, encoded dev, extra results) of the datasets under the classifier's tokenizer."""
    if args.task == "token":
        enc_train, al_train = encode_token_examples(clf.tokenizer, train.examples, labels, args.max_length)
        enc_dev, al_dev = encode_token_examples(clf.tokenizer, dev.examples, labels, args.max_length)
        task = TokenTask(al_dev, [e.spans for e in dev.examples], labels)
        extra = {}
        for name, ds, al in (("train", train, al_train), ("dev", dev, al_dev)):
            extra[name] = {k: sum(getattr(a, k) for a in al) for k in
                           ("crossing_pieces", "unreachable", "truncated_entities")}
            c = extra[name]
            if c["crossing_pieces"] or c["unreachable"]:
                say(f"{ds.path}: {c['crossing_pieces']} pieces straddle an entity boundary; {c['unreachable']} of "
                    f"{ds.num_entities} entities have a boundary inside a piece"
                    + (" (scored as missed: no tagging of the pieces gives their span)" if name == "dev" else ""))
            if c["truncated_entities"]:
                say(f"{ds.path}: {c['truncated_entities']} entities lie past --max-length {args.max_length}"
                    + (" (scored as missed)" if name == "dev" else " (not trained on)"))
        return task, enc_train, enc_dev, {"alignment": extra}
    enc_train = encode(clf.tokenizer, train.examples, encode_labels(train, labels), args.max_length)
    enc_dev = encode(clf.tokenizer, dev.examples, encode_labels(dev, labels), args.max_length)
    return SequenceTask(enc_dev), enc_train, enc_dev, {"pooling": args.pooling}


def _train_and_report(args, train, dev, labels, out: Path, dist, device) -> dict:
    say = print if dist.main else (lambda *_: None)
    _quiet_transformers()
    clf = load_classifier(args.model, labels, from_scratch=args.from_scratch, seed=args.seed,
                          tokenizer=args.tokenizer, pooling=args.pooling, head=args.task)
    if args.max_length > clf.max_positions:
        raise ConfigError(f"--max-length {args.max_length}: the model has {clf.max_positions} positions")
    say(f"model: {describe(clf)}{' (from scratch: random initialisation)' if args.from_scratch else ''}")
    say(f"{_describe_data(train, dev, labels)}; {dist.world_size} process(es), {torch.get_num_threads()} "
        f"threads each, {device}")
    task, enc_train, enc_dev, task_extra = _encode(args, clf, train, dev, labels, say)
    for ds, enc in ((train, enc_train), (dev, enc_dev)):
        if enc.num_truncated:
            say(f"{ds.path}: {enc.num_truncated} of {len(ds)} examples are longer than --max-length "
                f"{args.max_length} tokens and were truncated")
    truncated = enc_train.num_truncated + enc_dev.num_truncated
    if dist.main:
        out.mkdir(parents=True, exist_ok=True)
    common = dict(truncated=truncated, model=str(args.model), from_scratch=args.from_scratch, baseline=None,
                  extra={"backend": clf.backend, **task_extra, "max_length": args.max_length,
                         "lr": args.lr, "batch_size": args.batch_size, "seed": args.seed})
    records: list[dict] = []

    def on_epoch(rec: dict) -> None:  # results.json after every epoch: a long run shows its progress
        records.append(rec)
        write_json(out / "results.json", _results(train.task, labels, train, dev, records, task.selects, **common))

    records_all = fit(clf, task, enc_train, enc_dev, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
                      seed=args.seed, out_dir=out, device=device, dist=dist, progress=not args.no_progress,
                      on_epoch=on_epoch, say=say)
    res = _results(train.task, labels, train, dev, records_all, task.selects, **common)
    if dist.main:
        write_json(out / "results.json", res)
    say(f"best model: {out / 'best'}")
    say(_final_line(task, res))
    for line in _per_label_lines(res.get("best_dev_per_label", {})):
        say(line)
    if dist.world_size > 1:
        torch.distributed.barrier()
    return res


def _quiet_transformers() -> None:
    """transformers warns that the new classification head is not initialised from the checkpoint:
    that is the point of fine-tuning; our own line says what was loaded."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
