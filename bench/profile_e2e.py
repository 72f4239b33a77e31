"""Where a step of ``bench/e2e.py``'s job goes: one rank of roformer-train and of the HF Trainer under
``torch.profiler``, the same job as e2e's (2 ranks, 512 tokens, its model, batch, data and settings), and a
table of a step's time by category for both.

    python bench/profile_e2e.py                  # seq 512, 2 ranks, steps 5..7 of 8 profiled on rank 0
    python bench/profile_e2e.py --hf-config hf   # HF with DDP instead of its DeepSpeed ZeRO-2 integration
    python bench/profile_e2e.py --summarize TRACE.json --steps 3 [--vocab 8000]   # the table of one trace
    python bench/profile_e2e.py --tiny           # debug model, seq 64, 2 of 4 steps: a smoke test

ours    ``trainer.profile.start_step=K trainer.profile.steps=N`` (the trainer's profile window, rank 0,
        ``roformer_dist/observe/profiling.py``), its trace from ``run_dir/profile/trace_steps_*.json``
hf      ``bench/hf_trainer_mlm.py --profile-dir --profile-start K --profile-steps N`` (a ``TrainerCallback``
        around ``torch.profiler`` on rank 0, from the end of step K-1 to the end of step K+N-1); HF + DeepSpeed
        ZeRO-2 by default, e2e's faster HF set-up at 512 tokens

The summary reads a Chrome trace (``export_chrome_trace``): each event's *self* CPU time (its duration less
its children's on the same thread) goes to the first category that the event or one of its enclosing
events names (innermost first; ``CATEGORIES`` holds the rules), a backward function to the category of
the forward op it came from (the trace's sequence numbers), a GEMM with the vocabulary in its shapes to the
vocabulary projection (with our gather of the masked positions before it); what no rule names is "other
ops" (views, copies, elementwise arithmetic outside a named part, ours' q/k/v split). Per step = the sum over the window / N;
"outside any op" is the window's wall time per step less the ops' (waits on the other rank, Python between
ops, the profiler itself). Without shapes in a trace (``record_shapes``) the vocabulary projection counts as
linear GEMMs; HF's rotary code is labelled by the HF script, ours found by its complex arithmetic.
The profiler slows both sides (a few microseconds per op): read shares, not absolute step times.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Optional

import _common as C  # noqa: E402  (puts the checkout on sys.path, sets up DeepSpeed on CPU)

CATEGORIES = [  # (category, pattern on an event's name); first match along the chain of enclosing events wins
    ("data loading / collate", r"DataLoader|dataloader|collate"),
    ("optimizer step", r"^Optimizer\.|adam|Adam"),
    ("gradient all-reduce / ZeRO buckets", r"c10d::|gloo|nccl|record_param_comms|all_?reduce|reduce_scatter|"
                                           r"all_?gather|broadcast|barrier|AccumulateGrad"),
    ("rotary", r"(?i)rotary|rope\b|sinusoidal|view_as_complex|view_as_real|aten::complex$"),
    ("loss", r"cross_entropy|nll_loss|log_softmax|NllLoss|LogSoftmax"),
    ("attention (sdpa / matmul + softmax)", r"scaled_dot_product|ScaledDotProduct|softmax|Softmax|\bbmm\b|baddbmm|"
                                             r"BmmBackward|aten::bmm"),
    ("layer norm", r"layer_norm|LayerNorm"),
    ("dropout", r"dropout|Dropout|bernoulli"),
    ("GELU", r"gelu|Gelu"),
    ("embedding", r"embedding|Embedding"),
    # ours projects only the masked positions: their gather belongs to the vocabulary projection
    ("vocabulary projection (GEMMs; ours: + masked gather)", r"index_select|IndexSelect"),
    ("linear GEMMs (addmm / mm / linear)", r"^aten::(addmm|mm|linear|matmul|addmv|mv)$|AddmmBackward|MmBackward"),
]
GEMM = "linear GEMMs (addmm / mm / linear)"
VOCAB = "vocabulary projection (GEMMs; ours: + masked gather)"
OTHER = "other ops"
OUTSIDE = "outside any op (waits, Python, profiler)"
ORDER = [c for c, _ in CATEGORIES] + [OTHER, OUTSIDE]
_RULES = [(c, re.compile(p)) for c, p in CATEGORIES]
_BACKWARD = "autograd::engine::evaluate_function: "
STEP_MARK = re.compile(r"ProfilerStep#|optimizer_step_\d+$")
"""Markers around whole steps (torch.profiler's schedule; ``optimizer_step_<k>`` of both sides' windows)."""


def _own_category(ev: dict, vocab: Optional[int]) -> Optional[str]:
    name, args = ev["name"], ev.get("args", {})
    if any("complex" in str(t) for t in args.get("Input type", [])):
        return "rotary"  # our rotary is the only complex arithmetic in either model
    for cat, rule in _RULES:
        if rule.search(name):
            if cat == GEMM and vocab and any(vocab in d for d in args.get("Input Dims", []) if isinstance(d, list)):
                return VOCAB
            return cat
    return None


def summarize_trace(path: Path, steps: int, vocab: Optional[int] = None) -> dict:
    """{category: ms per step} of a Chrome trace over ``steps`` steps, with OUTSIDE, and "step_ms"."""
    spans = [e for e in json.loads(Path(path).read_text())["traceEvents"]
             if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    events = [e for e in spans if not STEP_MARK.match(e["name"])]  # a step marker's own time: outside any op
    by_thread = defaultdict(list)
    for e in events:
        by_thread[e["pid"], e["tid"]].append(e)
    chains: list[tuple[dict, list[dict]]] = []  # (event, its enclosing events innermost first)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                stack[-1]["_child_us"] = stack[-1].get("_child_us", 0.0) + e["dur"]
            chains.append((e, list(reversed(stack))))
            stack.append(e)
    seq_cat: dict[int, str] = {}  # forward op's sequence number -> its category (for its backward)
    resolved = []
    for e, chain in chains:
        cat = None
        for x in [e, *chain]:
            cat = _own_category(x, vocab)
            if cat is None and x["name"].startswith(_BACKWARD):
                cat = seq_cat.get(x.get("args", {}).get("Sequence number"))
            if cat is not None:
                break
        seq = e.get("args", {}).get("Sequence number")
        if seq is not None and not e["name"].startswith(_BACKWARD) and cat is not None \
                and e.get("args", {}).get("Fwd thread id", 0) == 0:
            seq_cat.setdefault(seq, cat)
        resolved.append((e, cat or OTHER))
    # the backward of a forward op seen later in the file: a second pass for the ones still "other"
    totals: dict[str, float] = defaultdict(float)
    for (e, cat), (_, chain) in zip(resolved, chains):
        if cat == OTHER:
            for x in [e, *chain]:
                if x["name"].startswith(_BACKWARD) and x.get("args", {}).get("Sequence number") in seq_cat:
                    cat = seq_cat[x["args"]["Sequence number"]]
                    break
        totals[cat] += max(0.0, e["dur"] - e.get("_child_us", 0.0))
    start = min(e["ts"] for e in spans)
    end = max(e["ts"] + e["dur"] for e in spans)
    wall_us = end - start
    out = {c: v / 1e3 / steps for c, v in totals.items()}
    out[OUTSIDE] = max(0.0, wall_us - sum(totals.values())) / 1e3 / steps
    out["step_ms"] = wall_us / 1e3 / steps
    return out


def print_summary(columns: dict[str, dict]) -> None:
    """One row per category, ms per step and % of the step for each column (``{"ours": summary, ...}``)."""
    names = list(columns)
    rows = []
    for cat in ORDER:
        if not any(cat in s for s in columns.values()):
            continue
        row = [cat]
        for n in names:
            s = columns[n]
            ms = s.get(cat, 0.0)
            row += [f"{ms:.1f}", f"{100 * ms / s['step_ms']:.1f}"]
        if len(names) == 2:
            row.append(f"{columns[names[1]].get(cat, 0.0) - columns[names[0]].get(cat, 0.0):+.1f}")
        rows.append(row)
    rows.append(["step (window / steps)", *[x for n in names for x in (f"{columns[n]['step_ms']:.1f}", "100")],
                 *([f"{columns[names[1]]['step_ms'] - columns[names[0]]['step_ms']:+.1f}"] if len(names) == 2 else [])])
    heads = ["category", *[x for n in names for x in (f"{n} ms/step", f"{n} %")]]
    C.print_table(heads + ([f"{names[1]} - {names[0]} ms"] if len(names) == 2 else []), rows)


# ----------------------------------------------------------------------------------------- the two runs

def parse_args(argv=None):
    p = C.parser(__doc__)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per run (with --summarize: the trace's)")
    p.add_argument("--profile-start", type=int, default=5, help="first profiled step (1-based)")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--hf-config", choices=("hf", "hf_ds"), default="hf_ds")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--model-preset", default="small")
    p.add_argument("--data", type=Path, default=C.REPO / "data" / "bench", help="as bench/e2e.py's --data")
    p.add_argument("--work", type=Path, default=None, help="run directories (default: a temporary directory)")
    p.add_argument("--summarize", type=Path, default=None, metavar="TRACE", help="only the table of this trace")
    p.add_argument("--vocab", type=int, default=None, help="with --summarize: the vocabulary size")
    C.tiny_defaults(p, argv, seq=64, steps=4, profile_start=2, profile_steps=2, model_preset="debug",
                    data=C.tiny_dir)
    return p.parse_args(argv)


def e2e_args(a):
    import e2e  # bench/, this script's directory, is on sys.path

    argv = ["--part", "e2e", "--seq", str(a.seq), "--steps", str(a.steps), "--skip", "1", "--rounds", "1",
            "--ranks", str(a.ranks), "--model-preset", a.model_preset, "--data", str(a.data),
            "--configs", "ours", a.hf_config, "--warmup", "1" if a.tiny else "4"]
    if a.tiny:
        argv += ["--tiny", "--global-batch", f"{a.seq}=4"]
    return e2e, e2e.parse_args(argv)


def trace_of(directory: Path) -> Optional[Path]:
    found = sorted(directory.glob("trace_steps_*.json"))
    return found[-1] if found else None


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.summarize:
        print_summary({a.summarize.stem: summarize_trace(a.summarize, a.steps, a.vocab)})
        return
    import tempfile

    C.require("accelerate", "the HF Trainer")
    e2e, ea = e2e_args(a)
    shards, hf_dir = e2e.prepare(ea)
    e2e.warm_extensions(ea)
    vocab = e2e.vocab_size(shards)
    work = a.work or (C.tiny_dir() / "runs" if a.tiny else Path(tempfile.mkdtemp(prefix="bench-profile-e2e-")))
    work.mkdir(parents=True, exist_ok=True)
    window = {"start_step": a.profile_start, "steps": a.profile_steps}
    print(f"runs in {work}; profiling steps {a.profile_start}..{a.profile_start + a.profile_steps - 1} of "
          f"{a.steps} on rank 0 of {a.ranks}, seq {a.seq}, batch {ea.batch[a.seq]}; load {C.load_average()}",
          flush=True)
    columns, notes = {}, []
    try:
        e2e.run_ours(ea, a.seq, a.ranks, shards, work / "ours", C.child_env(), trainer={"profile": window})
        trace = trace_of(work / "ours" / "profile")
        if trace is None:
            notes.append("ours: no trace in run_dir/profile/ (does this checkout's trainer have trainer.profile?)")
        else:
            columns["ours"] = summarize_trace(trace, a.profile_steps, vocab)
    except e2e.RunFailed as err:
        notes.append(f"ours: failed twice: {err}")
    model_dir = e2e.hf_model_dir(ea, work, vocab)
    try:
        e2e.run_hf(ea, a.seq, hf_dir, model_dir, work / "hf", deepspeed=a.hf_config == "hf_ds",
                   extra=("--profile-dir", str(work / "hf" / "profile"), "--profile-start", str(a.profile_start),
                          "--profile-steps", str(a.profile_steps)))
        columns[a.hf_config] = summarize_trace(trace_of(work / "hf" / "profile"), a.profile_steps, vocab)
    except e2e.RunFailed as err:
        notes.append(f"{a.hf_config}: failed twice: {err}")
    print(f"\nWhere a step goes, rank 0 of {a.ranks}, seq {a.seq}: self CPU time by category, ms per step "
          f"(traces and key_averages tables in {work}/*/profile/)")
    if columns:
        print_summary(columns)
    for n in notes:
        print(f"note: {n}")
    C.result("profile_e2e", seq=a.seq, steps=a.profile_steps, notes=notes,
             **{k: {c: round(v, 2) for c, v in s.items()} for k, s in columns.items()})


if __name__ == "__main__":
    main()
