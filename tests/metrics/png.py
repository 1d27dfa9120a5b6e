"""A minimal PNG decoder for tests, written from the PNG specification with ``zlib`` and ``struct``.

Imported as ``from metrics.png import decode_png`` (``tests/`` is on ``sys.path``; ``metrics`` here
is a namespace package of the test tree, like ``strategies``). It checks everything
``lightning_moe.metrics.encode_png`` promises: signature, chunk CRCs, IHDR fields (8-bit RGB, no
interlace), filter type 0 on every scanline, and the decompressed size.
"""

from __future__ import annotations

import struct
import zlib

import torch

__all__ = ["decode_png"]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def decode_png(data: bytes) -> torch.Tensor:
    """Pixels ``uint8 [height, width, 3]`` of an 8-bit RGB, non-interlaced, filter-0 PNG."""
    assert data[:8] == PNG_SIGNATURE
    position, chunks = 8, []
    while position < len(data):
        (length,) = struct.unpack(">I", data[position : position + 4])
        kind = data[position + 4 : position + 8]
        body = data[position + 8 : position + 8 + length]
        (crc,) = struct.unpack(">I", data[position + 8 + length : position + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, f"bad CRC in {kind!r}"
        chunks.append((kind, body))
        position += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    width, height, depth, colour, compression, filtering, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, colour, compression, filtering, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    assert len(raw) == height * (1 + 3 * width)
    rows = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(height, 1 + 3 * width)
    assert (rows[:, 0] == 0).all(), "every scanline uses filter type 0"
    return rows[:, 1:].reshape(height, width, 3).clone()
