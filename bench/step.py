"""One MLM training step (forward, loss, backward): ours vs HF ``transformers.RoFormerForMaskedLM``.

Same weights (ours converted with roformer_dist.hf.convert.to_hf_model), same batch, same process for the
timings (medians of interleaved repeats). With dropout 0 (the default here) both compute the same
loss, which is checked, so the comparison is of the same math.

Peak memory (CPU): each model runs in its own subprocess with ``MALLOC_MMAP_THRESHOLD_=65536`` (every
tensor buffer is mmapped and returned to the OS on free, so RSS tracks live tensors); after one
warm-up step the kernel's peak-RSS mark is reset (``/proc/self/clear_refs``) and the reported figure
is the peak RSS during the measured step minus the RSS before it (gradients are freed between steps,
so they count). On CUDA: ``torch.cuda.max_memory_allocated`` over the step minus allocated before.

    python bench/step.py                      # the CPU figures of the Performance guide's table (2 threads, fp32)
    python bench/step.py --device cuda --dtype bf16 --seq 1536
    python bench/step.py --device cuda --dtype bf16 --model-preset base --vocab 50000 --batch 32 \
        --ours-only                               # tokens/s and MFU of the base preset
    python bench/step.py --tiny               # B=2, S=32, hidden 32, 1 layer: the same table and checks in seconds
    python bench/step.py --compile --ours-only  # ours eager vs ours compiled (trainer.compile), ratio of medians
    python bench/step.py --device cuda --dtype bf16 --model-preset base --batch 64 --ours-only --documents 85 \
        --document-attention flex               # packed documents kept apart vs the same rows without a mask

``--compile``: a second copy of ours, compiled as ``trainer.compile`` does (roformer_dist/parallel/compiled.py,
static shapes, the inductor cache in a fresh temporary dir unless ``--compile-cache``), timed interleaved
with the eager one; the compile (its first step) is timed apart, and the losses must agree (1e-4 relative).

``--documents N``: the same model and token ids a second time with every row packed with documents of N tokens
on average (lengths drawn from an exponential distribution, at least 2, the last one cut at the row's end; the
mask numbers them 1, 2, ... as the loader's ``data.packing: document`` does), planned on the host once as the
loader's workers plan each batch (``model.batch_plan``), timed interleaved with the rows without a mask (what
``data.packing: cross_document`` gives full rows); ``ratio`` = no-mask step time / document step time (> 1: the
documents are faster). ``--document-attention`` picks the kernel (``model.document_attention``: auto, blocks,
flex, varlen; set through the config loader, so a value or a key this checkout lacks is named in the error).
MFU counts full S x S attention in both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import _common as C  # noqa: E402  (puts the checkout on sys.path)

import torch

from roformer_dist.config import ModelConfig
from roformer_dist.errors import ConfigError
from roformer_dist.nn.model import RoFormerForMaskedLM, batch_plan, predicted_index, set_rotary_kernel
from roformer_dist.nn.rotary import model_kernel


def parse_args(argv=None):
    p = C.parser(__doc__)
    C.measure_flags(p, device="cpu", threads=2, repeats=5, warmup=2)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--mask-prob", type=float, default=0.15)
    p.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout of both models")
    p.add_argument("--rotary-backend", default="auto")
    p.add_argument("--attention", choices=("softmax", "linear"), default="softmax")
    p.add_argument("--model-preset", default=None,
                   help="take hidden/layers/heads/ffn from configs/model/NAME.yaml (e.g. base); --vocab stays")
    p.add_argument("--ours-only", action="store_true", help="skip HF (e.g. for MFU of big models)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    p.add_argument("--peak-tflops", type=float, default=None, help="accelerator peak for MFU (GPU)")
    p.add_argument("--compile", action="store_true", help="also time ours compiled (trainer.compile) vs ours eager")
    p.add_argument("--compile-cache", default=None, help="inductor cache dir for --compile (default: a fresh one)")
    p.add_argument("--documents", type=int, default=0, metavar="N",
                   help="also time the rows packed with documents of N tokens on average against no mask (ours only)")
    p.add_argument("--document-attention", default=None, metavar="KIND",
                   help="model.document_attention of the model (auto, blocks, flex, varlen; default: the config's)")
    p.add_argument("--memory-worker", choices=("ours", "hf"), help=argparse.SUPPRESS)
    C.tiny_defaults(p, argv, batch=2, seq=32, hidden=32, layers=1, heads=2, ffn=64, vocab=300, repeats=2, warmup=1)
    return p.parse_args(argv)


def model_config(a) -> ModelConfig:
    """The model of the flags; a preset and ``--document-attention`` go through the config loader as overrides."""
    overrides = [f"model={a.model_preset}"] if a.model_preset else []
    if a.document_attention:
        overrides.append(f"model.document_attention={a.document_attention}")
    loaded = None
    if overrides:
        from roformer_dist.config import load_config

        try:
            loaded = load_config(overrides=overrides).model
        except ConfigError as e:
            raise SystemExit(f"step: {e}") from None
    if a.model_preset:
        a.hidden, a.layers, a.heads, a.ffn = loaded.hidden_size, loaded.num_hidden_layers, \
            loaded.num_attention_heads, loaded.intermediate_size
    m = ModelConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
                    num_attention_heads=a.heads, intermediate_size=a.ffn,
                    max_position_embeddings=max(512, a.seq), hidden_dropout_prob=a.dropout,
                    attention_probs_dropout_prob=a.dropout, rotary_backend=a.rotary_backend,
                    attention=a.attention)
    return dataclasses.replace(m, document_attention=loaded.document_attention) if a.document_attention else m


def make_batch(a, device):
    ids, labels = C.random_mlm_batch(a.vocab, a.batch, a.seq, seed=1, mask_prob=a.mask_prob)
    return ids.to(device), labels.to(device), predicted_index(labels).to(device)


def packed_mask(batch: int, seq: int, mean_len: int, seed: int = 2) -> torch.Tensor:
    """(batch, seq) int64: each row packed end to end with documents numbered 1, 2, ... (``data.packing:
    document``'s mask), their lengths drawn from an exponential distribution of mean ``mean_len`` (at least 2
    tokens), the last one cut at the row's end."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        row, doc = [], 0
        while len(row) < seq:
            doc += 1
            length = max(2, math.ceil(-mean_len * math.log(1.0 - float(torch.rand((), generator=g)))))
            row += [doc] * length
        rows.append(row[:seq])
    return torch.tensor(rows, dtype=torch.int64)


def document_batch(a, model, labels):
    """(mask, layout) on the device for ``--documents``: the mask and its plan, made on the host as the loader's
    workers make them (``model.batch_plan``)."""
    mask = packed_mask(a.batch, a.seq, a.documents)
    try:
        plan = batch_plan(model.config, torch.device(a.device).type)({"attention_mask": mask, "labels": labels.cpu()})
    except ConfigError as e:
        raise SystemExit(f"step: {e}") from None
    return mask.to(a.device), plan["layout"].to(a.device)


def build(a, which: str):
    """ours or hf, identical weights (ours initialised from seed 0, HF converted from it)."""
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    ours = RoFormerForMaskedLM(model_config(a))
    if which == "hf":
        from roformer_dist.hf.convert import to_hf_model

        model = to_hf_model(ours)
    else:
        model = ours
    model = model.to(device=a.device, dtype=dtype).train()
    if which != "hf":  # the kernel is chosen before the forward, as the trainer does
        set_rotary_kernel(model, model_kernel(a.rotary_backend, a.device))
    if which == "compiled":
        import tempfile

        from roformer_dist.parallel.compiled import StageCompiler

        cache = Path(a.compile_cache or tempfile.mkdtemp(prefix="step_compile_"))
        StageCompiler(model, cache).compile_stage("bench", a.seq, a.batch)
    return model


def step_fn(model, which: str, ids, labels, predicted, mask=None, layout=None):
    def step():
        model.zero_grad(set_to_none=True)
        if which in ("ours", "compiled", "documents"):  # the predicted positions come from the host, as in the trainer
            loss = model(ids, mask, labels=labels, predicted=predicted, layout=layout).loss
        else:
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss.detach()
    return step


def memory_worker(a) -> None:
    """Runs in a subprocess: prints {"peak_delta": bytes, "rss_before": bytes}."""
    model = build(a, a.memory_worker)
    ids, labels, predicted = make_batch(a, a.device)
    step = step_fn(model, a.memory_worker, ids, labels, predicted)
    print(json.dumps(C.step_peak_rss(step, settle=lambda: model.zero_grad(set_to_none=True))))


def cpu_memory(a, which: str) -> int:
    return C.peak_rss_in_child([str(Path(__file__).resolve()), "--memory-worker", which,
                                *[x for x in sys.argv[1:] if x != "--memory-worker"]])


def peak_tflops(a) -> float | None:
    """--peak-tflops, else the trainer's dense peak of this GPU at the bench's precision (None on CPU)."""
    if a.peak_tflops:
        return a.peak_tflops
    if not a.device.startswith("cuda"):
        return None
    from roformer_dist.observe.metrics import matmul_precision, peak_flops

    peak = peak_flops(matmul_precision(a.dtype))
    return peak / 1e12 if peak else None


def main(argv=None) -> None:
    a = parse_args(argv)
    C.torch_setup(a.device, a.threads)
    if a.memory_worker:
        memory_worker(a)
        return
    model_config(a)  # a preset fills in the dimensions printed below
    if a.attention != "softmax" and not a.ours_only:
        raise SystemExit("--attention linear has no HF equivalent: add --ours-only")
    if a.documents and (not a.ours_only or a.compile):
        raise SystemExit("--documents: HF has no document masks and --compile compares whole rows: add --ours-only, "
                         "leave out --compile")
    ids, labels, predicted = make_batch(a, a.device)
    names = ["ours"] if a.ours_only else ["ours", "hf"]
    if a.compile:
        names.append("compiled")
    models = {n: build(a, n) for n in names}
    steps = {n: step_fn(models[n], n, ids, labels, predicted) for n in names}
    if a.documents:  # the same model, weights and ids, the rows packed with documents
        names.append("documents")
        models["documents"] = models["ours"]
        mask, layout = document_batch(a, models["ours"], labels)
        steps["documents"] = step_fn(models["ours"], "documents", ids, labels, predicted, mask, layout)
    losses, compile_s = {}, None
    for n in names:
        t0 = time.perf_counter()
        losses[n] = steps[n]().float().item()
        if n == "compiled":
            compile_s = time.perf_counter() - t0
    times = C.time_interleaved(steps, repeats=a.repeats, warmup=a.warmup, device=a.device)

    mem = {}
    if not a.no_memory:
        for n in names:
            if n == "compiled" or (n == "documents" and not a.device.startswith("cuda")):
                continue  # a memory worker would compile again / has no documents: the figure is for the others
            if a.device.startswith("cuda"):
                mem[n] = C.cuda_peak_delta(steps[n])
            else:
                mem[n] = cpu_memory(a, n)

    tokens = a.batch * a.seq
    frac = float((labels != -100).float().mean())
    ours_model = models["ours"]
    flops = {"ours": ours_model.flops_per_token(a.seq, frac) * tokens,
             "hf": ours_model.flops_per_token(a.seq, 1.0) * tokens,
             "compiled": ours_model.flops_per_token(a.seq, frac) * tokens,
             "documents": ours_model.flops_per_token(a.seq, frac) * tokens}
    peak = peak_tflops(a)
    print(f"train step, B={a.batch} S={a.seq} hidden={a.hidden} layers={a.layers} heads={a.heads} "
          f"ffn={a.ffn} vocab={a.vocab} {a.dtype} {a.device} dropout={a.dropout} "
          f"threads={torch.get_num_threads() if a.device == 'cpu' else '-'} masked={frac:.3f} "
          f"rotary={a.rotary_backend} attention={a.attention}{' preset=' + a.model_preset if a.model_preset else ''}")
    rows = []
    for n in names:
        row = [n, times[n] * 1e3, tokens / times[n], losses[n], flops[n] / times[n] / 1e12]
        row.append(mem[n] / 2**20 if n in mem else "-")
        row.append(f"{100 * flops[n] / times[n] / 1e12 / peak:.1f}" if peak else "-")
        rows.append(row)
    C.print_table(["model", "step ms (median)", "tokens/s", "loss", "TFLOP/s", "peak MiB", "MFU %"], rows)
    if a.compile:
        tol = 1e-4 if a.dtype == "fp32" else 5e-2
        if a.dropout == 0.0:  # with dropout the compiled model draws other masks (inductor's random streams)
            assert abs(losses["compiled"] - losses["ours"]) <= tol * max(1.0, abs(losses["ours"])), losses
        print(f"compiled vs eager (ours): step {times['compiled'] * 1e3:.1f} ms vs {times['ours'] * 1e3:.1f} ms "
              f"(medians of {a.repeats}), speed-up {times['ours'] / times['compiled']:.3f}x; compile (first step) "
              f"{compile_s:.1f} s; |loss diff| {abs(losses['compiled'] - losses['ours']):.2e}; load {C.load_average()}")
    if not a.ours_only:
        if a.dropout == 0.0:
            tol = 1e-4 if a.dtype == "fp32" else 5e-2
            assert abs(losses["ours"] - losses["hf"]) <= tol * max(1.0, abs(losses["hf"])), losses
            print(f"losses agree: |ours - hf| = {abs(losses['ours'] - losses['hf']):.2e}")
        measured = bool(mem) and mem["ours"] > 0 and mem["hf"] > 0  # a tiny step may stay under the allocator's grain
        if measured:
            print(f"peak memory ours/hf = {mem['ours'] / mem['hf']:.3f}")
        C.emit("step", times["ours"], times["hf"], "s", times["hf"] / times["ours"],
               device=a.device, dtype=a.dtype, seq=a.seq, tokens_per_s=round(tokens / times["ours"], 1),
               mem_ours_mib=round(mem.get("ours", 0) / 2**20, 1), mem_hf_mib=round(mem.get("hf", 0) / 2**20, 1),
               mem_ratio=round(mem["hf"] / mem["ours"], 3) if measured else None)
    else:
        mfu = flops["ours"] / times["ours"] / 1e12 / peak if peak else None
        C.emit("step_ours", times["ours"], times["ours"], "s", 1.0, device=a.device, dtype=a.dtype, seq=a.seq,
               batch=a.batch, preset=a.model_preset, attention=a.attention,
               tokens_per_s=round(tokens / times["ours"], 1), tflops=round(flops["ours"] / times["ours"] / 1e12, 2),
               mfu=round(mfu, 4) if mfu else None)
    if a.documents:  # packed documents vs the same rows without a mask: ratio > 1 = documents faster
        docs = mask.amax(dim=1).float()
        assert math.isfinite(losses["documents"]), losses
        print(f"documents vs no mask (ours): step {times['documents'] * 1e3:.1f} ms vs {times['ours'] * 1e3:.1f} ms "
              f"(medians of {a.repeats}), ratio {times['ours'] / times['documents']:.3f}; {docs.mean():.1f} "
              f"documents per row, {layout.form} layout, document_attention {models['ours'].config.document_attention}")
        C.emit("step_documents", times["documents"], times["ours"], "s", times["ours"] / times["documents"],
               device=a.device, dtype=a.dtype, seq=a.seq, batch=a.batch, preset=a.model_preset,
               mean_document=a.documents, docs_per_row=round(float(docs.mean()), 2), form=layout.form,
               document_attention=models["ours"].config.document_attention,
               tokens_per_s=round(tokens / times["documents"], 1),
               tokens_per_s_no_mask=round(tokens / times["ours"], 1),
               mem_mib=round(mem["documents"] / 2**20, 1) if "documents" in mem else None)
    if a.compile:  # compiled vs eager ours: ratio > 1 = compiled faster
        C.emit("step_compiled", times["compiled"], times["ours"], "s", times["ours"] / times["compiled"],
               device=a.device, dtype=a.dtype, seq=a.seq, batch=a.batch, compile_s=round(compile_s, 1),
               tokens_per_s=round(tokens / times["compiled"], 1))


if __name__ == "__main__":
    main()
