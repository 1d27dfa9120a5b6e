"""The expert-load heatmap: what the figure shows, that it stays legible, and life without matplotlib.

Oracles: the input matrix itself (the image's data must be it, unscaled), hand-written titles,
and geometry read back from matplotlib's own renderer (text boxes in pixels) after drawing the
figure at its saved size. PNG files are read back with Pillow (a matplotlib dependency), not with
code under test.
"""

from __future__ import annotations

import itertools
import re
import sys

import pytest
import torch

from lightning_moe.metrics import figure_to_rgb, heatmap_available, render_heatmap, save_heatmap

matplotlib = pytest.importorskip("matplotlib", reason="the heatmap needs the 'plot' extra (matplotlib)")
np = pytest.importorskip("numpy", reason="a matplotlib dependency")
PIL_Image = pytest.importorskip("PIL.Image", reason="Pillow is a matplotlib dependency")

SMALL = torch.tensor([[1200, 950, 1010, 896], [400, 2100, 800, 756]])
"""4 experts x 2 layers: layer 1 sends 2100 of its 4056 tokens to expert 1 (max/mean 2.07)."""


def _big() -> torch.Tensor:
    """64 experts x 4 layers of ~500 tokens, one hot expert (layer 1, expert 17) and 8 cold ones."""
    counts = torch.poisson(torch.full((4, 64), 500.0), generator=torch.Generator().manual_seed(0)).long()
    counts[1, 17] = 2400
    counts[3, :8] = 50
    return counts


def _drawn_tick_labels(axis) -> list:
    """Major tick labels inside the axis's view (the locator also returns some just outside it)."""
    low, high = sorted(axis.get_view_interval())
    return [label for loc, label in zip(axis.get_majorticklocs(), axis.get_majorticklabels()) if low <= loc <= high]


def _texts_overlap(texts) -> list[tuple[str, str]]:
    boxes = [(t.get_text(), t.get_window_extent()) for t in texts if t.get_visible() and t.get_text()]
    return [(a, b) for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2) if box_a.overlaps(box_b)]


def test_figure_shows_the_counts_with_title_axes_and_colour_bar():
    figure = render_heatmap(SMALL, step=240, first_step=221)
    heat, bar = figure.axes
    image = heat.images[0]
    assert image.get_array().tolist() == SMALL.tolist()  # the counts themselves, not a rescaled copy
    assert image.get_clim() == (0.0, 2100.0)
    assert heat.get_title() == "Expert load, optimizer steps 221-240\nmax/mean load 2.07 (layer 1), 1.00 = balanced"
    assert (heat.get_xlabel(), heat.get_ylabel()) == ("expert", "MoE layer")
    assert "tokens" in bar.get_ylabel()
    assert [int(t) for t in heat.get_xticks()] == [0, 1, 2, 3] and [int(t) for t in heat.get_yticks()] == [0, 1]
    # A matrix this small carries every count in its cell.
    assert sorted(t.get_text() for t in heat.texts) == sorted(str(v) for v in SMALL.flatten().tolist())


@pytest.mark.parametrize(
    ("kwargs", "title"),
    [
        ({"step": 7}, "Expert load, step 7"),
        ({"step": 7, "first_step": 7}, "Expert load, step 7"),
        ({}, "Expert load"),
        ({"step": 3, "title": "Router load"}, "Router load, step 3"),
    ],
)
def test_title_names_the_step(kwargs, title):
    assert render_heatmap(SMALL, **kwargs).axes[0].get_title().split("\n")[0] == title


def test_zero_window_draws_a_valid_scale():
    figure = render_heatmap(torch.zeros(1, 8, dtype=torch.int64), step=1)
    assert figure.axes[0].images[0].get_clim() == (0.0, 1.0)
    assert figure.axes[0].get_title().endswith("no tokens routed")
    assert [float(t) for t in figure.axes[1].get_yticks() if 0 <= t <= 1] == [0.0, 1.0]  # whole tokens only


@pytest.mark.parametrize(("layers", "experts"), [(2, 4), (4, 64), (58, 256), (1, 1)])
def test_figure_stays_legible(tmp_path, layers, experts):
    """No overlapping labels, everything inside the canvas, cells of a visible size."""
    counts = _big() if (layers, experts) == (4, 64) else torch.arange(layers * experts).view(layers, experts) + 1
    figure = render_heatmap(counts, step=10, first_step=1)
    path = save_heatmap(tmp_path / "sub" / "heat.png", figure)
    figure.canvas.draw()
    heat, bar = figure.axes
    width, height = figure.canvas.get_width_height()
    with PIL_Image.open(path) as png:
        assert png.size == (width, height)  # saved at the drawn size
    for axis in (heat.xaxis, heat.yaxis, bar.yaxis):
        assert _texts_overlap(_drawn_tick_labels(axis)) == [], axis
    canvas_box = figure.bbox
    for text in [heat.title, heat.xaxis.label, heat.yaxis.label, bar.yaxis.label,
                 *_drawn_tick_labels(heat.xaxis), *_drawn_tick_labels(heat.yaxis), *_drawn_tick_labels(bar.yaxis)]:
        if text.get_visible() and text.get_text():
            box = text.get_window_extent()
            assert canvas_box.x0 <= box.x0 and box.x1 <= canvas_box.x1 + 1, text.get_text()
            assert canvas_box.y0 <= box.y0 and box.y1 <= canvas_box.y1 + 1, text.get_text()
    cell_w, cell_h = heat.get_window_extent().width / experts, heat.get_window_extent().height / layers
    assert cell_w >= 5 and cell_h >= 10, (cell_w, cell_h)
    assert width <= 1800 and height <= 1200
    if experts >= 64:
        assert 8 <= len(heat.get_xticks()) <= 25 and all(float(t).is_integer() for t in heat.get_xticks())


def test_figure_to_rgb_matches_the_png(tmp_path):
    figure = render_heatmap(SMALL, step=1)
    rgb = figure_to_rgb(figure)
    assert rgb.dtype.name == "uint8" and rgb.ndim == 3 and rgb.shape[2] == 3
    with PIL_Image.open(save_heatmap(tmp_path / "h.png", figure)) as png:
        assert png.size == (rgb.shape[1], rgb.shape[0])
        assert np.array_equal(rgb, np.asarray(png.convert("RGB")))


@pytest.mark.parametrize("bad", [torch.zeros(4), torch.zeros(0, 4), torch.zeros(2, 2, 2)])
def test_render_refuses_other_shapes(bad):
    with pytest.raises(ValueError, match=r"non-empty 2-D matrix \[layers, experts\], got shape"):
        render_heatmap(bad)


def test_without_matplotlib_the_error_names_the_extra(monkeypatch):
    # None in sys.modules makes the import fail, as on an install without the extra.
    for name in ("matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    assert heatmap_available() is False
    with pytest.raises(ImportError, match=re.escape('pip install -e ".[plot]"')):
        render_heatmap(SMALL)
    monkeypatch.undo()
    assert heatmap_available() is True

