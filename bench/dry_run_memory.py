"""The dry run's memory estimate against the measured peak of real DeepSpeed steps on CPU.

For each model preset and ZeRO stage, ``--ranks`` gloo processes build the engine as the trainer builds it
(``parallel/engine.build_engine``) and train ``--steps`` steps on packed rows (documents of random lengths,
numbered in the attention mask as the loader's ``data.packing: document`` numbers them; 15 % of tokens
predicted). ``torch.profiler``'s memory events count every byte torch allocates in a rank from before
the model is built to the end: the running sum's maximum is the measured peak (the CPU's counterpart of
``torch.cuda.max_memory_allocated``: weights, gradients, optimizer state, DeepSpeed's buckets and the
activations). Beside it, ``roformer_dist.launch.memory_estimate.estimate_stage`` for the same config,
computed from the config alone. Ratios are estimate / measured, the worst rank's peak; "less the bucket"
takes DeepSpeed's ``reduce_bucket_size`` scratch buffer (known exactly, and most of the total for these
small models) out of both, so that the rest of the estimate is checked too.

    python bench/dry_run_memory.py                    # debug and demo models, ZeRO-1 and ZeRO-2, 2 ranks
    python bench/dry_run_memory.py --tiny             # the debug model only
"""

from __future__ import annotations

import _common as C  # noqa: E402  (puts the checkout on sys.path, sets up DeepSpeed on CPU)

import torch  # noqa: E402

from roformer_dist.testing import run_distributed  # noqa: E402

TOLERANCE = 0.15
"""The estimate is within this fraction of the measured peak (the dry run's promise on CPU)."""


def parse_args(argv=None):
    p = C.parser(__doc__)
    p.add_argument("--models", nargs="+", default=["debug", "demo"], help="model presets (configs/model/)")
    p.add_argument("--zero", type=int, nargs="+", default=[1, 2], help="ZeRO stages")
    p.add_argument("--vocab", type=int, default=5000)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    C.tiny_defaults(p, argv, models=["debug"])
    return p.parse_args(argv)


def packed_batch(vocab: int, batch: int, seq: int, seed: int):
    """(input_ids, attention_mask numbering documents 1, 2, ..., labels): rows of documents of 16 to seq/2
    tokens."""
    ids, labels = C.random_mlm_batch(vocab, batch, seq, seed)
    g = torch.Generator().manual_seed(seed + 1)
    mask = torch.zeros(batch, seq, dtype=torch.int64)
    for row in range(batch):
        pos, doc = 0, 1
        while pos < seq:
            n = int(torch.randint(16, max(17, seq // 2), (1,), generator=g))
            mask[row, pos:pos + n] = doc
            pos, doc = pos + n, doc + 1
    return ids, mask, labels


def config(a, model: str, zero: int):
    return C.stage_config(model=model, vocab=a.vocab, ranks=a.ranks, seq=a.seq, global_batch=a.micro_batch * a.ranks,
                          micro_batch=a.micro_batch, steps=a.steps,
                          overrides=(f"deepspeed.zero_stage={zero}", "data.packing=document", "optim.lr=1e-4"))


def measured_peak(prof) -> int:
    """The maximum of the running sum of the profiler's CPU memory events (bytes allocated while it ran)."""
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def run_case(rank: int, world_size: int, a, model: str, zero: int) -> int:
    from roformer_dist.config import stage_plans
    from roformer_dist.nn.model import RoFormerForMaskedLM
    from roformer_dist.parallel.engine import build_engine

    C.init_rank(1)
    cfg = config(a, model, zero)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(0)
        engine = build_engine(cfg, RoFormerForMaskedLM(cfg.model), stage_plans(cfg, world_size)[0])
        for step in range(a.steps):
            ids, mask, labels = packed_batch(a.vocab, a.micro_batch, a.seq, seed=100 * step + rank)
            engine.backward(engine(input_ids=ids, attention_mask=mask, labels=labels).loss)
            engine.step()
    return measured_peak(prof)


def main(argv=None) -> None:
    from roformer_dist.config import stage_plans
    from roformer_dist.launch.memory_estimate import estimate_stage, format_bytes

    a = parse_args(argv)
    rows, worst = [], 0.0
    for model in a.models:
        for zero in a.zero:
            measured = max(run_distributed(run_case, world_size=a.ranks, args=(a, model, zero), timeout=900))
            cfg = config(a, model, zero)
            est = estimate_stage(cfg, stage_plans(cfg)[0], device="cpu")
            ratio = est.total / measured
            rest = (est.total - est.buckets) / (measured - est.buckets) if measured > est.buckets else float("nan")
            worst = max(worst, abs(ratio - 1), abs(rest - 1))
            rows.append([model, f"ZeRO-{zero}", f"{est.parameters / 1e6:.2f} M", format_bytes(est.states),
                         format_bytes(est.buckets), format_bytes(est.activations), format_bytes(est.total),
                         format_bytes(measured), f"{ratio:.3f}", f"{rest:.3f}"])
            print(f"{model} ZeRO-{zero}: estimate {format_bytes(est.total)}, measured {format_bytes(measured)}",
                  flush=True)
    print(f"\n{a.ranks} ranks, fp32, seq {a.seq}, micro-batch {a.micro_batch}, vocab {a.vocab}, packed documents, "
          f"AdamW; per rank, the worst rank's peak")
    C.print_table(["model", "ZeRO", "params", "states est.", "bucket est.", "activations est.", "estimate",
                   "measured peak", "est./measured", "less the bucket"], rows)
    verdict = "within" if worst <= TOLERANCE else "NOT within"
    print(f"largest deviation {worst:.1%}: {verdict} {TOLERANCE:.0%}")
    C.result("dry_run_memory", worst_deviation=round(worst, 4), tolerance=TOLERANCE, ok=worst <= TOLERANCE)


if __name__ == "__main__":
    main()
