"""Rotary embedding, forward + backward: our backends vs HF's
``RoFormerSelfAttention.apply_rotary_position_embeddings``.

Shapes: B=8, H=12, D=64 (the base model's heads), S in {512, 1536}, fp32 and bf16. q and k require
grad; one call = rotate q and k, then autograd.grad with fixed output grads. HF runs on its own
layout (B, H, S, D) with its (1, 1, S, D) sinusoidal table; ours on (B, S, H, D) (what the fused QKV
projection gives). Both inputs are contiguous and hold the same number of elements. Medians of
interleaved repeats in one process.

GB/s = bytes a rotary must move (read q, k and write q', k' in forward, the same for the grads in
backward) / time: the figure to compare with the device's memory bandwidth. On a GPU whose datasheet
bandwidth is known (``roformer_dist.observe.metrics.PEAK_MEMORY_TBPS``) the table gives each figure's share
of it, and the JSON line the best backend's (the goal: >= 50 % at the base shapes, B 64, S 512 and 1536).

    python bench/rotary.py                         # CPU, 2 threads
    python bench/rotary.py --device cuda --batch 64 --dtypes bf16 --backends reference,compiled,triton,flash_attn
    python bench/rotary.py --tiny                  # B=1, H=2, D=16, S in {32, 64}: the same table in seconds
"""

from __future__ import annotations

import _common as C  # noqa: E402  (puts the checkout on sys.path)

import torch

from roformer_dist.nn.rotary import RotaryCache, apply_rotary
from roformer_dist.observe.metrics import peak_memory_bandwidth


def parse_args(argv=None):
    p = C.parser(__doc__)
    C.measure_flags(p, device="cpu", threads=2, repeats=7)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seqs", default="512,1536")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--backends", default="reference,compiled",
                   help="comma list of ours to time (auto, reference, compiled, triton, apex, flash_attn)")
    C.tiny_defaults(p, argv, batch=1, heads=2, head_dim=16, seqs="32,64", repeats=2)
    return p.parse_args(argv)


def rotary_bytes(q: torch.Tensor, k: torch.Tensor) -> int:
    """Bytes a rotary pass over q and k must move at least (read + write each): the GB/s figures' numerator."""
    return 2 * (q.numel() * q.element_size() + k.numel() * k.element_size())


def hf_rotary():
    from transformers.models.roformer.modeling_roformer import RoFormerSelfAttention

    return RoFormerSelfAttention.apply_rotary_position_embeddings


def main(argv=None) -> None:
    a = parse_args(argv)
    threads = C.torch_setup(a.device, a.threads)
    hf_apply = hf_rotary()
    backends = [b for b in a.backends.split(",") if b]
    B, H, D = a.batch, a.heads, a.head_dim
    cache = RotaryCache(D, max(int(s) for s in a.seqs.split(",")))
    rows, results = [], {}
    peak = peak_memory_bandwidth(torch.cuda.get_device_name()) if a.device == "cuda" else None

    def gbps(rate: float) -> str:
        return f"{rate / 1e9:.3g}" + ("" if peak is None else f" ({rate / peak:.0%})")

    for S in (int(s) for s in a.seqs.split(",")):
        cos, sin = cache.get(S, a.device)
        for dname in a.dtypes.split(","):
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dname]
            g = torch.Generator().manual_seed(0)

            def rand(*shape):
                return torch.randn(*shape, generator=g).to(device=a.device, dtype=dtype)

            # ours: (B, S, H, D); HF: (B, H, S, D) with its table [sin | cos] of shape (1, 1, S, D)
            q, k, gq, gk = (rand(B, S, H, D) for _ in range(4))
            q.requires_grad_(True)
            k.requires_grad_(True)
            qh, kh = (t.detach().transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k))
            gqh, gkh = gq.transpose(1, 2).contiguous(), gk.transpose(1, 2).contiguous()
            table = torch.cat((sin, cos), -1).to(dtype)[None, None]

            def hf_call():
                qo, ko = hf_apply(table, qh, kh)
                return torch.autograd.grad((qo, ko), (qh, kh), (gqh, gkh))

            fns = {"hf": hf_call}
            for b in backends:
                def ours_call(b=b):
                    qo, ko = apply_rotary(q, k, cos, sin, backend=b)
                    return torch.autograd.grad((qo, ko), (q, k), (gq, gk))

                def ours_fwd(b=b):
                    with torch.no_grad():
                        return apply_rotary(q, k, cos, sin, backend=b)

                fns[b] = ours_call
                fns[b + ":fwd"] = ours_fwd
            times = C.time_interleaved(fns, repeats=a.repeats, warmup=2, device=a.device)
            nbytes = rotary_bytes(q, k)
            for name in ["hf"] + backends:
                t = times[name]
                fwd = times.get(name + ":fwd")
                rows.append([S, dname, name, t * 1e3, "-" if fwd is None else f"{fwd * 1e3:.3g}",
                             f"{times['hf'] / t:.2f}x", gbps(2 * nbytes / t), "-" if fwd is None else gbps(nbytes / fwd)])
                results[(S, dname, name)] = (t, 2 * nbytes / t)
    where = "" if peak is None else f", peak memory bandwidth {peak / 1e9:.0f} GB/s (datasheet)"
    print(f"rotary q,k fwd+bwd  B={B} H={H} D={D}  device={a.device}{threads}{where}")
    C.print_table(["S", "dtype", "impl", "fwd+bwd ms", "fwd ms", "vs hf", "GB/s fwd+bwd", "GB/s fwd"], rows)
    S0, d0 = int(a.seqs.split(",")[0]), a.dtypes.split(",")[0]
    best = min(backends, key=lambda b: results[(S0, d0, b)][0])
    (ours, rate), (base, _) = results[(S0, d0, best)], results[(S0, d0, "hf")]
    C.emit("rotary", ours, base, "s", base / ours, backend=best, seq=S0, dtype=d0, device=a.device, batch=B,
           gbps=round(rate / 1e9, 1), peak_share=None if peak is None else round(rate / peak, 3))


if __name__ == "__main__":
    main()
