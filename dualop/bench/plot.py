"""``dualop bench --plot FILE.png``: achieved GB/s per case and implementation against the copy
roofline measured in the same rounds. matplotlib (the ``bench`` extra), Agg backend, one PNG."""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["plot_throughput", "require_matplotlib", "check_path"]

# Where the dashed line goes: a kernel below this fraction of the copy bandwidth leaves a lot on
# the table for a memory-bound op.
GOOD_FRACTION = 0.6


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or ImportError saying how to install it."""
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError(f"--plot needs matplotlib ({err}); install it with: pip install 'dualop[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check_path(path: str) -> str:
    """``path`` if it names a PNG file, else ValueError."""
    if not isinstance(path, str) or not path.lower().endswith(".png"):
        raise ValueError(f"--plot: expected a file name ending in .png, got {path!r}")
    return path


def plot_throughput(records: list[dict], path: str) -> None:
    """Grouped bars of GB/s, one group per (case, shape, dtype), one bar per (frontend, impl);
    a solid line per group at its copy bandwidth and a dashed one at 60% of it."""
    check_path(path)
    timed = [r for r in records if r.get("op") != "dispatch" and r.get("gbps") is not None]
    if not timed:
        raise ValueError("--plot: no timed records to plot (every implementation failed or was filtered out)")
    plt = require_matplotlib()

    def group_of(r: dict) -> tuple:
        return (r["op"], "x".join(map(str, r["shape"])), r["dtype"])

    groups = list(dict.fromkeys(group_of(r) for r in timed))
    series = list(dict.fromkeys((r["frontend"], r["impl"]) for r in timed))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.2 + 0.35 * len(groups) * len(series)), 5.5))
    colors = plt.get_cmap("tab10")
    for k, (frontend, impl) in enumerate(series):
        xs, ys = [], []
        for g, key in enumerate(groups):
            match = [r for r in timed if group_of(r) == key and (r["frontend"], r["impl"]) == (frontend, impl)]
            if match:
                xs.append(g - 0.4 + width * (k + 0.5))
                ys.append(match[0]["gbps"])
        ax.bar(xs, ys, width=width * 0.95, color=colors(k % 10), label=f"{impl} ({frontend})")
    for g, key in enumerate(groups):
        copy = statistics.median(r["copy_gbps"] for r in timed if group_of(r) == key)
        ax.hlines(copy, g - 0.45, g + 0.45, colors="black", linewidth=1.5,
                  label="copy bandwidth (same rounds)" if g == 0 else None)
        ax.hlines(GOOD_FRACTION * copy, g - 0.45, g + 0.45, colors="black", linewidth=1.0, linestyles="dashed",
                  label=f"{GOOD_FRACTION:.0%} of copy" if g == 0 else None)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{op}\n{shape}\n{dtype}" for op, shape, dtype in groups], fontsize=8)
    ax.set_ylabel("achieved GB/s (kernel cost model bytes / median time)")
    allocators = ", ".join(sorted({r["allocator"] for r in timed}))
    ax.set_title(f"dualop bench: throughput against the copy roofline (allocator: {allocators})")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
