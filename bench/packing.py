"""Document packing: what keeping packed documents apart costs per step, and what it changes in quality.

The loader packs documents end to end into rows; with ``data.packing=document`` the model attends
within each document only (roformer_dist/nn/documents.py: dense blocks of similar-length documents,
or a block-diagonal mask), with ``cross_document`` every token attends to its whole row.

Part ``step`` (the default): the whole training step (forward, MLM loss, backward; train mode, fp32,
``--threads`` torch threads) of the demo model at each ``--seq`` length, micro-batch ``--tokens`` //
S rows, on the same ``--batches`` real batches of the demo's training shards (document-numbered
masks) and the same weights in both modes: ``document`` (the mask as the loader gives it) and
``cross_document`` (the same rows with a 0/1 mask). Medians of interleaved repeats, warm-up
excluded, per step. Beside the times: documents per row, the form the model chose for the document
mode (blocks, dense block-diagonal mask, ...) and the attention FLOPs per step (QK^T and PV, 2 x 2 x
hidden FLOPs per query-key pair per layer, x3 for forward + backward) over the full rows (cross),
over what the document mode computes (the blocks' n x L^2; a dense mask computes the full rows) and
over the documents alone (sum of their lengths squared, the ideal).

Part ``quality``: trains the demo config twice, ``data.packing=document`` and ``=cross_document``, into
OUT/document and OUT/cross_document (``roformer-train`` runs with the same seed, data and curriculum;
a run whose final checkpoint exists is not trained again, ``--fresh`` starts over), then evaluates
both final checkpoints with ``roformer-eval`` at ``--lengths``, once with the eval rows packed
``document`` (each document attended alone: single documents) and once ``cross_document`` (each
packed row as one input: long inputs), beside the unigram baseline of the same predicted positions.

    python bench/packing.py                          # part step: 512 and 1536 tokens (demo shards)
    python bench/packing.py --seq 512,1024,1536 --repeats 5
    python bench/packing.py --part quality           # two demo-length trainings, evals at 5 lengths x 2
    python bench/packing.py --part all               # both
    python bench/packing.py --tiny                   # both parts in about a minute: debug model, tiny
                                                     # shards (temp dir), 8 steps per run, eval at 128

With the demo's default shard sets missing they are built first (as ``make demo`` does). Each part
ends with one JSON line {"bench": "packing", "part": ...}; the step part's also carries every bench's
"ours" / "baseline" / "ratio": seconds per step of document / cross_document at the longest length, and
their ratio (the speedup).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import _common as C  # noqa: E402  (puts the checkout on sys.path)

import torch  # noqa: E402

from roformer_dist.config import parse_lengths, training_sources  # noqa: E402

PACKINGS = ("document", "cross_document")
TINY_STAGE = ("curriculum.stages=[{name: s128, seq_len: 128, global_batch_size: 4, steps: 8, "
              "eval_lengths: [128]}]")
"""--tiny: one stage of 8 steps at 128 tokens, an eval of 2 batches at its end."""


def parse_args(argv=None):
    p = C.parser(__doc__)
    p.add_argument("--part", choices=("step", "quality", "all"), default="step", help="the part to run (all: both)")
    p.add_argument("--config", default=str(C.DEMO_CONFIG), help="experiment YAML of both parts (default: the demo's)")
    C.measure_flags(p, threads=2, threads_help="torch threads of the step part and of roformer-eval")
    # part step
    p.add_argument("--seq", type=parse_lengths, default=[512, 1536], metavar="S1,S2,...",
                   help="row lengths of the step part (default 512,1536)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per micro-batch: batch = tokens // S")
    p.add_argument("--shards", default=None, help="training shard set of the step part (default: the config's)")
    p.add_argument("--batches", type=int, default=4, help="batches per length, the same in both modes")
    p.add_argument("--repeats", type=int, default=3, help="timed passes over the batches per mode")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed passes over the batches per mode first (at least 1: the first gives the losses)")
    # part quality
    p.add_argument("--out", default="runs/packing", help="parent directory of the two runs")
    p.add_argument("--lengths", type=parse_lengths, default=[128, 256, 512, 1024, 1536], metavar="L1,L2,...",
                   help="eval lengths of the quality part (default 128,256,512,1024,1536)")
    p.add_argument("--fresh", action="store_true", help="delete the two runs first and train them again")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides (both parts)")
    C.tiny_defaults(p, argv, part="all", threads=1, config=str(C.DEBUG_CONFIG), seq=[128, 1024], tokens=1024,
                    batches=2, repeats=2, out=lambda: str(C.tiny_dir() / "quality"), lengths=[128])
    return p.parse_args(argv)


def load(args):
    """The config of the command line; the demo's shard sets built first when it is the demo's and they are missing."""
    cfg = C.load_experiment("packing", args.config, args.overrides)
    C.demo_data(cfg, args.config)
    return cfg


# --------------------------------------------------------------------------- part step


def form_of(mask) -> str:
    """What the layers take for a mask (roformer_dist/nn/documents.py: row_layout)."""
    from roformer_dist.nn.documents import DocumentPlan

    if mask is None:
        return "none"
    if isinstance(mask, DocumentPlan):
        return "blocks"
    return "padding mask" if mask.shape[-2] == 1 else "dense mask"


def pair_work(mask, batch: int, seq: int) -> int:
    """Query-key pairs the attention of one layer computes: the blocks' n x L^2, else the full rows."""
    from roformer_dist.nn.documents import DocumentPlan

    if isinstance(mask, DocumentPlan):
        return sum(n * L * L for n, L in (b.shape for b in mask.blocks))
    return batch * seq * seq


def attention_gflop(model_cfg, pairs: float) -> float:
    """Training GFLOPs of QK^T and PV over ``pairs`` query-key pairs per layer (x3: forward + backward)."""
    return 3 * 2 * 2 * model_cfg.hidden_size * model_cfg.num_hidden_layers * pairs / 1e9


def real_batches(shards, seq: int, batch: int, count: int) -> list[dict]:
    """The first ``count`` batches of the shard set as tensors, documents numbered in the mask."""
    from data_pipeline.loader import ShardLoader

    loader = ShardLoader(shards, seq_len=seq, micro_batch_size=batch, num_workers=0, seed=0, packing="document")
    return [{k: torch.as_tensor(v) for k, v in b.items()} for b in itertools.islice(loader, count)]


def steps_over(model, batches: list[dict], cross: bool):
    """One training step on each batch; the masks 0/1 (``cross``) or as given. Returns the first loss."""
    masks = [(b["attention_mask"] > 0).long() if cross else b["attention_mask"] for b in batches]

    def run():
        first = None
        for b, mask in zip(batches, masks):
            model.zero_grad(set_to_none=True)
            loss = model(b["input_ids"], mask, b["token_type_ids"], labels=b["labels"]).loss
            loss.backward()
            first = loss.detach() if first is None else first
        return first
    return run


def measure_length(model, shards, seq: int, args) -> dict:
    """Times, forms, documents and attention FLOPs of both modes at one length."""
    from roformer_dist.nn.documents import segments
    from roformer_dist.nn.model import layer_inputs

    batch = max(1, args.tokens // seq)
    batches = real_batches(shards, seq, batch, args.batches)
    if len(batches) < args.batches:
        raise SystemExit(f"packing: {shards} holds {len(batches)} batches of {batch} x {seq} tokens, "
                         f"{args.batches} wanted (--batches)")
    cfg = model.config
    docs, ideal, computed, forms = 0, 0.0, 0.0, Counter()
    for b in batches:
        mask = b["attention_mask"]
        _, lengths = segments(mask.numpy())
        docs += len(lengths)
        ideal += float((lengths.astype(float) ** 2).sum())
        layout = layer_inputs(cfg, model.rotary, mask, seq, mask.device).mask
        forms[form_of(layout)] += 1
        computed += pair_work(layout, len(mask), seq)
    fns = {mode: steps_over(model, batches, cross=mode == "cross_document") for mode in PACKINGS}
    losses = {mode: float(fn()) for mode, fn in fns.items()}
    bad = [m for m, v in losses.items() if not math.isfinite(v)]
    if bad:
        raise SystemExit(f"packing: the {bad[0]} step's loss at {seq} tokens is {losses[bad[0]]}")
    seconds = C.time_interleaved(fns, repeats=args.repeats, warmup=max(0, args.warmup - 1))
    n = len(batches)
    ms = {m: seconds[m] / n * 1e3 for m in PACKINGS}
    return {"seq": seq, "batch": batch, "docs_per_row": round(docs / (n * batch), 2),
            "form": " + ".join(f if len(forms) == 1 else f"{f} x{c}" for f, c in sorted(forms.items())),
            "document_ms": round(ms["document"], 2), "cross_document_ms": round(ms["cross_document"], 2),
            "speedup": round(ms["cross_document"] / ms["document"], 3),
            "attention_gflop_cross": round(attention_gflop(cfg, batch * seq * seq), 4),
            "attention_gflop_document": round(attention_gflop(cfg, computed / n), 4),
            "attention_gflop_ideal": round(attention_gflop(cfg, ideal / n), 4),
            "loss_document": round(losses["document"], 4), "loss_cross_document": round(losses["cross_document"], 4)}


def step_part(args) -> None:
    from data_pipeline.manifest import read_manifest
    from roformer_dist.nn.model import RoFormerForMaskedLM

    cfg = load(args)
    sources = training_sources(cfg.data)
    shards = args.shards or [(s.name, s.shards) for s in sources]   # a mixture: by size, as one set of it all
    sets = [args.shards] if args.shards else [s.shards for s in sources]
    for where in sets:
        if not (Path(where) / "manifest.json").exists():
            raise SystemExit(f"packing: no shard set at {where} (--shards; `make demo` builds the demo's)")
    m = cfg.model
    m = dataclasses.replace(m, vocab_size=read_manifest(sets[0])["vocab_size"],
                            max_position_embeddings=max(m.max_position_embeddings, *args.seq))
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = RoFormerForMaskedLM(m).train()
    rows = []
    for seq in args.seq:
        rows.append(measure_length(model, shards, seq, args))
        r = rows[-1]
        print(f"  S={seq}: document {r['document_ms']:.1f} ms, cross_document {r['cross_document_ms']:.1f} ms",
              flush=True)
    print(f"\ntraining step (forward, MLM loss, backward), hidden {m.hidden_size}, {m.num_hidden_layers} layers, "
          f"{m.num_attention_heads} heads, FFN {m.intermediate_size}, vocab {m.vocab_size}, fp32 cpu, "
          f"threads={torch.get_num_threads()}; {args.batches} real batches per length, ms per step (medians of "
          f"{args.repeats}); load average {C.load_average()}")
    C.print_table(["S", "B", "docs/row", "document form", "document ms", "cross ms", "speedup",
                   "attn GFLOP cross", "document", "ideal", "loss document", "loss cross"],
                  [[r["seq"], r["batch"], r["docs_per_row"], r["form"], r["document_ms"], r["cross_document_ms"],
                    f"{r['speedup']:.2f}x", r["attention_gflop_cross"], r["attention_gflop_document"],
                    r["attention_gflop_ideal"], r["loss_document"], r["loss_cross_document"]] for r in rows])
    last = rows[-1]
    C.emit("packing", last["document_ms"] / 1e3, last["cross_document_ms"] / 1e3, "s", last["speedup"],
           part="step", threads=torch.get_num_threads(), rows=rows,
           **{f"speedup_{r['seq']}": r["speedup"] for r in rows})


# --------------------------------------------------------------------------- part quality


def final_checkpoint(run_dir: Path, total: int) -> bool:
    """Whether the run holds a complete checkpoint of its last step."""
    from roformer_dist.checkpoint.store import find_resume

    found = find_resume(run_dir / "checkpoints")
    return found is not None and found.step >= total


def train(config: str, run_dir: Path, packing: str, overrides: list[str], log_path: Path) -> float:
    """One roformer-train run (resumes when run_dir has checkpoints); returns the wall time in seconds."""
    return C.train_run(config, [*overrides, f"run_dir={run_dir}", f"data.packing={packing}"], packing, log_path)


def evaluate(run_dirs: list[Path], lengths: list[int], packing: str, json_path: Path, threads: int) -> list[dict]:
    """``roformer-eval`` of the runs with the eval rows packed ``packing``; its JSON reports."""
    argv = [*map(str, run_dirs), "--lengths", ",".join(map(str, lengths)), "--packing", packing,
            "--json", str(json_path), "--threads", str(threads)]
    print(f"== roformer-eval {' '.join(argv)}", flush=True)
    code = subprocess.run([*C.EVAL, *argv], cwd=C.REPO, env=C.child_env()).returncode
    if code != 0:
        raise SystemExit(f"packing: roformer-eval failed with status {code}")
    return json.loads(json_path.read_text(encoding="utf-8"))


def quality_part(args) -> None:
    from roformer_dist.plan.curriculum import total_steps

    cfg = load(args)
    out = Path(args.out)
    total = total_steps(cfg.curriculum.stages)
    seconds = {}
    for packing in PACKINGS:
        run_dir, log = out / packing, out / f"{packing}.log"
        if args.fresh:
            shutil.rmtree(run_dir, ignore_errors=True)
            log.unlink(missing_ok=True)
        if final_checkpoint(run_dir, total):
            print(f"== {packing}: {run_dir} holds its final checkpoint (step {total}); not trained again "
                  "(--fresh trains again)", flush=True)
            seconds[packing] = None
        else:
            seconds[packing] = train(args.config, run_dir, packing, args.overrides, log)
    runs = [out / p for p in PACKINGS]
    reports = {e: evaluate(runs, args.lengths, e, out / f"eval_{e}.json", args.threads) for e in PACKINGS}
    cells = []
    for i, length in enumerate(args.lengths):
        for t, trained in enumerate(PACKINGS):
            for e in PACKINGS:
                r = reports[e][t]["rows"][i]
                cells.append({"length": length, "train": trained, "eval": e, "loss": r["loss"],
                              "unigram_loss": r["unigram_loss"], "gap": r["gap"], "note": r["note"]})
    print_quality(cells, args.lengths, seconds)
    C.result("packing", part="quality", out=str(out), train_seconds={p: s and round(s, 1) for p, s in seconds.items()},
             cells=cells)


def print_quality(cells: list[dict], lengths: list[int], seconds: dict) -> None:
    def cell(c: dict) -> str:
        return "-" if c["loss"] is None else f"{c['loss']:.4f} ({c['gap']:+.3f})"

    print("\ntraining wall time: " + ", ".join(f"{p} {'(trained before)' if s is None else f'{s:.0f} s'}"
                                               for p, s in seconds.items()))
    print("eval loss (gap to the unigram baseline; higher gap is better), trained x eval packing:")
    heads = [f"train {t} / eval {e}" for t in PACKINGS for e in PACKINGS]
    rows = []
    for length in lengths:
        at = [c for c in cells if c["length"] == length]
        rows.append([length, at[0]["unigram_loss"], *(cell(c) for c in at)])
    C.print_table(["length", "unigram", *heads], rows)


def main(argv=None) -> None:
    args = parse_args(argv)
    C.torch_setup()
    if args.tiny:
        args.overrides = C.tiny_train_overrides(TINY_STAGE, log_every=4) + args.overrides
    if args.part in ("step", "all"):
        step_part(args)
    if args.part in ("quality", "all"):
        quality_part(args)


if __name__ == "__main__":
    main()
