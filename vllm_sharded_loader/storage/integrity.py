"""Checksums of part files, computed as the bytes stream through: BLAKE3 (a pinned manifest pins the
weights) over fixed-size blocks, so that a partial reader verifies exactly the blocks it touches."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..format.errors import CheckpointCorrupt, CheckpointMismatch, Unsupported
from ..format.manifest import HASH_NAME, FileChecksum

BLOCK_SIZE = 16 * 1024 * 1024


def _blake3() -> Any:
    """A new BLAKE3 hasher, imported on first use: reading without checksums needs no ``blake3``."""
    try:
        import blake3
    except ImportError:
        raise Unsupported(
            "checksums need the blake3 package, which is not installed: pip install blake3 "
            "(or load with verify='size')."
        ) from None
    return blake3.blake3()


class BlockHasher:
    """Feed a file's bytes in order; get the digest of every block."""

    def __init__(self, block_size: int | None = None) -> None:
        self.block_size = block_size or BLOCK_SIZE
        self.digests: list[str] = []
        self._hasher = _blake3()
        self._filled = 0
        self.position = 0

    def update(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.block_size - self._filled)
            self._hasher.update(view[:take])
            self._filled += take
            self.position += take
            view = view[take:]
            if self._filled == self.block_size:
                self._block_done(self._hasher.hexdigest())
                self._hasher, self._filled = _blake3(), 0

    def _block_done(self, digest: str) -> None:
        self.digests.append(digest)

    def finish(self) -> FileChecksum:
        """Close the last (short) block; an empty file has one digest, of no bytes."""
        if self._filled or not self.digests:
            self._block_done(self._hasher.hexdigest())
            self._hasher, self._filled = _blake3(), 0
        return FileChecksum(HASH_NAME, self.block_size, tuple(self.digests))


class BlockVerifier(BlockHasher):
    """A :class:`BlockHasher` that compares each block with the recorded digest as it completes."""

    def __init__(self, path: str, expected: FileChecksum) -> None:
        if expected.algorithm != HASH_NAME:
            raise CheckpointMismatch(
                f"{path}: checksum algorithm {expected.algorithm!r} is not supported (this version "
                f"verifies {HASH_NAME!r}); upgrade vllm-sharded-loader or verify with 'size'."
            )
        super().__init__(expected.block_size)
        self.path, self.expected = path, expected

    def _block_done(self, digest: str) -> None:
        index = len(self.digests)
        start = index * self.block_size
        check_block(self.path, self.expected, index, start, self.position, digest)  # (the last block is short)
        super()._block_done(digest)

    def finish(self) -> FileChecksum:
        result = super().finish()
        if len(result.blocks) != len(self.expected.blocks):
            raise CheckpointCorrupt(
                f"{self.path}: {len(result.blocks)} checksum blocks read, {len(self.expected.blocks)} recorded; "
                "the file has another length than the one saved. Copy or save it again."
            )
        return result


def check_block(path: str, expected: FileChecksum, index: int, start: int, end: int, digest: str) -> None:
    """Raise unless ``digest`` is the recorded digest of block ``index`` of ``path`` (every verification's check)."""
    want = expected.blocks[index] if index < len(expected.blocks) else None
    if digest != want:
        raise CheckpointCorrupt(
            f"{path}: checksum mismatch in bytes {start}..{end} (block {index}): "
            "the file is corrupt or was modified after it was saved. Copy it again from the source "
            "or save the checkpoint again."
        )


def digest_of(views: Iterable[memoryview]) -> str:
    """The BLAKE3 digest of consecutive byte views, each hashed before the next is taken."""
    hasher = _blake3()
    for view in views:
        hasher.update(view)
    return hasher.hexdigest()
