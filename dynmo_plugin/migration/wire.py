"""Packing a layer's state into a few flat buffers for point-to-point transfer.

One contiguous buffer per dtype (a layer is usually one buffer) so a move is one large
send rather than dozens of small ones; a header (plain data) says where each tensor
lies. Checksums are computed on the device, so verifying a GPU transfer costs no host
copy of the data.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

__all__ = ["Segment", "Header", "pack", "unpack", "checksum", "dtype_of", "empty_buffers",
           "CHECKSUM_CHUNK_WORDS", "checksum_transient_bytes"]

_PRIME = 65521
# Words per step of the device checksum: its temporaries (the words and their weights,
# both int64, multiplied in place) are 16 B/word, so 16 MiB at most whatever the size.
CHECKSUM_CHUNK_WORDS = 1 << 20


def checksum_transient_bytes(nbytes: int, chunk_words: int = CHECKSUM_CHUNK_WORDS) -> int:
    """Device bytes the checksum of an `nbytes` buffer allocates beside it, at most:
    two int64 temporaries of one chunk, plus the int64 accumulators and partial sums.
    What the migration's transient-memory model adds for checksumming on CUDA (one
    buffer at a time)."""
    words = nbytes // 4 if nbytes % 4 == 0 else nbytes
    return 2 * 8 * min(words, chunk_words) + 4 * 8


@dataclass(frozen=True)
class Segment:
    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    device: str = "cpu"  # device type the tensor lived on at the source (e.g. Adam's step)


@dataclass
class Header:
    """What a receiver must allocate and how to verify and split it."""

    layer: int
    src: int
    dst: int
    segments: list[Segment] = field(default_factory=list)
    buffers: list[tuple[str, int, tuple[int, int]]] = field(default_factory=list)  # dtype, numel, checksum
    frozen: tuple[str, ...] = ()  # parameters with requires_grad=False (they stay frozen)

    @property
    def nbytes(self) -> int:
        return sum(n * dtype_of(d).itemsize for d, n, _ in self.buffers)


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a header names ("torch.float32")."""
    return getattr(torch, name.removeprefix("torch."))


def checksum(buf: torch.Tensor) -> tuple[int, int]:
    """CRC32 of the raw bytes on CPU (zero-copy); on GPU a sum and a position-weighted
    sum of the 32-bit words, computed on the device (no host copy of the data)."""
    raw = buf.detach().contiguous().view(torch.uint8)
    if raw.device.type == "cpu":
        return zlib.crc32(raw.numpy()), raw.numel()
    return word_checksum(raw)


def word_checksum(raw: torch.Tensor, chunk_words: int = CHECKSUM_CHUNK_WORDS) -> tuple[int, int]:
    """(sum of the words, sum of word x (position mod 65521 + 1)) over the 32-bit words
    of the bytes `raw` (its bytes where the length is not a multiple of 4), in int64
    with two's-complement wrap-around. Chunked, so the int64 temporaries stay within
    `checksum_transient_bytes` (a whole-buffer version needed ~6-8x the buffer);
    wrap-around addition is associative, so the value does not depend on the chunk."""
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    total = torch.zeros((), dtype=torch.int64, device=raw.device)
    weighted = torch.zeros((), dtype=torch.int64, device=raw.device)
    for start in range(0, words.numel(), chunk_words):
        part = words[start:start + chunk_words].to(torch.int64)
        weights = torch.arange(start, start + part.numel(), device=raw.device,
                               dtype=torch.int64).remainder_(_PRIME).add_(1)
        total += part.sum()
        weighted += weights.mul_(part).sum()
        del part, weights
    return int(total), int(weighted)


def pack(layer: int, src: int, dst: int, tensors: dict[str, torch.Tensor],
         device: torch.device, frozen: tuple[str, ...] = ()) -> tuple[Header, list[torch.Tensor]]:
    """Flatten `tensors` into one buffer per dtype on `device` (the transfer device)."""
    header = Header(layer=layer, src=src, dst=dst, frozen=tuple(frozen))
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for key, t in tensors.items():
        by_dtype.setdefault(t.dtype, []).append((key, t))
    buffers = []
    for dtype, items in by_dtype.items():
        offset = 0
        for key, t in items:
            header.segments.append(Segment(key, str(dtype), tuple(t.shape), offset, t.numel(),
                                           t.device.type))
            offset += t.numel()
        buf = torch.cat([t.detach().reshape(-1).to(device) for _, t in items])
        buffers.append(buf)
        header.buffers.append((str(dtype), offset, checksum(buf)))
    return header, buffers


def empty_buffers(header: Header, device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(n, dtype=dtype_of(d), device=device) for d, n, _ in header.buffers]


def unpack(header: Header, buffers: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split received buffers back into named tensors (views of the buffers), each on
    its source device type (CPU-resident state returns to the CPU)."""
    by_dtype = {d: b for (d, _, _), b in zip(header.buffers, buffers)}
    out = {}
    for s in header.segments:
        t = by_dtype[s.dtype][s.offset:s.offset + s.numel].view(s.shape)
        out[s.key] = t.cpu() if s.device == "cpu" else t
    return out
