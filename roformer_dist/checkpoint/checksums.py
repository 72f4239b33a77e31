"""Content hashes of checkpoint files: what makes a flipped bit or a same-size overwrite visible.

Every file of a save gets an XXH3-128 digest (``xxhash``; ~10 GB/s on one core here, against ~1.4 GB/s for
sha256), recorded in the checkpoint's ``COMPLETE`` marker beside its size. The writer computes it: the
synchronous save reads its files back once they are durable (from the page cache, each rank a share), the
asynchronous writer hashes the bytes it holds before writing them. Whoever reads a checkpoint (resume,
``to-hf``, ``roformer-eval``, a fork, ``roformer-convert verify``) compares. A checkpoint written before
checksums existed has none and is checked by size and structure only.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import xxhash

__all__ = ["ALGORITHM", "digest_bytes", "digest_file"]

ALGORITHM = "xxh3_128"
"""The name COMPLETE records (``"hash"``), so that another algorithm can come later without confusion."""


def digest_bytes(data: bytes | memoryview) -> str:
    """The hex digest of ``data``."""
    return xxhash.xxh3_128_hexdigest(data)


def digest_file(path: Path) -> str:
    """The hex digest of a file's content, read through a memory map (no copy); OSError when unreadable."""
    with open(path, "rb") as f:
        if Path(path).stat().st_size == 0:
            return digest_bytes(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return digest_bytes(m)
