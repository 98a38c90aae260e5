"""Reading planned byte ranges of files into tensors (:func:`read_pieces`); torch only, no vLLM.

Each thread streams one contiguous run of spans through its own descriptors (one readahead state
per stream), with one ``preadv`` per span. CPU targets of the stored dtype receive bytes directly;
targets that convert or live on an accelerator go through per-thread staging (:mod:`.staging`);
adoptable CPU targets are private mappings of the file (:mod:`.memory`). Huge pages are opt-in: a
VM whose host reclaims free guest memory loads slower with them. Cold local files may bypass the
page cache (:mod:`.direct`). A verified span is one checksum block, hashed by its thread.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ..format.errors import CheckpointCorrupt, InvalidOption
from ..format.manifest import FileChecksum
from ..planning.spans import FileGrid, Piece, Span, plan_spans, split_streams
from . import direct as direct_io
from . import oscalls
from .integrity import check_block, digest_of
from .local import FileStream, OpenFile
from .memory import (
    HUGE_PAGE,
    Destination,
    Target,
    advise_huge_pages,
    page_in,
    prefault_pages,
)
from .staging import ThreadState, accelerator_device, copy_out
from .tensors import byte_view

if TYPE_CHECKING:
    from .location import ByteStream, StoredFile

# One sequential stream per thread; more threads share the first-touch faults of fresh memory.
DEFAULT_THREADS = min(8, max(4, os.cpu_count() or 1))
# Object storage: one ranged GET per span, many in flight to hide latency. Each holds a span of
# response buffer, so a load holds at most REMOTE_THREADS x REMOTE_SPAN_BYTES beyond its parameters.
REMOTE_THREADS = 16
REMOTE_SPAN_BYTES = 16 * 1024 * 1024
# REMOTE_THREADS is a host's budget, shared by its ranks; each keeps a few GETs in flight regardless.
MIN_REMOTE_THREADS = 4


def remote_threads(ranks_on_host: int = 1) -> int:
    """Ranged GETs in flight for one rank: the host's budget split among its ranks.

    >>> remote_threads(1), remote_threads(2), remote_threads(8)
    (16, 8, 4)
    """
    if ranks_on_host < 1:
        raise InvalidOption(f"ranks_on_host={ranks_on_host}: a host runs at least one rank.")
    return max(MIN_REMOTE_THREADS, REMOTE_THREADS // ranks_on_host)


# A verified span is one checksum block instead, so it hashes to one recorded digest.
SPAN_BYTES = 4 * 1024 * 1024
# On a GPU a span is one pinned staging buffer and one host-to-device copy; larger spans copy faster.
ACCELERATOR_SPAN_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class ReadOptions:
    """How the reader runs, the same for every route of a load.

    ``threads`` read at once (more for object storage: :func:`remote_threads`, whose budget the
    ``ranks_on_host`` ranks loading on this host share); ``progress`` is called from the calling
    thread as ``progress(bytes_done_now, bytes_total)``: once with 0 when the reads are planned,
    then after each span; ``huge_pages`` asks for transparent huge pages over CPU targets before
    they are first written; ``span_bytes`` overrides the reader's span size.
    """

    threads: int = DEFAULT_THREADS
    progress: Callable[[int, int], None] | None = None
    huge_pages: bool = False
    ranks_on_host: int = 1
    span_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise InvalidOption(f"threads={self.threads}: the reader needs at least one thread.")


DEFAULT_READ = ReadOptions()


@dataclass(frozen=True)
class ReadStats:
    """What :func:`read_pieces` did."""

    bytes_read: int
    spans: int
    threads: int
    huge_pages: bool
    bytes_mapped: int = 0  # of bytes_read, those paged in from private mappings
    direct: bool = False  # read with O_DIRECT (:mod:`.direct`)


def _widen(p: Piece) -> tuple[int, int]:
    """Bytes to add before and after a piece to cover whole elements of its destination."""
    return p.start % p.itemsize, -(p.start + p.length) % p.itemsize


class _SpanReader:
    """Reads spans into destinations; one per load, made on the caller's thread, shared by the threads."""

    def __init__(
        self,
        files: Sequence[StoredFile],
        destinations: Sequence[Destination],
        checksums: Mapping[int, FileChecksum],
        direct: bool = False,
    ) -> None:
        self.files, self.destinations, self.checksums = files, destinations, checksums
        self.direct = direct
        self.paths = [f.path for f in files]
        self.device = accelerator_device(destinations)  # None: nothing here touches CUDA
        # Taken on the caller's thread, where its work on the targets (zeroing) was issued.
        self.after = torch.cuda.current_stream(self.device) if self.device is not None else None
        self.local = threading.local()
        self.cancelled = threading.Event()  # one stream failed: the others stop at their next span
        self.remaining: dict[int, int] = {}  # bytes still to read of each target with ``filled``
        self.lock = threading.Lock()

    def _state(self) -> ThreadState:
        state = getattr(self.local, "state", None)
        if state is None:
            state = self.local.state = ThreadState(self.device)
            state.on_device(self.after)
        return state

    def synchronize(self) -> None:
        """Wait for the threads' copies on the targets' device (the caller's current one may differ)."""
        if self.device is not None:
            torch.cuda.synchronize(self.device)

    def _stream(self, state: ThreadState, file: int) -> ByteStream:
        # Each thread's own descriptor of the opened file (never of the path): readahead is per open file.
        stream = state.streams.get(file)
        if stream is None:
            stored = self.files[file]
            fd = getattr(stored, "fd", None)
            if self.direct and fd is not None and stored.mappable and not stored.remote:
                stream = direct_io.DirectStream.open(stored.path, fd, stored.size)  # None: no O_DIRECT here
            if stream is None:
                stream = stored.stream()
            state.streams[file] = stream
        return stream

    def read_stream(self, spans: Sequence[Span], done: Callable[[int], None]) -> int:
        """Read spans in order on this thread; ``done`` after each."""
        total = 0
        try:
            for i, span in enumerate(spans):
                if self.cancelled.is_set():
                    break
                n = self.read(span, spans[i + 1] if i + 1 < len(spans) else None)
                total += n
                done(n)
        finally:
            self._state().close()
        return total

    def read(self, span: Span, upcoming: Span | None = None) -> int:
        state = self._state()
        stream, path = self._stream(state, span.file), self.paths[span.file]
        groups: list[tuple[int, list[memoryview]]] = []  # (file offset, consecutive buffers) per preadv
        group_end = -1
        hashed: list[memoryview] = []  # the span's bytes in file order, each once (verified spans)
        edges: list[tuple[int, memoryview]] = []  # partial elements just outside a staged piece
        copies: list[tuple[Destination, int, int, int, int]] = []
        alone: list[Piece] = []
        position = span.begin

        def add(offset: int, view: memoryview) -> None:
            nonlocal group_end
            if offset == group_end:
                groups[-1][1].append(view)
            else:
                groups.append((offset, [view]))
            group_end = offset + len(view)
            if span.verified:
                hashed.append(view)

        staged = [p for p in span.pieces if not self.destinations[p.dest].direct]
        staging = staging_turn = None
        if staged:
            need = sum(p.length + 2 * p.itemsize + 16 for p in staged)
            staging, staging_turn = state.staging_buffer(need)
            staging_view = memoryview(staging.numpy()).cast("B")
        scratch = state.scratch_view(span.end - span.begin) if span.verified else None
        remote, fresh = self.files[span.file].remote, []  # fresh: memory a GET copies into, prefaulted
        cursor = 0
        paged: list[tuple[Destination, Piece]] = []  # mapped bytes to page in
        for p in span.pieces:
            dest = self.destinations[p.dest]
            if dest.mapped is not None:
                paged.append((dest, p))
            if p.offset < position:
                if dest.mapped is None:
                    alone.append(p)  # the same bytes go to two destinations: read the second copy apart
                continue
            if span.verified and p.offset > position:
                add(position, scratch[position - span.begin : p.offset - span.begin])
            if dest.mapped is not None:
                if span.verified:
                    hashed.append(byte_view(dest.mapped_bytes[p.start : p.start + p.length]))
                group_end = -1  # the next read does not continue this one
            elif dest.direct:
                add(p.offset, dest.view[p.start : p.start + p.length])
                if remote:
                    fresh.append((dest.landing.data_ptr() + p.start, p.length))
            else:
                # Convert whole elements only: widen to the elements the span cuts.
                head, tail = _widen(p)
                body = staging_view[cursor + head : cursor + head + p.length]
                add(p.offset, body)
                if head:
                    edges.append((p.offset - head, staging_view[cursor : cursor + head]))
                if tail:
                    edges.append((p.end, staging_view[cursor + head + p.length : cursor + head + p.length + tail]))
                total = head + p.length + tail
                first, stop = (p.start - head) // p.itemsize, (p.start + p.length + tail) // p.itemsize
                copies.append((dest, first, stop, cursor, total))
                cursor += -(-total // 16) * 16  # keep every staged run aligned for any dtype view
            position = p.end
        if span.verified and position < span.end:
            add(position, scratch[position - span.begin : span.end - span.begin])

        if fresh:
            prefault_pages(fresh)
        if isinstance(stream, FileStream) and (groups or paged):
            stream.prefetch(span.begin, span.end)  # the page cache's pages small, the reads queued at once
        if isinstance(stream, direct_io.DirectStream) and (groups or edges):
            # The whole span in one direct request, the next one's in flight while this one is copied out.
            reads = [(o, sum(len(v) for v in views)) for o, views in groups] + [(o, len(v)) for o, v in edges]
            stream.hold(min(o for o, _ in reads), max(o + n for o, n in reads))
            if upcoming is not None and upcoming.file == span.file:
                stream.read_ahead(upcoming.begin - 16, upcoming.end + 16)
        for offset, views in groups:
            stream.readv(views, offset)
        if paged:
            page_in(path, paged)
        for offset, view in edges:
            stream.readv([view], offset)
        if span.verified:
            self._verify(span, hashed)
        if copies:
            copy_out(state, staging, staging_turn, copies)
        for p in alone:
            self._read_alone(p)
        if self.remaining:
            self._count_filled(span)
        return span.nbytes

    def _count_filled(self, span: Span) -> None:
        """Call ``filled`` of each target whose last bytes this span read."""
        ready = []
        with self.lock:
            for p in span.pieces:
                left = self.remaining.get(p.dest)
                if left is not None:
                    self.remaining[p.dest] = left - p.length
                    if left == p.length:
                        ready.append(p.dest)
        for dest in ready:
            filled = self.destinations[dest].filled
            assert filled is not None
            filled()

    def _verify(self, span: Span, hashed: list[memoryview]) -> None:
        path, checksum = self.paths[span.file], self.checksums[span.file]
        check_block(path, checksum, span.index, span.begin, span.end, digest_of(hashed))

    def _read_alone(self, p: Piece) -> None:
        dest = self.destinations[p.dest]
        state = self._state()
        stream = self._stream(state, p.file)
        if dest.direct:
            stream.readv([dest.view[p.start : p.start + p.length]], p.offset)
            return
        head, tail = _widen(p)
        buffer = torch.empty(head + p.length + tail, dtype=torch.uint8)
        stream.readv([byte_view(buffer)], p.offset - head)
        # On the thread's stream, like the staged copies: after the caller's work on the targets.
        with state.issuing():
            dest.flat[(p.start - head) // p.itemsize : (p.start + p.length + tail) // p.itemsize].copy_(
                buffer.view(dest.stored)
            )


def read_pieces(
    paths: Sequence[str | StoredFile],
    pieces: Sequence[Piece],
    targets: Sequence[Target],
    *,
    checksums: Mapping[int, FileChecksum] | None = None,
    verify: str = "all",
    options: ReadOptions = DEFAULT_READ,
) -> ReadStats:
    """Read ``pieces`` of ``paths`` into ``targets``; returns what was read.

    ``paths`` are opened files (:class:`~.local.OpenFile`, or :class:`~.objects.ObjectFile`:
    conditional ranged GETs, never mapped) or local paths opened for this call. Files in
    ``checksums`` are verified: ``verify="all"`` every block, ``"touched"`` only those the pieces
    touch. Any error raises :class:`ShardedStateError` naming the file; the targets may then hold
    partial data and must not be used. A :attr:`Target.mapped` target is not written: its
    mapping's pages are paged in by the threads and verified like read bytes.
    """
    if any(not isinstance(p, str) and p.remote for p in paths):
        options = replace(options, threads=max(options.threads, remote_threads(options.ranks_on_host)))
    opened = [OpenFile.open(p) if isinstance(p, str) else None for p in paths]
    try:
        files = [o or p for o, p in zip(opened, paths, strict=True)]
        return _read_files(files, pieces, targets, checksums or {}, verify, options)
    finally:
        for o in opened:
            if o is not None:
                o.close()


def _read_files(
    files: Sequence[StoredFile],
    pieces: Sequence[Piece],
    targets: Sequence[Target],
    checksums: Mapping[int, FileChecksum],
    verify: str,
    options: ReadOptions,
) -> ReadStats:
    copied = {p.file for p in pieces if not targets[p.dest].mapped and p.length}  # O_DIRECT candidates
    local = [f for i, f in enumerate(files) if i in copied and f.mappable and getattr(f, "fd", None) is not None]
    direct = direct_io.choose_direct([(f.fd, f.size) for f in local])  # type: ignore[attr-defined]
    span_bytes = options.span_bytes
    if span_bytes is None:
        on_gpu = any(t.tensor.device.type == "cuda" for t in targets)
        span_bytes = ACCELERATOR_SPAN_BYTES if on_gpu else SPAN_BYTES
    if direct:
        span_bytes = max(span_bytes, direct_io.WINDOW_BYTES)
    destinations = [Destination(t, t.tensor if t.mapped else None) for t in targets]
    huge = False
    for d in destinations if options.huge_pages else ():
        if d.view is not None and len(d.view) >= HUGE_PAGE:
            huge = advise_huge_pages(d.landing) or huge
    grids = []
    for index, file in enumerate(files):
        path, size = file.path, file.size
        checksum = checksums.get(index)
        if checksum is None:
            grids.append(FileGrid(size, max(span_bytes, REMOTE_SPAN_BYTES) if file.remote else span_bytes, name=path))
            continue
        cells = max(1, -(-size // checksum.block_size))
        if len(checksum.blocks) != cells:
            raise CheckpointCorrupt(
                f"{path}: {cells} checksum blocks of {size} bytes, but {len(checksum.blocks)} recorded; "
                "the file has another length than the one saved. Copy or save it again."
            )
        grids.append(FileGrid(size, checksum.block_size, verify, path))
    spans = plan_spans(pieces, grids)
    span_reader = _SpanReader(files, destinations, checksums, direct)
    for p in pieces:
        if targets[p.dest].filled is not None and p.length > 0:
            span_reader.remaining[p.dest] = span_reader.remaining.get(p.dest, 0) + p.length
    total = _run(span_reader, spans, options.threads, options.progress)
    span_reader.synchronize()
    for d in destinations:
        if d.temp is not None:
            d.target.copy_(d.temp)
    mapped = sum(p.length for p in pieces if targets[p.dest].mapped)
    return ReadStats(total, len(spans), options.threads, huge, mapped, direct)


def _run(reader: _SpanReader, spans: list[Span], threads: int, progress: Callable[[int, int], None] | None) -> int:
    """Read every span, each thread one contiguous run (a sequential stream), not round-robin."""
    planned = sum(span.nbytes for span in spans)
    if progress is not None:
        progress(0, planned)
    finished: queue.SimpleQueue[int] = queue.SimpleQueue()
    runs = split_streams(spans, threads)
    if len(runs) <= 1:
        return reader.read_stream(spans, lambda n: progress(n, planned) if progress is not None else None)
    with ThreadPoolExecutor(len(runs), thread_name_prefix="sharded-read", initializer=oscalls.use_binding_cpus) as pool:
        pending = {pool.submit(reader.read_stream, run, finished.put) for run in runs}
        total = 0
        while pending:
            done, pending = wait(pending, timeout=0.05, return_when=FIRST_EXCEPTION)
            while progress is not None and not finished.empty():
                progress(finished.get(), planned)
            for future in done:
                error = future.exception()
                if error is not None:
                    # The other streams stop at their next span: the pool's exit waits only for those in flight.
                    reader.cancelled.set()
                    raise error
                total += future.result()
        while progress is not None and not finished.empty():
            progress(finished.get(), planned)
    return total
