"""Tables (terminal and markdown are the same pipe tables) and the optional PNG plot."""

from pathlib import Path
from typing import Any, Optional


def fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != value:
            return "nan"
        if abs(value) >= 1e5:
            return f"{value:.3e}"
        return f"{value:.{digits}f}"
    return str(value)


def diff(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else a - b


def table(headers: list[str], rows: list[list[Any]], digits: int = 4) -> str:
    """A markdown pipe table, padded so it also reads well on a terminal."""
    cells = [[fmt(v, digits) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = lambda values: "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"  # noqa: E731
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), rule] + [line(r) for r in cells])


def plot_domain_differences(rows: list[dict], name_a: str, name_b: str, path: Path) -> Optional[str]:
    """Bar charts of the per-domain loss difference (A - B) and KL(A || B) as a PNG.

    Returns None when written, else the reason it was skipped (matplotlib not installed).
    """
    try:
        from matplotlib.figure import Figure  # drawn by Agg to the file; no pyplot state
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib to get the plot)"
    names = [r["set"] for r in rows]
    figure = Figure(figsize=(max(6, 1.6 * len(names) + 3), 4))
    left, right = figure.subplots(1, 2)
    left.bar(names, [r["loss_diff"] for r in rows], color="tab:blue")
    left.axhline(0, color="black", linewidth=0.8)
    left.set_title("held-out loss, A - B (nats/token)", fontsize=10)
    right.bar(names, [r["kl"] for r in rows], color="tab:orange")
    right.set_title("KL(A || B) (nats/token)", fontsize=10)
    figure.suptitle(f"A = {name_a}, B = {name_b}", fontsize=10)
    for axis in (left, right):
        axis.tick_params(axis="x", labelrotation=20)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return None
