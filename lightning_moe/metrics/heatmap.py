"""Expert-load heatmap (layers x experts) drawn with matplotlib, an optional dependency.

matplotlib is imported lazily, here only, when a heatmap is drawn (``pip install -e
".[plot]"`` in a clone); without it :func:`heatmap_available` is False and :func:`render_heatmap`
raises an ``ImportError`` naming the extra. Figures are built with ``matplotlib.figure.Figure`` on
an Agg canvas, never through ``pyplot``: no global figure registry, no GUI backend, and the
process's own backend choice is left alone (matplotlib's recommended way to draw off screen).

The figure: one row per MoE layer, one column per expert, viridis colours from 0 to the largest
count (perceptually uniform and readable in grey scale), a colour bar in tokens, the window's
steps in the title, and the figure size and tick spacing scaled with the expert count so that 64
or 256 experts stay legible. Small matrices also carry the count in every cell.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_moe.install_hints import install_hint

if TYPE_CHECKING:  # only for annotations: matplotlib is optional
    from matplotlib.figure import Figure

__all__ = ["HEATMAP_EXTRA_HINT", "figure_to_rgb", "heatmap_available", "render_heatmap", "save_heatmap"]

HEATMAP_EXTRA_HINT = f"install matplotlib: {install_hint('plot')}"
"""How to get the optional plotting dependency (quoted by every message about it)."""

_DPI = 100
_ANNOTATE_MAX_CELLS = 128  # counts are written into the cells of matrices this small
_ANNOTATE_MIN_CELL_PX = 28  # ... when a cell is at least this wide


def _matplotlib() -> tuple[Any, Any, Any]:
    """``(Figure, FigureCanvasAgg, ticker)``; raises ImportError with the install hint."""
    try:
        from matplotlib import ticker
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(f"The expert-load heatmap needs matplotlib: {HEATMAP_EXTRA_HINT}.") from err
    return Figure, FigureCanvasAgg, ticker


def heatmap_available() -> bool:
    """Whether matplotlib can be imported (the heatmap's only optional dependency)."""
    try:
        _matplotlib()
    except ImportError:
        return False
    return True


def _figure_size(layers: int, experts: int) -> tuple[float, float]:
    """Inches: about 0.16 in (16 px) per expert and 0.3 in per layer, clamped to a page."""
    width = min(18.0, max(6.0, 2.6 + 0.16 * experts))
    height = min(12.0, max(3.0, 1.9 + 0.3 * layers))
    return width, height


def _format_count(value: float) -> str:
    """Short count: ``850``, ``9999``, ``12.5k``, ``3.1M``."""
    for threshold, divisor, suffix in ((1e9, 1e9, "G"), (1e6, 1e6, "M"), (1e4, 1e3, "k")):
        if abs(value) >= threshold:
            return f"{value / divisor:.3g}{suffix}"
    return f"{value:.0f}"


def _title(title: str, step: int | None, first_step: int | None, counts: Tensor) -> str:
    """Title with the window's steps; second line: the worst layer's max / mean load."""
    if step is None:
        steps = ""
    elif first_step is None or first_step == step:
        steps = f", step {step}"
    else:
        steps = f", optimizer steps {first_step}-{step}"
    means = counts.mean(dim=1)
    if not (means > 0).any():
        return f"{title}{steps}\nno tokens routed"
    # Layers without tokens have no imbalance (NaN in the metric); -1 keeps them out of the max.
    ratios = torch.where(means > 0, counts.amax(dim=1) / means.clamp_min(1e-30), -1.0)
    worst = int(ratios.argmax())
    return f"{title}{steps}\nmax/mean load {ratios[worst].item():.2f} (layer {worst}), 1.00 = balanced"


def render_heatmap(
    matrix: Tensor,
    step: int | None = None,
    first_step: int | None = None,
    title: str = "Expert load",
) -> Figure:
    """Draw ``matrix`` ``[layers, experts]`` (tokens per expert) as a matplotlib ``Figure``.

    Args:
        matrix: tokens routed to each (layer, expert) in the window; any real dtype.
        step: last optimizer step of the window (shown in the title).
        first_step: first optimizer step of the window; the title says ``steps first-step``.
        title: first words of the title.

    Colours run from 0 to the largest count of the window (each figure has its own scale: read
    the colour bar). The second title line gives the worst layer's ``max / mean`` load (the ``imbalance`` of
    :class:`~lightning_moe.metrics.ExpertLoadMetric`). Save it with :func:`save_heatmap` or hand
    it to a logger (TensorBoard's ``add_figure``); it belongs to no ``pyplot`` state, so dropping
    the last reference frees it.
    """
    if matrix.dim() != 2 or matrix.numel() == 0:
        raise ValueError(
            f"render_heatmap needs a non-empty 2-D matrix [layers, experts], got shape {tuple(matrix.shape)}."
        )
    figure_cls, canvas_cls, ticker = _matplotlib()
    counts = matrix.detach().double().cpu()
    values = counts.numpy()
    layers, experts = values.shape
    top = float(values.max()) if values.max() > 0 else 1.0  # an all-zero window still gets a valid scale

    figure = figure_cls(figsize=_figure_size(layers, experts), dpi=_DPI, layout="constrained")
    canvas_cls(figure)  # attaches the Agg canvas: savefig and draw work without pyplot
    axes = figure.add_subplot()
    image = axes.imshow(values, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0.0, vmax=top,
                        origin="upper")
    axes.set_xlabel("expert")
    axes.set_ylabel("MoE layer")
    axes.set_title(_title(title, step, first_step, counts), fontsize=11)
    # Every index up to 24 experts / 16 layers, beyond that integer ticks spaced 2, 4, 5, 8,
    # 10, ... (about 24 / 16 labels: no overlap at 256 experts) with a minor tick on every cell.
    for axis, count, most in ((axes.xaxis, experts, 24), (axes.yaxis, layers, 16)):
        if count <= most:
            axis.set_major_locator(ticker.FixedLocator(range(count)))
        else:
            axis.set_major_locator(ticker.MaxNLocator(nbins=most, integer=True, steps=[1, 2, 4, 5, 8, 10]))
            axis.set_minor_locator(ticker.FixedLocator(range(count)))
    axes.set_xlim(-0.5, experts - 0.5)
    axes.set_ylim(layers - 0.5, -0.5)
    colour_bar = figure.colorbar(image, ax=axes, fraction=0.05, pad=0.02)
    colour_bar.set_label("tokens per expert")
    # Whole tokens only (no 0.2-token ticks on a small scale), about 5 labels on a short bar.
    colour_bar.locator = ticker.MaxNLocator(nbins=5, integer=True, steps=[1, 2, 2.5, 5, 10])
    colour_bar.formatter = ticker.FuncFormatter(lambda value, _: _format_count(value))
    colour_bar.update_ticks()

    width_px = figure.get_figwidth() * _DPI * 0.8 / experts  # the heatmap takes ~80 % of the width
    if layers * experts <= _ANNOTATE_MAX_CELLS and width_px >= _ANNOTATE_MIN_CELL_PX:
        for layer in range(layers):
            for expert in range(experts):
                value = values[layer, expert]
                dark = value / top < 0.6  # viridis is dark below ~60 %: white text there
                axes.text(expert, layer, _format_count(value), ha="center", va="center", fontsize=9,
                          color="white" if dark else "black")
    # Constrained layout settles on the second layout pass (the first one measures text without a
    # layout): run one now so that every output of this figure (PNG, pixels, TensorBoard) matches.
    figure.draw_without_rendering()
    return figure


def save_heatmap(path: str | Path, figure: Figure) -> Path:
    """Write ``figure`` to ``path`` as a PNG (creating parent folders); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=_DPI)
    return path


def figure_to_rgb(figure: Figure):
    """The drawn figure as a numpy ``uint8 [height, width, 3]`` array (what W&B's ``Image`` takes)."""
    import numpy as np  # a matplotlib dependency: present whenever a figure exists

    figure.canvas.draw()
    return np.asarray(figure.canvas.buffer_rgba())[..., :3].copy()

