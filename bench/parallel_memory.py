"""Per-rank parameter bytes with tensor parallelism 2 vs 1, and the step time of each 4-rank layout.

Every layout runs on its own group of 4 gloo processes (CPU), built by
``roformer_dist.parallel.runner.build_parallel_engine`` from the same initial model, and trains ``--steps``
real steps (ZeRO-1, fp32, random MLM batches, the same global batch in every layout).

    params/rank   bytes of the parameters this rank's engine holds (unique storages of
                  ``engine.module.parameters()``; the tied vocabulary counts on both pipeline ends),
                  max over ranks
    step s        median wall time of the timed steps (after ``--warmup``), max over ranks

The JSON line compares tensor 2 (x data 2) with tensor 1 (data 4): ``ratio`` = baseline / ours.
On this machine 4 ranks share 2 cores, so step times compare layouts only roughly.

    python bench/parallel_memory.py
    python bench/parallel_memory.py --layouts 1x1 2x1 --steps 3
    python bench/parallel_memory.py --tiny              # 2 ranks, layouts 1x1 2x1 1x2, the debug model (hidden 64),
                                                        # vocab 512, seq 32, 2 steps
"""

from __future__ import annotations

import statistics
import time

import _common as C  # noqa: E402  (puts the checkout on sys.path, sets up DeepSpeed on CPU)

import torch  # noqa: E402

from roformer_dist.testing import run_distributed  # noqa: E402


def parse_args(argv=None):
    p = C.parser(__doc__)
    p.add_argument("--model", default="small", help="model preset (configs/model/)")
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--layouts", nargs="+", default=["1x1", "2x1", "1x2", "2x2"],
                   help="TENSORxPIPELINE; data = ranks / (tensor x pipeline)")
    p.add_argument("--steps", type=int, default=4)
    C.measure_flags(p, threads=1, warmup=1, threads_help="torch threads per rank")
    C.tiny_defaults(p, argv, model="debug", vocab=512, seq=32, global_batch=8, micro_batch=2, steps=2, ranks=2,
                    layouts=["1x1", "2x1", "1x2"])
    return p.parse_args(argv)


def make_config(a, tensor: int, pipeline: int):
    return C.stage_config(model=a.model, vocab=a.vocab, ranks=a.ranks, seq=a.seq, global_batch=a.global_batch,
                          micro_batch=a.micro_batch, steps=a.steps,
                          overrides=("deepspeed.zero_stage=1", f"parallel.tensor={tensor}", f"parallel.pipeline={pipeline}"))


def batches(a, dp_rank: int, dp_size: int):
    per_step = a.global_batch // a.micro_batch
    for step in range(10**6):
        for i in range(dp_rank, per_step, dp_size):
            ids, labels = C.random_mlm_batch(a.vocab, a.micro_batch, a.seq, seed=1000 * step + i)
            yield {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids),
                   "labels": labels}


def param_bytes(module: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in module.parameters():
        st = p.untyped_storage()
        key = (st.data_ptr(), p.storage_offset(), p.numel())
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    return total


def run_layout(rank: int, world_size: int, a, tensor: int, pipeline: int) -> dict:
    from roformer_dist.nn.model import RoFormerForMaskedLM
    from roformer_dist.config import stage_plans
    from roformer_dist.parallel.runner import build_parallel_engine

    C.init_rank(a.threads)
    cfg = make_config(a, tensor, pipeline)
    torch.manual_seed(0)
    model = RoFormerForMaskedLM(cfg.model)
    full_bytes = param_bytes(model)
    engine, runner = build_parallel_engine(cfg, model, stage_plans(cfg, world_size)[0], world_size)
    del model
    it = batches(a, runner.dp_rank, runner.dp_size) if runner.reads_data else None
    times, losses = [], []
    for _ in range(a.steps):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        out = runner.read_stats([runner.train_step(it)])[0]  # read each step: the time includes the device's
        times.append(time.perf_counter() - t0)
        losses.append(out.loss)
    return {"param_bytes": param_bytes(engine.module), "full_bytes": full_bytes,
            "step_s": statistics.median(times[a.warmup:] or times), "losses": losses}


def main(argv=None) -> None:
    a = parse_args(argv)
    results = {}
    for layout in a.layouts:
        t, p = (int(x) for x in layout.split("x"))
        per_rank = run_distributed(run_layout, world_size=a.ranks, args=(a, t, p), timeout=900)
        results[layout] = per_rank
        print(f"tensor {t} x pipeline {p} x data {a.ranks // (t * p)}: "
              f"{max(r['param_bytes'] for r in per_rank) / 2**20:.2f} MiB params/rank, "
              f"{max(r['step_s'] for r in per_rank):.3f} s/step, losses {[round(x, 4) for x in per_rank[0]['losses']]}",
              flush=True)
    full = results[a.layouts[0]][0]["full_bytes"]
    print(f"\nmodel {a.model}, vocab {a.vocab}: {full / 2**20:.2f} MiB of fp32 parameters; seq {a.seq}, global batch "
          f"{a.global_batch}, micro-batch {a.micro_batch}, {a.ranks} ranks, ZeRO-1 fp32")
    rows = []
    for layout, per_rank in results.items():
        t, p = (int(x) for x in layout.split("x"))
        pb = max(r["param_bytes"] for r in per_rank)
        rows.append([f"{t}", f"{p}", f"{a.ranks // (t * p)}", pb / 2**20, pb / full,
                     max(r["step_s"] for r in per_rank), per_rank[0]["losses"][-1]])
    C.print_table(["tensor", "pipeline", "data", "params MiB/rank", "x full", "step s", "last loss"], rows)
    if "1x1" in results and "2x1" in results:
        base = max(r["param_bytes"] for r in results["1x1"])
        ours = max(r["param_bytes"] for r in results["2x1"])
        print(f"tensor 2 / tensor 1 parameter bytes per rank = {ours / base:.3f} (goal <= 0.55)")
        C.emit("parallel_memory", ours, base, "bytes", base / ours, ranks=a.ranks, model=a.model,
               step_s={lay: round(max(r["step_s"] for r in pr), 4) for lay, pr in results.items()})


if __name__ == "__main__":
    main()
