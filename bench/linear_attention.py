"""Softmax vs linear attention (the paper's section 3.3, ``model.attention: linear``) at long lengths.

Part 1, the attention sublayer (fused QKV GEMM, rotary, attention core, output projection) in training
mode, forward + backward, for S in 512, 1536, 4096, 8192, at batch 1 and the width of the `small`
preset (hidden 256, 4 heads of 64; the memory ratio depends on the head size, not on the number of
heads). Three variants:

    softmax        the model's softmax attention as configured (attention dropout 0.1, every preset's
                   default): on CPU this runs the eager path, which holds the S x S probabilities
    softmax_sdpa   softmax without attention dropout: PyTorch's fused SDPA kernel (flash attention on
                   CPU and GPU), O(S) memory but still O(S^2) time
    linear         linear attention with rotary feature maps: O(S) time and memory

Time: medians of interleaved repeats in one process (CPU: one thread by default, the steadiest
figure on a shared machine). Peak memory: each (variant, S) in its own
subprocess with ``MALLOC_MMAP_THRESHOLD_=65536`` (freed tensors go back to the OS); after one warm-up
step the peak-RSS mark is reset and the figure is the peak during one step minus the RSS before it.
On CUDA: ``torch.cuda.max_memory_allocated``. Growth per doubling of S: (t2 / t1) ^ (1 / log2(S2 / S1)).

Part 2, a short MLM pretraining run per variant on the demo data (People's Daily 1998; the shards are
built into data/demo when missing, by the demo's own data step, as ``make demo`` does): the `small`
model, one stage at 512 tokens, the same seed, data and steps; eval loss and accuracy on the held-out
shards. Variants: softmax + RoPE, linear + RoPE, linear without RoPE (position_embedding=absolute).

    python bench/linear_attention.py                        # both parts, CPU (~40 min on 2 busy cores)
    python bench/linear_attention.py --skip-mlm             # part 1 only (~10 min)
    python bench/linear_attention.py --device cuda --batch 8 --skip-mlm
    python bench/linear_attention.py --tiny                 # both parts in about a minute: hidden 64, S in 256, 512;
                                                            # 2 MLM steps of the debug model on tiny shards (temp dir)

Ends with one JSON line: ratio = softmax / linear peak memory at the longest S.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import _common as C  # noqa: E402  (puts the checkout on sys.path)

import torch

from roformer_dist.config import ModelConfig
from roformer_dist.nn.model import RoFormerSelfAttention, rotary_cache

VARIANTS = {  # name -> (model.attention, attention dropout)
    "softmax": ("softmax", 0.1),
    "softmax_sdpa": ("softmax", 0.0),
    "linear": ("linear", 0.1),
}
MLM_VARIANTS = {  # name -> config overrides
    "softmax+rope": ["model.attention=softmax"],
    "linear+rope": ["model.attention=linear"],
    "linear, no rope": ["model.attention=linear", "model.position_embedding=absolute"],
}


def parse_args(argv=None):
    p = C.parser(__doc__)
    C.measure_flags(p, device="cpu", threads=1, repeats=5,
                    threads_help="CPU threads (1: on a shared machine a second thread makes every op wait for the "
                                 "slower one, which blurs the growth per doubling)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seqs", default="512,1536,4096,8192")
    p.add_argument("--skip-layers", action="store_true", help="skip part 1")
    p.add_argument("--skip-mlm", action="store_true", help="skip part 2")
    p.add_argument("--mlm-steps", type=int, default=120)
    p.add_argument("--mlm-batch", type=int, default=8)
    p.add_argument("--mlm-seq", type=int, default=512)
    p.add_argument("--mlm-model", default="small", help="model preset of part 2 (configs/model/)")
    p.add_argument("--mlm-eval-batches", type=int, default=16)
    p.add_argument("--data", default=str(C.REPO / "data" / "demo"), help="shard sets <data>/train and <data>/eval")
    p.add_argument("--run-root", default=str(C.REPO / "runs" / "bench_linear_attention"))
    p.add_argument("--memory-worker", nargs=2, metavar=("VARIANT", "SEQ"), help=argparse.SUPPRESS)
    C.tiny_defaults(p, argv, hidden=64, heads=2, seqs="256,512", repeats=1, mlm_steps=2, mlm_batch=2, mlm_seq=64,
                    mlm_model="debug", mlm_eval_batches=2, data=lambda: str(C.tiny_dir() / "data"),
                    run_root=lambda: str(C.tiny_dir() / "runs"))
    return p.parse_args(argv)


# --------------------------------------------------------------------------- part 1: the sublayer


def build_layer(a, variant: str, seq: int):
    """The attention sublayer, its input, rotary tables, mask and output gradient for one (variant, S)."""
    kind, dropout = VARIANTS[variant]
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    cfg = ModelConfig(vocab_size=100, hidden_size=a.hidden, num_attention_heads=a.heads, attention=kind,
                      attention_probs_dropout_prob=dropout, max_position_embeddings=seq, rotary_backend="auto")
    torch.manual_seed(0)
    layer = RoFormerSelfAttention(cfg).to(a.device, dtype).train()
    cos, sin = rotary_cache(cfg).get(seq, a.device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(a.batch, seq, a.hidden, generator=g).to(a.device, dtype).requires_grad_()
    grad = torch.randn(a.batch, seq, a.hidden, generator=g).to(a.device, dtype)
    mask = torch.ones(a.batch, 1, 1, seq, dtype=torch.bool, device=a.device)

    def step():
        layer(x, mask, cos, sin).backward(grad)
        x.grad = None
        layer.zero_grad(set_to_none=True)

    return step


def memory_worker(a) -> None:
    """Subprocess: one warm-up step, then the peak RSS delta of one step as JSON."""
    print(json.dumps(C.step_peak_rss(build_layer(a, a.memory_worker[0], int(a.memory_worker[1])))))


def peak_memory(a, variant: str, seq: int, step) -> int:
    if a.device.startswith("cuda"):
        return C.cuda_peak_delta(step)
    return C.peak_rss_in_child([str(Path(__file__).resolve()), *sys.argv[1:], "--memory-worker", variant, str(seq)])


def over(a: float, b: float) -> Optional[float]:
    """a / b, or None where b is 0: a step whose peak stays within the pages resident before it measures 0 MiB
    (tiny sizes)."""
    return a / b if b > 0 else None


def as_factor(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}x"


def per_doubling(seqs: list[int], values: list[float]) -> list[str]:
    out = ["-"]
    for (s1, v1), (s2, v2) in zip(zip(seqs, values), zip(seqs[1:], values[1:])):
        growth = over(v2, v1)
        out.append(as_factor(None if growth is None else growth ** (1.0 / math.log2(s2 / s1))))
    return out


def layers_part(a) -> dict:
    seqs = [int(s) for s in a.seqs.split(",")]
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    mems: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for seq in seqs:
        steps = {v: build_layer(a, v, seq) for v in VARIANTS}
        t = C.time_interleaved(steps, repeats=a.repeats, warmup=1, device=a.device)
        for v in VARIANTS:
            times[v].append(t[v])
            mems[v].append(peak_memory(a, v, seq, steps[v]) / 2**20)
        del steps
        print(f"  S={seq}: " + "  ".join(f"{v} {times[v][-1] * 1e3:.0f} ms {mems[v][-1]:.0f} MiB" for v in VARIANTS),
              flush=True)
    print(f"\nattention sublayer fwd+bwd, B={a.batch} hidden={a.hidden} heads={a.heads} {a.dtype} {a.device}"
          f"{a.threads_note} (medians of {a.repeats})")
    rows = []
    for v in VARIANTS:
        tg, mg = per_doubling(seqs, times[v]), per_doubling(seqs, mems[v])
        for i, seq in enumerate(seqs):
            rows.append([v, seq, times[v][i] * 1e3, tg[i], mems[v][i], mg[i],
                         as_factor(over(times[v][i], times["linear"][i])),
                         as_factor(over(mems[v][i], mems["linear"][i]))])
    C.print_table(["variant", "S", "fwd+bwd ms", "time growth/doubling", "peak MiB", "memory growth/doubling",
                   "time vs linear", "memory vs linear"], rows)
    overall = {v: per_doubling([seqs[0], seqs[-1]], [times[v][0], times[v][-1]])[1] for v in VARIANTS}
    print(f"time growth per doubling of S, {seqs[0]} -> {seqs[-1]}: "
          + ", ".join(f"{v} {g}" for v, g in overall.items()))
    return {"seqs": seqs, "times": times, "mems": mems}


# --------------------------------------------------------------------------- part 2: MLM runs


def data_args(data: Path, tiny: bool) -> list[str]:
    """The runs' shard sets under ``data``, built when missing: with --tiny, ``data``/train and ``data``/eval
    from a few hundred lines (_common.tiny_shards); else the demo's mixture, by the demo's data step with the
    demo's own settings (so that ``make demo`` reuses data/demo rather than refusing another recipe)."""
    if tiny:
        C.tiny_shards(data)
        return ["data.sources=[]", f"data.shards={data / 'train'}", f"data.eval_shards={data / 'eval'}",
                "data.eval_sources=[]"]
    from roformer_dist.config import load_config
    from roformer_dist.demo.data import data_overrides

    print(f"the demo shards in {data} (built by the demo's data step when missing: a few minutes)", flush=True)
    C.demo_data(load_config(C.DEMO_CONFIG, data_overrides(data)))
    return data_overrides(data)


def mlm_part(a) -> dict:
    from roformer_dist.runtime.events import read_scalars

    data = Path(a.data)
    stage = (f"curriculum.stages=[{{name: s{a.mlm_seq}, seq_len: {a.mlm_seq}, global_batch_size: {a.mlm_batch}, "
             f"steps: {a.mlm_steps}, micro_batch_size: {a.mlm_batch}, eval_lengths: [{a.mlm_seq}]}}]")
    common = [*data_args(data, a.tiny), f"model={a.mlm_model}", stage,
              "dist.world_size=1", "deepspeed.zero_stage=0", "trainer.save_every=0", "trainer.eval_every=0",
              "trainer.log_every=25", f"data.eval_batches={a.mlm_eval_batches}", "optim.lr=1e-3",
              "optim.schedule=linear", "optim.warmup_steps=15", "optim.min_lr_ratio=0.1", "checkpoint.resume=false",
              "logging.tensorboard=true"]
    results = {}
    for name, overrides in MLM_VARIANTS.items():
        run_dir = Path(a.run_root) / name.replace(" ", "").replace(",", "_").replace("+", "_")
        print(f"MLM run {name}: {a.mlm_steps} steps x {a.mlm_batch} x {a.mlm_seq} tokens -> {run_dir}", flush=True)
        t0 = time.monotonic()
        shutil.rmtree(run_dir, ignore_errors=True)
        C.train_quietly(C.DEMO_CONFIG, [*common, f"run_dir={run_dir}", *overrides], f"MLM {name}")
        scalars = read_scalars(run_dir / "tb")
        results[name] = {"eval_loss": scalars["eval/loss"][-1][1], "eval_acc": scalars["eval/mlm_acc"][-1][1],
                         "train_loss": scalars["train/loss"][-1][1], "minutes": (time.monotonic() - t0) / 60}
    print(f"\nMLM pretraining on People's Daily 1998: model {a.mlm_model}, {a.mlm_steps} steps of "
          f"{a.mlm_batch} x {a.mlm_seq} tokens, 1 rank, same seed and data; eval on held-out shards")
    C.print_table(["variant", "eval loss", "eval MLM acc", "last train loss", "minutes"],
                  [[n, r["eval_loss"], r["eval_acc"], r["train_loss"], r["minutes"]] for n, r in results.items()])
    return results


def main(argv=None) -> None:
    a = parse_args(argv)
    a.threads_note = C.torch_setup(a.device, a.threads)
    if a.memory_worker:
        memory_worker(a)
        return
    layers = None if a.skip_layers else layers_part(a)
    mlm = None if a.skip_mlm else mlm_part(a)
    extra = {}
    if mlm:
        extra["mlm_eval_loss"] = {n: round(r["eval_loss"], 4) for n, r in mlm.items()}
        extra["mlm_eval_acc"] = {n: round(r["eval_acc"], 4) for n, r in mlm.items()}
    if layers:
        seq = layers["seqs"][-1]
        mem, tm = layers["mems"], layers["times"]
        growth = per_doubling([layers["seqs"][0], seq], [tm["linear"][0], tm["linear"][-1]])[1]
        last_doubling = per_doubling(layers["seqs"][-2:], tm["linear"][-2:])[1] if len(layers["seqs"]) > 1 else "-"
        vs_sdpa = over(mem["softmax_sdpa"][-1], mem["linear"][-1])
        C.emit("linear_attention", mem["linear"][-1], mem["softmax"][-1], "MiB", over(mem["softmax"][-1], mem["linear"][-1]),
               seq=seq, device=a.device, dtype=a.dtype,
               mem_ratio_vs_sdpa=None if vs_sdpa is None else round(vs_sdpa, 3),
               time_ratio=round(tm["softmax"][-1] / tm["linear"][-1], 3),
               time_ratio_vs_sdpa=round(tm["softmax_sdpa"][-1] / tm["linear"][-1], 3),
               linear_time_growth_per_doubling=None if growth == "-" else float(growth.rstrip("x")),
               linear_time_growth_last_doubling=None if last_doubling == "-" else float(last_doubling.rstrip("x")),
               **extra)
    else:
        C.emit("linear_attention_mlm", 0.0, 0.0, "-", 1.0, **extra)


if __name__ == "__main__":
    main()
