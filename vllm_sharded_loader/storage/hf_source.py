"""A Hugging Face model's safetensors weights, indexed by tensor and read where they are (``convert``'s source)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..format.errors import (
    CheckpointCorrupt,
    CheckpointNotFound,
    ConvertRefused,
    ShardedStateError,
    StorageError,
    listing,
)
from ..format.names import MANIFEST_NAME
from ..format.safetensors import Header
from . import hub
from .folder import LocalStore
from .local import OpenFile, open_regular, preadv_all, read_header
from .location import Store, StoredFile, check_no_special_files, open_store
from .memory import BufferPool
from .model_files import check_no_links_to_nothing
from .oscalls import available_memory, will_need
from .tensors import torch_dtype

INDEX_NAME = "model.safetensors.index.json"
READ_AHEAD_STEP = 8 << 20


def weight_files(store: Store) -> tuple[list[str], dict[str, str]]:
    """The model's safetensors files (those its index lists, if any) and the index's tensor-to-file map."""
    where = store.where
    present = store.list_names()
    names = sorted(n for n in present if n.endswith(".safetensors"))
    weight_map: dict[str, str] = {}
    if INDEX_NAME in present:
        index_path = store.file_path(INDEX_NAME)
        try:
            data = store.read(INDEX_NAME)
            if isinstance(data, Path):  # never blocking on a FIFO
                with os.fdopen(open_regular(str(data)), "rb") as f:
                    data = f.read()
            weight_map = json.loads(data)["weight_map"]
            not_names = [v for v in weight_map.values() if not isinstance(v, str)]
            if not_names:  # a number or null would be a bare TypeError below
                raise TypeError(f"a tensor's file is {not_names[0]!r}, not a file name")
            listed = sorted(set(weight_map.values()))
        except ShardedStateError:
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise CheckpointCorrupt(f"{index_path}: not a safetensors index ({e}). Download the model again.") from None
        outside = [n for n in listed if os.path.basename(n) != n or n in (".", "..")]
        if outside:
            raise CheckpointCorrupt(
                f"{index_path} lists {listing(outside, 5)}: a file outside the folder, where an index names files "
                "beside it. Refusing to read it; download the model again."
            )
        missing = [n for n in listed if n not in names]
        if missing:
            raise CheckpointNotFound(
                f"{where}: the index {INDEX_NAME} lists {listing(missing, 5)}, which the folder lacks. "
                "The download is incomplete: fetch the missing files (or the model) again."
            )
        names = listed
    elif MANIFEST_NAME in present:  # a sharded checkpoint's parts are no model's weights
        raise ConvertRefused(
            f"{where} holds a sharded checkpoint ({MANIFEST_NAME}), not a Hugging Face model's weights; nothing "
            "was written. Change its TP/PP size with `vllm-sharded reshard`, or, where the model's own "
            "safetensors files share the folder, move the checkpoint into a folder of its own."
        )
    if not names:
        held = [n for n in present if n.endswith((".bin", ".pt", ".pth"))]
        other = f" (it holds {listing(held, 3)}: convert reads safetensors only; use `vllm-sharded save`)"
        raise CheckpointNotFound(f"{where}: no *.safetensors weights{other if held else ''}.")
    return names, weight_map


# The read-ahead's own process, off vLLM's GIL. It reads rather than WILLNEED (one window per call),
# so stopping it leaves no queue the ranks' reads wait behind. It stops once its parent (``argv[3]``)
# is gone: a convert killed outright cannot stop it.
_READ_AHEAD = """
import os, signal, stat, sys
budget, step, parent, asked = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), 0
buffer = bytearray(step)
def done(*_):
    print(asked, flush=True)
    os._exit(0)
signal.signal(signal.SIGTERM, done)
for path in sys.argv[4:]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        continue
    try:
        info, offset = os.fstat(fd), 0
        while stat.S_ISREG(info.st_mode) and offset < info.st_size and asked < budget and os.getppid() == parent:
            n = os.preadv(fd, [memoryview(buffer)[: min(step, budget - asked)]], offset)
            if n <= 0:
                break
            offset, asked = offset + n, asked + n
    except OSError:
        pass
    finally:
        os.close(fd)
done()
"""


def read_ahead(where: str | Store, budget: int | None = None) -> Callable[[], int]:
    """Start reading a local model's safetensors files into the page cache in a process of its own,
    at most ``budget`` bytes (default: a quarter of available memory), while vLLM starts. Returns a
    function that stops it and says how many bytes it read. Nothing for object storage."""
    store = open_store(where)
    try:
        names = weight_files(store)[0] if isinstance(store, LocalStore) else []
    except (ShardedStateError, OSError):
        names = []
    if not names:
        return lambda: 0
    if budget is None:
        budget = available_memory() // 4
    paths = [store.file_path(name) for name in names]
    reader = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _READ_AHEAD, str(budget), str(READ_AHEAD_STEP), str(os.getpid()), *paths],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )

    read: list[int] = []

    def stopped() -> int:
        if not read:  # once, however often called
            reader.terminate()  # it says how far it got, and exits
            try:
                out = reader.communicate(timeout=10)[0]
            except subprocess.TimeoutExpired:
                reader.kill()
                out = reader.communicate()[0]
            read.append(int(out) if out.strip() else 0)
        return read[0]

    return stopped


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of the source checkpoint: where its bytes are."""

    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass
class SourceFiles:
    """A Hugging Face model's safetensors files, their headers read and checked, nothing else read.

    ``where`` holds the weights (a local folder, or an object-storage prefix read by ranged reads);
    ``directory`` is a local folder with the model's config and tokenizer.
    """

    directory: str
    tensors: dict[str, SourceTensor]
    headers: dict[str, Header]
    opened: dict[str, StoredFile] = field(default_factory=dict)
    where: str = ""
    store: Store | None = None
    # Tensors the index lists that no file holds: named only when something is missing (:meth:`stale_index`).
    unheld: list[str] = field(default_factory=list)
    # Memory reused once vLLM's loader lets go of a tensor: fresh memory faults on every first write.
    pool: BufferPool = field(default_factory=BufferPool)

    def __post_init__(self) -> None:
        self.where = self.where or self.directory
        self.store = self.store or open_store(self.where)

    @classmethod
    def open(cls, directory: str, where: str | None = None) -> SourceFiles:
        """Index the weights at ``where`` (default: ``directory``)."""
        where = where or directory
        store = open_store(where)
        if not store.exists():
            raise CheckpointNotFound(f"{where}: not a folder. Give a Hugging Face model folder or Hub repo id.")
        names, weight_map = weight_files(store)
        tensors: dict[str, SourceTensor] = {}
        headers: dict[str, Header] = {}
        source = cls(directory, tensors, headers, where=where, store=store)
        try:
            for name in names:
                opened = source._open(name)
                header = read_header(opened)
                headers[name] = header
                for tensor, h in header.tensors.items():
                    if tensor in tensors:
                        raise CheckpointCorrupt(
                            f"{opened.path}: tensor {tensor} is also in {tensors[tensor].file}. The checkpoint is "
                            "inconsistent: download the model again."
                        )
                    tensors[tensor] = SourceTensor(
                        tensor, name, torch_dtype(h.dtype, opened.path), h.shape, h.begin, h.end
                    )
        except BaseException:
            source.close()
            raise
        source.unheld = [t for t, file in weight_map.items() if t not in tensors or tensors[t].file != file]
        return source

    def stale_index(self) -> str:
        """A sentence for an error about missing weights that the index places in files; else empty."""
        if not self.unheld:
            return ""
        return (
            f" The index {INDEX_NAME} lists {listing(self.unheld, 3)} in files that do not hold them: the files "
            "and the index disagree (an incomplete or mixed download): download the model again."
        )

    def _open(self, name: str) -> StoredFile:
        if name not in self.opened:
            self.opened[name] = self.store.open_file(name)  # type: ignore[union-attr]
        return self.opened[name]

    @property
    def nbytes(self) -> int:
        return sum(t.end - t.begin for t in self.tensors.values())

    def meta(self, name: str) -> torch.Tensor:
        t = self.tensors[name]
        return torch.empty(t.shape, dtype=t.dtype, device="meta")

    def read(self, name: str) -> torch.Tensor:
        """The tensor, in memory of its own: one ``pread``, or one ranged read of the indexed object.

        Read, not mapped: a mapped file truncated meanwhile kills the process with SIGBUS."""
        t = self.tensors[name]
        opened = self._open(t.file)
        data = self.pool.empty((t.end - t.begin,), torch.uint8)
        if isinstance(opened, OpenFile):
            self._check_unchanged(opened)  # an object's by its conditional read
            try:
                if len(data):
                    preadv_all(opened.fd, [memoryview(data.numpy())], t.begin, opened.path)
            except CheckpointCorrupt:  # cut short since the check: said as the change it is
                self._check_unchanged(opened)
                raise
        elif len(data):
            stream = opened.stream()
            try:
                stream.readv([memoryview(data.numpy())], t.begin)
            finally:
                stream.close()
        return data.view(t.dtype).reshape(t.shape)

    def read_each(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for each of ``names`` in order, the next read while the caller uses this one."""
        with ThreadPoolExecutor(1, thread_name_prefix="source-read") as reader:
            ahead = reader.submit(self.read, names[0]) if names else None
            for i, name in enumerate(names):
                assert ahead is not None
                tensor = ahead.result()
                ahead = reader.submit(self.read, names[i + 1]) if i + 1 < len(names) else None
                yield name, tensor
                del tensor  # its memory reused once the caller lets go too

    def check_unchanged(self) -> None:
        """Refuse a local source file written since its header was read (two versions mixed)."""
        for opened in self.opened.values():
            if isinstance(opened, OpenFile):
                self._check_unchanged(opened)

    @staticmethod
    def _check_unchanged(opened: OpenFile) -> None:
        now = opened.identity_now()
        if now != opened.identity:
            sizes = f"{now.size} bytes, {opened.identity.size} when its header was read"
            raise CheckpointCorrupt(
                f"{opened.path}: changed while converting "
                f"({sizes if now.size != opened.identity.size else 'written since its header was read'}). "
                "Convert again once the model's files are complete."
            )

    def prefetch(self, names: list[str]) -> None:
        """Start reading these tensors' local bytes into the page cache, without waiting."""
        for name in names:
            t = self.tensors[name]
            opened = self._open(t.file)
            if isinstance(opened, OpenFile):
                will_need(opened.fd, t.begin, t.end)

    def close(self) -> None:
        for opened in self.opened.values():
            opened.close()
        self.opened.clear()


def resolve_source(source: str, revision: str | None = None) -> Store:
    """A local folder or an object-storage prefix as is; a Hub repo id through the Hub cache."""
    store = open_store(source)
    if store.exists():
        return store
    if os.path.exists(source) or source.startswith((".", "/")) or source.count("/") != 1:
        raise CheckpointNotFound(f"{source}: no such model folder (nor a Hub repo id of the form owner/name).")
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return hub.fetch(source, (*hub.METADATA_PATTERNS, "*.safetensors"), revision=revision)
    except ShardedStateError:
        raise
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError) as e:
        raise CheckpointNotFound(
            f"{source}: not found on the Hugging Face Hub nor in its cache ({type(e).__name__}). Check the repo "
            "id, set HF_TOKEN for a private or gated repository, or give a local folder."
        ) from e
    except Exception as e:  # network, server
        raise StorageError(f"{source}: cannot fetch from the Hugging Face Hub: {e}") from e


def check_source_files(source: Store) -> None:
    """Refuse a model holding a FIFO, device or socket, or a local link to nothing, before vLLM reads it."""
    check_no_special_files(source)
    if isinstance(source, LocalStore):
        check_no_links_to_nothing(source.where)
