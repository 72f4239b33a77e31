"""The optimizer step under DeepSpeed: torch's fused AdamW handed to DeepSpeed as a client optimizer (what
``roformer-train`` uses on CUDA: ``engine.choose_optimizer``) vs DeepSpeed's FusedAdam (the ``optimizer``
section of its JSON, ``type: AdamW``: a CUDA op DeepSpeed compiles with nvcc on first use on a machine).

One rank, per ZeRO stage (``--zero-stages``, default 1, 2, 3) and precision (``--dtypes``, default bf16):
the model preset at ``--vocab``, its engine built the way ``roformer-train`` builds it
(``engine.build_engine``) for ours and with the same DeepSpeed JSON plus the optimizer section for
DeepSpeed's; the same initial weights and batch for both. Each repeat runs forward and backward (not
timed), then times ``engine.step()`` (DeepSpeed's whole step: gradient norm and clipping, the optimizer on
the fp32 master partitions, the copy back into the bf16 weights), synchronised; medians over ``--repeats``
after ``--warmup``, the two engines' repeats in separate blocks. Also, per engine: the optimizer alone on
DeepSpeed's fp32 partitions (``kernel``), and the seconds ``deepspeed.initialize`` took (``init``). FusedAdam
is built (or loaded from ``TORCH_EXTENSIONS_DIR``) once before, as ``roformer-train`` builds DeepSpeed's
ops (``engine.load_op``: ``TORCH_CUDA_ARCH_LIST`` as DeepSpeed reads it); the seconds that took are printed
(about a minute on a machine that never built it, which ours does not spend).

Each (stage, precision) ends in a JSON line ``{"bench": "optimizer", "ours": s, "baseline": s, "ratio":
baseline / ours, ...}`` (ratio > 1: torch's fused AdamW is faster); keep the faster.

    python bench/optimizer.py                                  # CUDA: base, ZeRO 1/2/3, bf16, both optimizers
    python bench/optimizer.py --model-preset small --zero-stages 2 --dtypes bf16,fp32
    python bench/optimizer.py --tiny                           # CPU: debug model, torch AdamW only, seconds

On CPU DeepSpeed's FusedAdam is another op (a C++ loop of its CPU Adam, not the CUDA kernel the question
is about; its first build alone takes ~35 s), so only ours is timed there and the baseline is reported
as skipped, saying why; on CUDA a FusedAdam that cannot be built (no nvcc) is skipped the same way, with
the build's one-line error.
"""

from __future__ import annotations

import gc
import os
import statistics
import time

import _common as C  # noqa: E402  (puts the checkout on sys.path)

import torch

FUSED_ADAM = "DeepSpeed FusedAdam"


def parse_args(argv=None):
    p = C.parser(__doc__)
    C.measure_flags(p, device="cuda" if torch.cuda.is_available() else "cpu", threads=2, repeats=20, warmup=3)
    p.add_argument("--model-preset", default="base", help="model preset (configs/model/)")
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--seq", type=int, default=128, help="sequence length of the (untimed) forward and backward")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--zero-stages", default="1,2,3")
    p.add_argument("--dtypes", default="bf16", help="comma list of fp32, bf16")
    C.tiny_defaults(p, argv, model_preset="debug", vocab=512, seq=32, repeats=3, warmup=1)
    return p.parse_args(argv)


def config(a, zero_stage: int, dtype: str):
    return C.stage_config(model=a.model_preset, vocab=a.vocab, ranks=1, seq=a.seq, global_batch=a.batch,
                          micro_batch=a.batch, steps=1, overrides=(f"deepspeed.zero_stage={zero_stage}",
                                                                   f"deepspeed.precision={dtype}"))


def build(cfg, which: str):
    """(engine, init seconds): ours through ``build_engine``, DeepSpeed's FusedAdam from the same JSON."""
    from roformer_dist.runtime.deepspeed_import import import_deepspeed
    deepspeed = import_deepspeed()  # without the mlflow import of its autotuner

    from roformer_dist.nn.model import RoFormerForMaskedLM
    from roformer_dist.config import stage_plans
    from roformer_dist.parallel.engine import build_engine, deepspeed_config, param_groups

    torch.manual_seed(0)
    model = RoFormerForMaskedLM(cfg.model).train()
    stage = stage_plans(cfg, 1)[0]
    t0 = time.perf_counter()
    if which == "ours":
        engine = build_engine(cfg, model, stage)
    else:
        o = cfg.optim
        ds = deepspeed_config(cfg, stage)
        ds["optimizer"] = {"type": "AdamW", "params": {"lr": o.lr, "betas": [o.beta1, o.beta2], "eps": o.eps,
                                                        "weight_decay": o.weight_decay}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, o.weight_decay),
                                          config=ds)
    return engine, time.perf_counter() - t0


def inner_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer under DeepSpeed's wrapper (ZeRO's, bf16's), working on the fp32 partitions."""
    opt = engine.optimizer
    return opt.optimizer if isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer) else opt


def measure(engine, batch, a) -> dict:
    """Median seconds of ``engine.step()`` after an untimed forward and backward, and of the optimizer alone."""
    ids, labels = (t.to(engine.device) for t in batch)
    steps = []
    for i in range(a.warmup + a.repeats):
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        C.sync(a.device)
        t0 = time.perf_counter()
        engine.step()
        C.sync(a.device)
        if i >= a.warmup:
            steps.append(time.perf_counter() - t0)
    kernel = C.time_median(optimizer_alone(engine), repeats=a.repeats, warmup=a.warmup, device=a.device)
    return {"step_s": statistics.median(steps), "kernel_s": kernel, "last_loss": float(loss.detach())}


def optimizer_alone(engine):
    """A call of the torch optimizer over all of DeepSpeed's fp32 partitions (random gradients), as its step
    makes it: ZeRO-3 hands it one sub-group at a time (``_optimizer_step``), the others all at once."""
    opt, inner = engine.optimizer, inner_optimizer(engine)
    flat = getattr(opt, "fp32_partitioned_groups_flat", None)  # ZeRO-3's partitions
    params = flat if flat is not None else [p for group in inner.param_groups for p in group["params"]]
    g = torch.Generator(device="cpu").manual_seed(1)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(p.device, p.dtype)
    if flat is None:
        return inner.step

    def step_sub_groups() -> None:
        for i, p in enumerate(flat):
            group = inner.param_groups[opt.sub_group_to_group_id[i]]
            group["params"] = [p]
            inner.step()
            group["params"] = []

    return step_sub_groups


def release(engine) -> None:
    engine.destroy()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def baseline_unavailable(device: str) -> str | None:
    """Why DeepSpeed's FusedAdam is not timed here (None: it is)."""
    if not device.startswith("cuda"):
        return ("DeepSpeed's FusedAdam is a CUDA kernel; on CPU DeepSpeed substitutes another op (and its first "
                "build alone takes ~35 s): timed on CUDA only")
    from roformer_dist.errors import EnvironmentSetupError
    from roformer_dist.parallel.engine import DeepSpeedOp, load_op

    try:  # the build (or the load of an earlier one) first: one line if it fails, and init_s without it below
        load_op(DeepSpeedOp(FUSED_ADAM, "FusedAdamBuilder", "nvcc", "this bench's baseline"), 0)
    except EnvironmentSetupError as e:
        return str(e)
    return None


def compare(a, zero_stage: int, dtype: str, skipped: str | None, build_s: float | None) -> dict:
    """The JSON line of one (ZeRO stage, precision): both engines built, timed and released in turn;
    ``build_s``: the seconds FusedAdam took to build or load."""
    from roformer_dist.parallel.engine import choose_optimizer

    cfg = config(a, zero_stage, dtype)
    batch = C.random_mlm_batch(cfg.model.vocab_size, a.batch, a.seq, seed=0)
    res, init = {}, {}
    for which in ("ours",) if skipped else ("ours", "baseline"):
        engine, init[which] = build(cfg, which)
        params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
        res[which] = measure(engine, batch, a)
        release(engine)
    ours, base = res["ours"], res.get("baseline")

    def r(x, digits=6):
        return None if x is None else round(x, digits)

    return {"bench": "optimizer", "zero_stage": zero_stage, "dtype": dtype, "device": a.device,
            "model": a.model_preset, "params": params,
            "ours_impl": choose_optimizer(cfg, a.device.startswith("cuda")).describe(), "baseline_impl": FUSED_ADAM,
            "ours": r(ours["step_s"]), "baseline": r(base and base["step_s"]), "unit": "s",
            "ratio": r(base and base["step_s"] / ours["step_s"], 3),
            "ours_kernel_s": r(ours["kernel_s"]), "baseline_kernel_s": r(base and base["kernel_s"]),
            "kernel_ratio": r(base and base["kernel_s"] / ours["kernel_s"], 3),
            "ours_init_s": r(init["ours"], 3), "baseline_init_s": r(init.get("baseline"), 3),
            "baseline_build_or_load_s": r(build_s, 3), "skipped": skipped}


def main(argv=None) -> int:
    a = parse_args(argv)
    os.environ["DS_ACCELERATOR"] = "cuda" if a.device.startswith("cuda") else "cpu"  # before DeepSpeed's import
    threads = C.torch_setup(a.device, a.threads)
    C.init_single_rank(a.device)
    t0 = time.perf_counter()
    skipped = baseline_unavailable(a.device)
    build_s = None if skipped else time.perf_counter() - t0
    if skipped:
        print(f"baseline ({FUSED_ADAM}) skipped: {skipped}", flush=True)
    else:
        print(f"{FUSED_ADAM}: built or loaded in {build_s:.1f} s", flush=True)
    lines = [compare(a, z, dtype, skipped, build_s) for dtype in a.dtypes.split(",")
             for z in map(int, a.zero_stages.split(","))]

    def ms(x):
        return "-" if x is None else f"{x * 1e3:.4g}"

    print(f"optimizer step, 1 rank, model {a.model_preset} ({lines[0]['params'] / 1e6:.1f} M parameters), device "
          f"{a.device}{threads}; ours: "
          f"{lines[0]['ours_impl']}; baseline: {FUSED_ADAM}; medians of {a.repeats}")
    C.print_table(["ZeRO", "dtype", "ours step ms", "FusedAdam step ms", "FusedAdam/ours", "ours kernel ms",
                   "FusedAdam kernel ms", "ours init s", "FusedAdam init s"],
                  [[x["zero_stage"], x["dtype"], ms(x["ours"]), ms(x["baseline"]),
                    "-" if x["ratio"] is None else f"{x['ratio']:.2f}x", ms(x["ours_kernel_s"]),
                    ms(x["baseline_kernel_s"]), f"{x['ours_init_s']:.3g}",
                    "-" if x["baseline_init_s"] is None else f"{x['baseline_init_s']:.3g}"] for x in lines])
    timed = [x for x in lines if x["ratio"] is not None]
    if timed:
        faster = sum(x["ratio"] >= 1 for x in timed)
        print(f"ours (torch's fused AdamW) as fast or faster in {faster} of {len(timed)}; FusedAdam/ours geometric "
              f"mean {statistics.geometric_mean([x['ratio'] for x in timed]):.3f} (> 1: keep ours)")
    for line in lines:
        C.result(**line)
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
