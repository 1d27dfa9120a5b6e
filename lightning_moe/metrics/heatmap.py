"""Expert-load heatmap (layers x experts) as an RGB image, and a minimal PNG writer.

No plotting library: :func:`render_heatmap` colours each cell with a viridis approximation
(linear interpolation between nine anchor colours of matplotlib's viridis, perceptually uniform
and readable in grey scale), enlarges the cells so even a 2 x 8 matrix is clearly visible, and
optionally draws axis labels (``L<i>`` per layer row, the expert index over each column) and a
colour bar with its minimum and maximum, in a built-in 3 x 5 pixel font. :func:`encode_png` writes
8-bit RGB PNG bytes with ``zlib`` and ``struct`` (filter type 0 on every row).

Images are ``torch.uint8`` tensors of shape ``[height, width, 3]`` (HWC), the layout TensorBoard's
``add_image(..., dataformats="HWC")`` takes.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["VIRIDIS_ANCHORS", "colormap", "encode_png", "render_heatmap", "write_png"]

VIRIDIS_ANCHORS = (
    (68, 1, 84), (71, 44, 122), (59, 81, 139), (44, 113, 142), (33, 144, 141),
    (39, 173, 129), (92, 200, 99), (170, 220, 50), (253, 231, 37),
)
"""matplotlib's viridis at 0, 1/8, ..., 1 (RGB); the colour map interpolates linearly between them."""

_BACKGROUND, _INK = 255, 0
_FONT_SCALE = 2  # glyph pixels are drawn as 2 x 2 squares
_GLYPHS = {  # 3 x 5 bitmaps, rows top to bottom
    "0": ("111", "101", "101", "101", "111"), "1": ("010", "110", "010", "010", "111"),
    "2": ("111", "001", "111", "100", "111"), "3": ("111", "001", "111", "001", "111"),
    "4": ("101", "101", "111", "001", "001"), "5": ("111", "100", "111", "001", "111"),
    "6": ("111", "100", "111", "101", "111"), "7": ("111", "001", "001", "001", "001"),
    "8": ("111", "101", "111", "101", "111"), "9": ("111", "101", "111", "001", "111"),
    ".": ("000", "000", "000", "000", "010"), "-": ("000", "000", "111", "000", "000"),
    "k": ("100", "101", "110", "101", "101"), "M": ("101", "111", "111", "101", "101"),
    "G": ("111", "100", "101", "101", "111"), "L": ("100", "100", "100", "100", "111"),
    "E": ("111", "100", "111", "100", "111"), " ": ("000",) * 5,
}
_GLYPH_W, _GLYPH_H = 4 * _FONT_SCALE, 5 * _FONT_SCALE  # advance (3 + 1 spacing) and height
_PAD = 6
_BAR_WIDTH = 14
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def colormap(values: Tensor) -> Tensor:
    """Viridis colours of ``values`` in ``[0, 1]`` (clamped; NaN as 0): ``uint8 [..., 3]``."""
    anchors = torch.tensor(VIRIDIS_ANCHORS, dtype=torch.float32)
    position = torch.nan_to_num(values.detach().float().cpu(), nan=0.0).clamp(0, 1) * (len(anchors) - 1)
    low = position.floor().long().clamp(max=len(anchors) - 2)
    frac = (position - low).unsqueeze(-1)
    colour = anchors[low] * (1 - frac) + anchors[low + 1] * frac
    return colour.round().to(torch.uint8)


def _text_width(text: str) -> int:
    return len(text) * _GLYPH_W - _FONT_SCALE


def _draw_text(canvas: Tensor, text: str, x: int, y: int) -> None:
    """Draw ``text`` with its top-left corner at pixel ``(x, y)``; clipped at the canvas edges."""
    height, width = canvas.shape[:2]
    for index, char in enumerate(text):
        for row, bits in enumerate(_GLYPHS[char]):
            for col, bit in enumerate(bits):
                if bit == "1":
                    top, left = y + row * _FONT_SCALE, x + index * _GLYPH_W + col * _FONT_SCALE
                    if 0 <= top <= height - _FONT_SCALE and 0 <= left <= width - _FONT_SCALE:
                        canvas[top : top + _FONT_SCALE, left : left + _FONT_SCALE] = _INK


def _format_number(value: float) -> str:
    """Short label for a colour-bar end: ``850``, ``12.5k``, ``3.1M``, ``0.25``."""
    magnitude = abs(value)
    for threshold, divisor, suffix in ((1e9, 1e9, "G"), (1e6, 1e6, "M"), (1e4, 1e3, "k")):
        if magnitude >= threshold:
            scaled = value / divisor
            text = f"{scaled:.3g}"
            return (f"{scaled:.0f}" if "e" in text else text) + suffix
    if float(value).is_integer():
        return str(int(value))
    text = f"{value:.3g}"
    return text if "e" not in text else f"{value:.2f}"  # the font has no exponent


def _default_cell_size(rows: int, cols: int) -> int:
    # About 400-600 pixels across for small expert counts, at least 2 pixels per cell for large ones.
    return max(2, min(48, 512 // max(cols, 1), 320 // max(rows, 1)))


def render_heatmap(
    matrix: Tensor,
    cell_size: int | None = None,
    vmin: float | None = 0.0,
    vmax: float | None = None,
    axes: bool = True,
) -> Tensor:
    """Render ``matrix`` ``[layers, experts]`` as an RGB image ``uint8 [H, W, 3]``.

    Args:
        matrix: values per (layer, expert), e.g. tokens per expert; any real dtype.
        cell_size: pixels per cell side (default: so that the image is a few hundred pixels
            wide); cells of 6 pixels or more are separated by a 1-pixel white gap.
        vmin, vmax: values mapped to the two ends of the colour map (default 0 and the matrix
            maximum; None for ``vmin`` means the matrix minimum). Values outside are clamped.
        axes: draw row labels ``L0, L1, ...``, expert indices over the columns (every k-th one
            when they do not fit) and a colour bar labelled with ``vmin`` and ``vmax``. Without
            axes the image is the cells only: exactly ``rows * cell_size`` x ``cols * cell_size``.
    """
    if matrix.dim() != 2 or matrix.numel() == 0:
        raise ValueError(f"render_heatmap needs a non-empty 2-D matrix [layers, experts], got shape {tuple(matrix.shape)}.")
    values = matrix.detach().double().cpu()
    rows, cols = values.shape
    cell = cell_size if cell_size is not None else _default_cell_size(rows, cols)
    if cell < 1:
        raise ValueError(f"cell_size must be >= 1, got {cell}.")
    low = float(values.min()) if vmin is None else float(vmin)
    high = float(values.max()) if vmax is None else float(vmax)
    span = high - low if high > low else 1.0
    colours = colormap((values - low) / span)  # [rows, cols, 3]
    cells = colours.repeat_interleave(cell, dim=0).repeat_interleave(cell, dim=1)
    if cell >= 6:  # white separators on the right and bottom edge of every cell
        edge = torch.arange(rows * cell) % cell == cell - 1
        cells[edge] = _BACKGROUND
        cells[:, torch.arange(cols * cell) % cell == cell - 1] = _BACKGROUND
    if not axes:
        return cells

    row_labels = [f"L{i}" for i in range(rows)]
    left = max(_text_width(label) for label in row_labels) + 2 * _PAD
    top = _GLYPH_H + 2 * _PAD
    bar_labels = (_format_number(high), _format_number(low))
    bar_x = left + cols * cell + 2 * _PAD
    width = bar_x + _BAR_WIDTH + _PAD + max(_text_width(t) for t in bar_labels) + _PAD
    body_height = max(rows * cell, 2 * _GLYPH_H + 2 * _PAD)
    height = top + body_height + _PAD
    canvas = torch.full((height, width, 3), _BACKGROUND, dtype=torch.uint8)
    canvas[top : top + rows * cell, left : left + cols * cell] = cells

    row_step = max(1, -(-(_GLYPH_H + _FONT_SCALE) // cell))  # label every row_step-th layer
    for i in range(0, rows, row_step):  # layer labels, right-aligned, vertically centred
        label = row_labels[i]
        y = max(top, top + i * cell + (cell - _GLYPH_H) // 2)
        _draw_text(canvas, label, left - _PAD - _text_width(label), y)
    _draw_text(canvas, "E", left - _PAD - _text_width("E"), _PAD)
    widest = _text_width(str(cols - 1)) + _FONT_SCALE * 2
    step = max(1, -(-widest // cell))  # label every step-th expert so labels do not overlap
    for j in range(0, cols, step):
        label = str(j)
        _draw_text(canvas, label, left + j * cell + (cell - _text_width(label)) // 2, _PAD)

    bar_height = rows * cell  # colour bar: vmax at the top, vmin at the bottom
    ramp = torch.linspace(1.0, 0.0, bar_height)
    canvas[top : top + bar_height, bar_x : bar_x + _BAR_WIDTH] = colormap(ramp).unsqueeze(1)
    label_x = bar_x + _BAR_WIDTH + _PAD
    _draw_text(canvas, bar_labels[0], label_x, top)
    _draw_text(canvas, bar_labels[1], label_x, top + max(bar_height, 2 * _GLYPH_H) - _GLYPH_H)
    return canvas


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(image: Tensor, compression: int = 6) -> bytes:
    """PNG bytes of an RGB ``uint8 [H, W, 3]`` image (8 bits per channel, no interlace)."""
    if image.dim() != 3 or image.shape[2] != 3 or image.dtype != torch.uint8:
        raise ValueError(
            f"encode_png needs a uint8 tensor of shape [height, width, 3], got {image.dtype} {tuple(image.shape)}."
        )
    height, width = image.shape[:2]
    rows = image.detach().cpu().reshape(height, width * 3)
    # Every scanline starts with its filter type (0 = None).
    scanlines = torch.cat([torch.zeros(height, 1, dtype=torch.uint8), rows], dim=1).contiguous().clone()
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"".join([
        _PNG_SIGNATURE,
        _chunk(b"IHDR", header),
        _chunk(b"IDAT", zlib.compress(bytes(scanlines.untyped_storage()), compression)),
        _chunk(b"IEND", b""),
    ])


def write_png(path: str | Path, image: Tensor) -> Path:
    """Write ``image`` (see :func:`encode_png`) to ``path``, creating parent folders; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_png(image))
    return path
