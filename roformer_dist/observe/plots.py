"""Line charts as PNG files (matplotlib, imported lazily: an optional dependency, the ``plot`` extra): the
demo's curves and the benches' figures."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

__all__ = ["line_plot"]


def line_plot(path: Path, panels: list[dict], title: Optional[str] = None, width: float = 5.0) -> bool:
    """A PNG of line charts side by side; each panel is ``{"title", "xlabel", "ylabel", "series": {label:
    (xs, ys)}, "hlines": {label: y} (optional), "logx": bool (optional), "bands": {label: (xs, lo, hi)}
    (optional: a shaded range behind the series of that label)}``. Returns False, saying so, when matplotlib
    is missing (``pip install 'roformer-dist[plot]'``): benches print their tables all the same."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"{Path(sys.argv[0]).stem}: matplotlib is not installed (pip install 'roformer-dist[plot]'): "
              f"{os.fspath(path)} not written", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(width * len(panels), 3.6), dpi=100, squeeze=False)
    for ax, panel in zip(axes[0], panels):
        colors = {}
        for label, (xs, ys) in panel["series"].items():
            line, = ax.plot(xs, ys, marker="o" if len(xs) <= 12 else None, markersize=3, linewidth=1.5,
                            label=label)
            colors[label] = line.get_color()
        for label, (xs, lo, hi) in panel.get("bands", {}).items():
            ax.fill_between(xs, lo, hi, color=colors.get(label), alpha=0.2, linewidth=0)
        for i, (label, y) in enumerate(panel.get("hlines", {}).items()):
            ax.axhline(y, color="gray", linestyle=("--", ":", "-.")[i % 3], linewidth=1, label=label)
        if panel.get("logx"):
            ax.set_xscale("log")
            xs = sorted({x for xs, _ in panel["series"].values() for x in xs})
            ax.set_xticks(xs, [f"{x:g}" for x in xs])
            ax.minorticks_off()
        ax.set_title(panel.get("title", ""), fontsize=10)
        ax.set_xlabel(panel.get("xlabel", ""))
        ax.set_ylabel(panel.get("ylabel", ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True
