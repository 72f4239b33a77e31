"""Per-rank model-state memory (parameters + gradients + optimizer state) of ZeRO 0/1/2/3, and tokens/s.

Each ZeRO stage runs on its own group of ``--ranks`` gloo processes (CPU), built exactly as the trainer
builds it (``roformer_dist.parallel.engine.build_engine``), and trains ``--steps`` real steps on random MLM
batches. After the last backward (gradients live, optimizer state initialised, before the update)
every rank measures the tensors its engine actually holds:

    params      storages behind the module's parameters (``p.data``; ZeRO-3: each ``p.ds_tensor``
                shard) and ZeRO's flat low-precision buffers (``bit16_groups_flat``,
                ``fp16_partitioned_groups_flat``)
    grads       ``p.grad``, ZeRO's averaged gradients (``averaged_gradients``, ``grads_in_partition``,
                ZeRO-3's ``grad_partitions_flat_buffer``) and any ``.grad`` of the fp32 partitions
    optimizer   fp32 master weights or their partitions (``single_partition_of_fp32_groups`` /
                ``fp32_partitioned_groups_flat``; ZeRO-0 in bf16: ``fp32_groups``) + the inner
                optimizer's state (Adam moments, step)

Tensors are counted by *storage* (a view into a flat buffer counts the buffer once; a storage that two
categories share is counted in the first: params, grads, optimizer). Note: DeepSpeed 0.19.8's ZeRO-3
means to reuse the parameter shard as the fp32 master when dtype and device match, but it compares
``tensor.device == "cpu"`` (a torch.device with a str: always False), so fp32 ZeRO-3 keeps a second
copy (``fp32_partitioned_groups_flat``); it is real memory and is counted. Communication buckets
(``ipg_buckets``: ``reduce_bucket_size`` elements, allocated with ``torch.empty``) are reported in a
separate column and not in the total: they are scratch space sized by a config knob, not model state.
Any other tensor the ZeRO optimizer holds is listed as "other" so that nothing is silently skipped.

tokens/s per rank = micro-batch x seq_len x accumulation / median step time of the timed steps
(includes the collectives; 2 ranks share this machine's cores, so it is a relative figure).

    python bench/zero_memory.py                       # small model (hidden 256, 4 layers), vocab 8000, seq 128
    python bench/zero_memory.py --stages 0 3 --steps 4
    python bench/zero_memory.py --tiny                # ZeRO 0 and 3 (the JSON line's pair), the debug model
                                                      # (hidden 64), vocab 512, seq 32, 3 steps
"""

from __future__ import annotations

import statistics
import time

import _common as C  # noqa: E402  (puts the checkout on sys.path, sets up DeepSpeed on CPU)

import torch  # noqa: E402

from roformer_dist.testing import run_distributed  # noqa: E402

CATEGORIES = ("params", "grads", "optimizer")

# Attributes of DeepSpeed's optimizer wrappers by category (stage 1/2: DeepSpeedZeroOptimizer; stage 3:
# DeepSpeedZeroOptimizer_Stage3; stage 0 + bf16: FP16_UnfusedOptimizer (``fp32_groups``: its fp32 master
# copies) or BF16_Optimizer)
ZERO_ATTRS = {
    "params": ("bit16_groups_flat", "fp16_partitioned_groups_flat", "lp_param_buffer",
               "parallel_partitioned_bit16_groups", "bf16_groups_flat", "bf16_partitioned_groups"),
    "grads": ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer",
              "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", "fp32_groups_gradients_flat",
              "fp32_groups_gradients", "fp32_groups_actual_gradients_flat", "fp32_groups_gradient_flat_partition"),
    "optimizer": ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition",
                  "fp32_groups"),
}
BUFFER_ATTRS = ("ipg_buckets",)


def parse_args(argv=None):
    p = C.parser(__doc__)
    p.add_argument("--model", default="small", help="model preset (configs/model/)")
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=5, help="training steps per stage (the first 2 are not timed)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    C.measure_flags(p, threads=1, threads_help="torch threads per rank")
    C.tiny_defaults(p, argv, model="debug", vocab=512, seq=32, micro_batch=2, steps=3, stages=[0, 3])
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------- measuring

def _tensors(obj, depth: int = 3):
    """Tensors inside nested lists / tuples / dicts."""
    if torch.is_tensor(obj):
        yield obj
    elif depth > 0 and isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, depth - 1)
    elif depth > 0 and isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, depth - 1)


class _Ledger:
    """Counts each storage once, in the first category that claims it."""

    def __init__(self):
        self.seen: set[int] = set()
        self.bytes: dict[str, int] = {}

    def add(self, category: str, tensors) -> None:
        for t in tensors:
            if t is None or not torch.is_tensor(t):
                continue
            if t.device.type == "meta":  # shape-only bookkeeping (round_robin_bit16_meta), no memory
                continue
            st = t.untyped_storage()
            n = st.nbytes()
            if n == 0 or st.data_ptr() in self.seen:
                continue
            self.seen.add(st.data_ptr())
            self.bytes[category] = self.bytes.get(category, 0) + n


def measure_model_state(engine) -> dict:
    """Bytes this rank holds for params / grads / optimizer (see the module docstring), plus
    ``buffers`` (communication buckets, not in ``total``) and ``other`` ({attribute: bytes})."""
    ledger = _Ledger()
    module_params = list(engine.module.parameters())
    opt = engine.optimizer
    # any DeepSpeed wrapper around the torch optimizer (every tensor it holds is counted or listed as "other")
    zero = opt if isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer) else None
    inner = zero.optimizer if zero is not None else opt

    ledger.add("params", (p.data for p in module_params))
    ledger.add("params", (getattr(p, "ds_tensor", None) for p in module_params))
    if zero is not None:
        ledger.add("params", (t for a in ZERO_ATTRS["params"] for t in _tensors(getattr(zero, a, None))))
    ledger.add("grads", (p.grad for p in module_params))
    if zero is not None:
        ledger.add("grads", (t for a in ZERO_ATTRS["grads"] for t in _tensors(getattr(zero, a, None))))
        ledger.add("grads", (t.grad for a in ZERO_ATTRS["optimizer"] for t in _tensors(getattr(zero, a, None))))
        ledger.add("optimizer", (t for a in ZERO_ATTRS["optimizer"] for t in _tensors(getattr(zero, a, None))))
    ledger.add("optimizer", (v for st in inner.state.values() for v in st.values() if torch.is_tensor(v)))
    out = {c: ledger.bytes.get(c, 0) for c in CATEGORIES}
    out["total"] = sum(out[c] for c in CATEGORIES)

    buffers, other = 0, {}
    if zero is not None:
        for a in BUFFER_ATTRS:
            for bucket in (getattr(zero, a, None) or {}).values():
                for t in _tensors(getattr(bucket, "buffer", None)):
                    if t.untyped_storage().data_ptr() not in ledger.seen:
                        ledger.seen.add(t.untyped_storage().data_ptr())
                        buffers += t.untyped_storage().nbytes()
        known = {a for attrs in ZERO_ATTRS.values() for a in attrs} | set(BUFFER_ATTRS)
        for name, val in vars(zero).items():
            if name in known:
                continue
            n = 0
            for t in _tensors(val):
                if t.device.type == "meta":
                    continue
                st = t.untyped_storage()
                if st.nbytes() and st.data_ptr() not in ledger.seen:
                    ledger.seen.add(st.data_ptr())
                    n += st.nbytes()
            if n:
                other[name] = n
    out["buffers"] = buffers
    out["other"] = other
    return out


# ----------------------------------------------------------------------------------------- one stage

def make_config(a, zero_stage: int):
    return C.stage_config(model=a.model, vocab=a.vocab, ranks=a.ranks, seq=a.seq, global_batch=a.micro_batch * a.ranks,
                          micro_batch=a.micro_batch, steps=a.steps,
                          overrides=(f"deepspeed.zero_stage={zero_stage}", f"deepspeed.precision={a.precision}",
                                     "optim.lr=1e-4"))


def run_stage(rank: int, world_size: int, a, zero_stage: int) -> dict:
    from roformer_dist.config import stage_plans
    from roformer_dist.parallel.engine import build_engine
    from roformer_dist.nn.model import RoFormerForMaskedLM

    C.init_rank(a.threads)
    cfg = make_config(a, zero_stage)
    torch.manual_seed(0)
    model = RoFormerForMaskedLM(cfg.model)
    num_params = model.num_parameters()
    engine = build_engine(cfg, model, stage_plans(cfg, world_size)[0])
    gas = engine.gradient_accumulation_steps()
    losses, times, mem = [], [], None
    for step in range(a.steps):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        for micro in range(gas):
            ids, labels = C.random_mlm_batch(a.vocab, a.micro_batch, a.seq, seed=1000 * (step * gas + micro) + rank)
            loss = engine(input_ids=ids, labels=labels).loss
            engine.backward(loss)
            if step == a.steps - 1 and micro == gas - 1:
                t_pause = time.perf_counter()
                mem = measure_model_state(engine)  # gradients live, optimizer state initialised
                t0 += time.perf_counter() - t_pause
            engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    timed = times[2:] or times
    return {"mem": mem, "losses": losses, "step_s": statistics.median(timed), "num_params": num_params,
            "tokens_per_step": a.micro_batch * a.seq * gas}


def main(argv=None) -> None:
    a = parse_args(argv)
    results = {}
    for stage in a.stages:
        per_rank = run_distributed(run_stage, world_size=a.ranks, args=(a, stage), timeout=900)
        results[stage] = per_rank
        r0 = per_rank[0]
        print(f"ZeRO-{stage}: rank0 {r0['mem']['total'] / 2**20:.2f} MiB, {r0['tokens_per_step'] / r0['step_s']:.0f} "
              f"tok/s, losses {[round(x, 4) for x in r0['losses']]}", flush=True)

    n = results[a.stages[0]][0]["num_params"]
    print(f"\nmodel {a.model}: {n / 1e6:.2f} M parameters ({4 * n / 2**20:.2f} MiB fp32), vocab {a.vocab}, "
          f"seq {a.seq}, micro-batch {a.micro_batch}, {a.ranks} ranks, {a.precision}, AdamW; bytes are the max over ranks")
    rows = []
    for stage, per_rank in results.items():
        worst = max(per_rank, key=lambda r: r["mem"]["total"])["mem"]
        tps = statistics.mean(r["tokens_per_step"] / r["step_s"] for r in per_rank)
        rows.append([f"ZeRO-{stage}", worst["params"] / n, worst["grads"] / n, worst["optimizer"] / n,
                     worst["total"] / n, worst["total"] / (16 * n), worst["total"] / 2**20, worst["buffers"] / 2**20,
                     tps, per_rank[0]["losses"][-1]])
        if worst["other"]:
            print(f"ZeRO-{stage} other tensors held by the optimizer (not in total): {worst['other']}")
    C.print_table(["stage", "params B/p", "grads B/p", "optim B/p", "total B/p", "x 16 B/p", "total MiB",
                   "comm buckets MiB", "tok/s/rank", "last loss"], rows)
    print("B/p: bytes per model parameter held by one rank; 16 B/p = standard mixed precision on one device "
          "(2 + 2 bf16 weights and gradients, 4 fp32 master weights, 8 Adam moments)")
    if 0 in results and 3 in results:
        z0 = max(r["mem"]["total"] for r in results[0])
        z3 = max(r["mem"]["total"] for r in results[3])
        print(f"ZeRO-3 / ZeRO-0 model-state bytes per rank = {z3 / z0:.3f}; ZeRO-3 holds {z3 / n:.2f} B/p = "
              f"{z3 / (16 * n):.3f} of 16 B/p")
        C.emit("zero_memory", z3, z0, "bytes", z0 / z3, ranks=a.ranks, model=a.model, precision=a.precision,
               bytes_per_param={f"zero{s}": round(max(r["mem"]["total"] for r in pr) / n, 3)
                                for s, pr in results.items()},
               tokens_per_s_per_rank={f"zero{s}": round(statistics.mean(r["tokens_per_step"] / r["step_s"]
                                                                         for r in pr), 1)
                                      for s, pr in results.items()})


if __name__ == "__main__":
    main()
