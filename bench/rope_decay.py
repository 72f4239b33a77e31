"""RoPE's long-term decay (RoFormer paper, section 3.4.3 and Figure 2), from our own rotary tables.

Pairing the head dimensions, q_m . k_n = Re[sum_i h_i e^{i (m-n) theta_i}] with h_i = q_[2i:2i+1] k*_[2i:2i+1]
and theta_i = 10000^(-2i/d). Summation by parts bounds its size by (max_i |h_{i+1} - h_i|) * sum_j |S_j|,
S_j = sum_{k<j} e^{i (m-n) theta_k}; the paper plots the *relative upper bound*

    B(r) = (1 / (d/2)) * sum_{j=1}^{d/2} |S_j|,       r = m - n,

which shrinks as the relative distance grows: attention between far-apart tokens is damped, the
property the curriculum's long stages rely on. This script computes B from
``roformer_dist.nn.rotary.rotary_tables`` (the tables the model uses: cos/sin of r * theta_i), writes
``rope_decay.csv`` (distance, one column per head size) and ``rope_decay.png``, and says for each head
size whether B decays over 0..max distance and where the decay stops. B oscillates, so both are read
off B smoothed over a moving window of ``--window`` positions: the distance from which the smoothed
curve stays within 10% of its minimum (the decay is essentially over), and the distance of that
minimum (after it the curve rises again, unless the minimum is at the end of the range).

    python bench/rope_decay.py                          # head sizes 64 (all our presets but debug) and 128
    python bench/rope_decay.py --head-dims 16 64 128 --max-distance 4096 --out runs/rope_decay
    python bench/rope_decay.py --tiny                   # head sizes 8 and 16 to distance 128, in a temporary directory
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import _common as C  # noqa: E402  (puts the checkout on sys.path)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from roformer_dist.nn.rotary import rotary_tables  # noqa: E402


def relative_upper_bound(head_dim: int, max_distance: int, base: float = 10000.0) -> np.ndarray:
    """B(r) for r = 0..max_distance (float64 [max_distance + 1])."""
    cos, sin = rotary_tables(max_distance + 1, head_dim, base)     # (R, d/2): r * theta_i
    partial = torch.cumsum(torch.complex(cos.double(), sin.double()), dim=1)   # S_1 .. S_{d/2}
    return partial.abs().mean(dim=1).numpy()


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Centred moving average (the window shrinks at the ends)."""
    half = window // 2
    c = np.concatenate(([0.0], np.cumsum(values)))
    idx = np.arange(len(values))
    lo, hi = np.maximum(0, idx - half), np.minimum(len(values), idx + half + 1)
    return (c[hi] - c[lo]) / (hi - lo)


def decay_summary(bound: np.ndarray, window: int) -> dict:
    """Where the smoothed bound reaches its minimum, and whether that is the end of the range."""
    s = smooth(bound, window)
    r_min = int(np.argmin(s))
    end = len(bound) - 1
    decays_throughout = r_min >= end - window // 2
    within_10pct = int(np.flatnonzero(s <= 1.1 * s[r_min])[0])
    return {"bound_at_0": float(bound[0]), "bound_at_end": float(bound[-1]), "smoothed_min_at": r_min,
            "smoothed_min": float(s[r_min]), "smoothed_at_end": float(s[-1]),
            "within_10pct_of_min_from": within_10pct, "decays_throughout": bool(decays_throughout)}


def write_png(path: Path, distances: np.ndarray, curves: dict[int, np.ndarray], window: int) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("rope_decay: matplotlib is not installed (pip install 'roformer-dist[plot]'): no PNG written",
              file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=90)
    for d, b in curves.items():
        line, = ax.plot(distances, b, linewidth=0.6, alpha=0.6, label=f"d = {d}")
        ax.plot(distances, smooth(b, window), color=line.get_color(), linewidth=1.8,
                label=f"d = {d}, moving average over {window}")
    ax.set_xlabel("relative distance m - n")
    ax.set_ylabel("relative upper bound (1/(d/2)) sum_j |S_j|")
    ax.set_title("RoPE long-term decay (theta_i = 10000^(-2i/d))")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = C.parser(__doc__)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], help="head sizes d (even)")
    p.add_argument("--max-distance", type=int, default=1536, help="largest relative distance")
    p.add_argument("--window", type=int, default=64, help="moving-average window for 'where it stops decaying'")
    p.add_argument("--base", type=float, default=10000.0, help="rotary base (theta_i = base^(-2i/d))")
    p.add_argument("--out", default="runs/rope_decay", help="directory for rope_decay.csv and rope_decay.png")
    C.tiny_defaults(p, argv, head_dims=[8, 16], max_distance=128, window=16, out=C.tiny_dir)
    args = p.parse_args(argv)
    for d in args.head_dims:
        if d < 2 or d % 2:
            p.error(f"--head-dims: {d} is not a positive even number")
    if args.max_distance < args.window:
        p.error(f"--max-distance {args.max_distance} must be at least --window {args.window}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    distances = np.arange(args.max_distance + 1)
    curves = {d: relative_upper_bound(d, args.max_distance, args.base) for d in args.head_dims}

    csv_path = out / "rope_decay.csv"
    tmp = csv_path.with_name(csv_path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["distance", *(f"bound_d{d}" for d in curves)])
        for r in distances:
            w.writerow([int(r), *(f"{curves[d][r]:.6f}" for d in curves)])
    tmp.replace(csv_path)
    png_path = out / "rope_decay.png"
    wrote_png = write_png(png_path, distances, curves, args.window)

    marks = [r for r in (0, 1, 4, 16, 64, 128, 256, 512, 1024, 1536, 2048, 4096) if r <= args.max_distance]
    print(f"relative upper bound B(r) of RoPE, theta_i = {args.base:g}^(-2i/d)")
    print(f"{'distance':>9} " + " ".join(f"{'d=' + str(d):>8}" for d in curves))
    for r in marks:
        print(f"{r:>9} " + " ".join(f"{curves[d][r]:>8.3f}" for d in curves))
    summaries = {}
    for d, b in curves.items():
        s = summaries[d] = decay_summary(b, args.window)
        verdict = (f"falls from {s['bound_at_0']:.2f} to within 10% of its smoothed minimum by distance "
                   f"{s['within_10pct_of_min_from']}; ")
        if s["decays_throughout"]:
            verdict += f"the smoothed curve decays over the whole range 0..{args.max_distance}"
        else:
            verdict += (f"the smoothed curve is lowest ({s['smoothed_min']:.2f}) at distance {s['smoothed_min_at']} "
                        f"and stops decaying there (smoothed {s['smoothed_at_end']:.2f} at {args.max_distance})")
        print(f"d = {d}: {verdict}")
    print(f"wrote {csv_path}" + (f" and {png_path}" if wrote_png else ""))
    C.result("rope_decay", max_distance=args.max_distance, window=args.window,
             head_dims={str(d): s for d, s in summaries.items()}, csv=str(csv_path),
             png=str(png_path) if wrote_png else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
