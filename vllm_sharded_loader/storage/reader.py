"""Reading planned byte ranges of files into tensors at the storage's bandwidth.

The loader's whole job is this module's :func:`read_pieces`: move each rank's bytes
from its files into its parameters. It needs torch but not vLLM, so it can be
benchmarked alone (``benchmarks/``) and on machines without vLLM. How it gets near
the hardware's limits, measured on the project's 2-core machines:

- **Several sequential streams.** :func:`~..planning.spans.plan_spans` cuts the reads on a
  fixed 4 MiB grid of each file (the 16 MiB checksum blocks when verifying), and
  :func:`~..planning.spans.split_streams` gives each of ``threads`` threads one contiguous run of spans.
  Each thread opens the files itself, so the kernel keeps one readahead state per
  stream (``POSIX_FADV_SEQUENTIAL`` doubles its window) and the storage sees several
  sequential streams at once, while the page faults and copies of different streams
  overlap. ``os.preadv`` releases the GIL for the whole span. vLLM pins a CPU worker's
  threads to its cores; the reader's threads are let onto every core of the worker's
  NUMA nodes while they run (:func:`.oscalls.use_binding_cpus`), never onto another node's.
- **One system call per span, not per tensor.** Consecutive tensors of a span are one
  ``preadv`` with one buffer per tensor, so a span of many small tensors costs what a
  span of one large tensor costs; Python does per-span work, not per-byte work.
- **No second copy.** A CPU target of the stored dtype receives its bytes directly:
  the memory bound of a load is its parameters, plus per thread one span of staging
  only for targets that convert (another dtype or device) and one span of scratch only
  for verified spans.
- **First touch.** New parameters are untouched memory; every 4 KiB page faults (and is
  zeroed) on first write, which caps a copy into fresh memory at 1-2 GB/s on one
  thread here. The faults of different threads run in parallel, so the threads share
  that cost. ``huge_pages=True`` also asks for transparent huge pages on each target
  (``MADV_HUGEPAGE``, THP in ``madvise`` mode): 512 times fewer faults. On bare metal
  that is a large win (measured here, with memory the VM already backed: 12-15 GB/s
  against 3.5 with 4 threads), but in a VM whose host reclaims free guest memory
  (free page reporting, as on these machines) a huge page is exactly the memory the
  host took back, and loads ran 30% slower with it. So it is opt-in.
- **Mapping instead of copying** (:mod:`.memory`, :mod:`.lowering`). A CPU target whose caller can take
  another tensor (``adopt``; the vLLM loader swaps the parameter's data) is served
  from a private mapping of its bytes in the file: the page cache's pages become its
  memory, with no copy and no first touch. A warm 1.5 GB rank maps at tens of GB/s where the
  copy runs at 1-3 GB/s here; cold, the threads page the mappings in at the disk's speed.
- **Accelerators** (:mod:`.staging`). A target on another device is filled from pinned staging buffers,
  two per thread, with non-blocking copies on the thread's own stream, so the copy of
  one span overlaps the read of the next. Streams, events and copies are all on the
  targets' device (one per load), whichever thread issues them.
- **Cold files can bypass the page cache** (:mod:`.direct`), with ``SHARDED_STATE_DIRECT_IO=on``:
  16 MiB ``O_DIRECT`` windows into page-aligned buffers. ``auto`` keeps the page cache (measured
  no slower cold, on CPU and on an H200 host).
- **Checksums.** A verified span is one checksum block, hashed by its thread (BLAKE3 releases the GIL).
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
from .local import OpenFile
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

# One sequential stream per thread. On the 2-core VMs here a warm load's cost is the first touch
# of fresh parameter memory, faulted in parallel by more threads: a 1.5 GB rank ran at 1.0-1.4 GB/s
# with 2 threads, 1.7-2.4 with 4, 1.2-2.1 with 8. Cold, 2-4 streams beat one by 1.5-2x.
DEFAULT_THREADS = min(8, max(4, os.cpu_count() or 1))
# Objects in object storage: each span is one ranged GET, a request with its own latency;
# more and larger ones in flight hide it. Each holds one span of response buffer until it
# is copied out, so a load holds at most REMOTE_THREADS x REMOTE_SPAN_BYTES (256 MiB) beyond
# the parameters. Measured against SeaweedFS on loopback (benchmarks/s3_bench.py), 16 MiB
# ranges read 1.3-1.4x faster than 4 MiB ones.
REMOTE_THREADS = 16
REMOTE_SPAN_BYTES = 16 * 1024 * 1024
# REMOTE_THREADS is the budget of a host, not of a rank: the tensor-parallel ranks of one
# host load at the same time, each in its own process, and share its cores and its network.
# On the 2-core machines here, two rank processes with 8 ranged GETs each read SeaweedFS at
# 1.05 GB/s, with 16 each at 0.83-1.02 GB/s, holding twice the response buffers (the machine
# is CPU-bound: ~1 CPU s per GB in the client, ~1.1 in the server). Each rank keeps a few
# requests in flight however many share the host, to hide a request's latency.
MIN_REMOTE_THREADS = 4


def remote_threads(ranks_on_host: int = 1) -> int:
    """Threads (ranged GETs in flight) of one rank reading object storage: the host's budget split among its ranks.

    >>> remote_threads(1), remote_threads(2), remote_threads(8)
    (16, 8, 4)
    """
    if ranks_on_host < 1:
        raise InvalidOption(f"ranks_on_host={ranks_on_host}: a host runs at least one rank.")
    return max(MIN_REMOTE_THREADS, REMOTE_THREADS // ranks_on_host)


# A verified span is one checksum block instead (16 MiB), so it hashes to one recorded digest.
SPAN_BYTES = 4 * 1024 * 1024
# Targets on a GPU: a span is one pinned staging buffer and one host-to-device copy. On an H200
# (benchmarks/gpu_bench.py, 8 GB rank) 16 MiB spans read warm files at 16-28 GB/s, 4 MiB at 10-12.
ACCELERATOR_SPAN_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class ReadOptions:
    """How the reader runs, the same for every route of a load (whole files, resharded, without manifest).

    ``threads`` read at once (more for objects in object storage: :func:`remote_threads`,
    whose budget the ``ranks_on_host`` ranks loading on this host at once share);
    ``progress`` is called from the calling thread as ``progress(bytes_done_now, bytes_total)``:
    once with 0 when the reads are planned, then after each span; ``huge_pages`` asks for
    transparent huge pages over CPU targets before they are first written; ``span_bytes`` sets the
    spans the threads take, where the reader's own choice is not wanted (benchmarks sweep it).
    """

    threads: int = DEFAULT_THREADS
    progress: Callable[[int, int], None] | None = None
    huge_pages: bool = False
    ranks_on_host: int = 1
    span_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise InvalidOption(f"threads={self.threads}: the reader needs at least one thread.")


#: The reader's defaults: one thread per core (4 to 8), no progress, no huge pages, one rank on the host.
DEFAULT_READ = ReadOptions()


@dataclass(frozen=True)
class ReadStats:
    """What :func:`read_pieces` did."""

    bytes_read: int
    spans: int
    threads: int
    huge_pages: bool
    # Of bytes_read, those paged in from private file mappings instead of read.
    bytes_mapped: int = 0
    # Whether the files were read with O_DIRECT (:mod:`.direct`), bypassing the page cache.
    direct: bool = False


def _widen(p: Piece) -> tuple[int, int]:
    """Bytes to add before and after a piece so that it covers whole elements of its destination."""
    return p.start % p.itemsize, -(p.start + p.length) % p.itemsize


class _SpanReader:
    """Reads spans into destinations; one instance per load, made on the caller's thread, shared by the threads."""

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
        # The CUDA targets' one device, or None: then nothing here touches CUDA.
        self.device = accelerator_device(destinations)
        # Taken on the caller's thread, where its work on the targets (zeroing) was issued.
        self.after = torch.cuda.current_stream(self.device) if self.device is not None else None
        self.local = threading.local()
        # Set when one stream fails: the others stop at their next span instead of reading to the end.
        self.cancelled = threading.Event()
        # Bytes still to read of each target with a ``filled`` callback.
        self.remaining: dict[int, int] = {}
        self.lock = threading.Lock()

    def _state(self) -> ThreadState:
        state = getattr(self.local, "state", None)
        if state is None:
            state = self.local.state = ThreadState(self.device)
            state.on_device(self.after)
        return state

    def synchronize(self) -> None:
        """Wait for every copy the threads issued to the accelerator; a no-op without one.

        On the targets' device, named: the caller's current device may be another.
        """
        if self.device is not None:
            torch.cuda.synchronize(self.device)

    def _stream(self, state: ThreadState, file: int) -> ByteStream:
        # Each thread has its own stream of the opened file: for a local file its own
        # descriptor (never of the path), since the kernel keeps readahead state per open
        # file, so every thread's stream is recognised as sequential.
        stream = state.streams.get(file)
        if stream is None:
            stored = self.files[file]
            fd = getattr(stored, "fd", None)
            if self.direct and fd is not None and stored.mappable and not stored.remote:
                # None where the file system refuses O_DIRECT (tmpfs): that file goes through the page cache.
                stream = direct_io.DirectStream.open(stored.path, fd, stored.size)
            if stream is None:
                stream = stored.stream()
            state.streams[file] = stream
        return stream

    def read_stream(self, spans: Sequence[Span], done: Callable[[int], None]) -> int:
        """Read spans in order on this thread, with its own descriptors; ``done`` after each."""
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
        # Memory that a GET's bytes are copied into, faulted in first (see prefault_pages).
        remote, fresh = self.files[span.file].remote, []
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
        if isinstance(stream, direct_io.DirectStream) and (groups or edges):
            # The whole span (and the partial elements at its ends) in one direct request.
            reads = [(o, sum(len(v) for v in views)) for o, views in groups] + [(o, len(v)) for o, v in edges]
            stream.prefetch(min(o for o, _ in reads), max(o + n for o, n in reads))
            if upcoming is not None and upcoming.file == span.file:
                # The next span's request is in flight while this one's bytes are copied out.
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
        """Call the ``filled`` callback of each target whose last bytes this span read, on this thread."""
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

    ``paths`` are files opened by the caller (:class:`~.local.OpenFile`: every read and
    mapping goes through that descriptor; or an object in object storage,
    :class:`~.objects.ObjectFile`: every read a conditional ranged GET) or local paths,
    opened here for this call; ``options`` say how (:class:`ReadOptions`). Objects are read
    by at least :func:`remote_threads` threads, and never mapped.

    ``checksums`` maps file indices to their recorded block checksums; those files are
    verified, ``verify="all"`` every block of the file, ``"touched"`` only the blocks
    the pieces touch (a resharding load). A mismatch, a truncated file or any other
    error raises :class:`ShardedStateError` naming the file before this returns; the
    targets may then hold partial data, and the caller must not use them.

    A target with :attr:`Target.mapped` lies over a private mapping of its piece's bytes
    (:func:`.memory.map_pieces`, made by :func:`.lowering.read_plans`): it is not written,
    its pages are brought in by the reading threads (``MADV_POPULATE_READ``), each read once
    by them (:func:`.memory.touch_pages`), and verified like read bytes. The page cache's
    pages then serve as the target's memory, so the load neither copies the bytes nor
    first-touches fresh memory, which on the project's VMs is what limits a copying load
    (see the module docstring).
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
    # Local files with bytes to copy (not only mapped ones): with SHARDED_STATE_DIRECT_IO=on, read with O_DIRECT.
    copied = {p.file for p in pieces if not targets[p.dest].mapped and p.length}
    local = [f for i, f in enumerate(files) if i in copied and f.mappable and getattr(f, "fd", None) is not None]
    direct = direct_io.choose_direct([(f.fd, f.size) for f in local])  # type: ignore[attr-defined]
    span_bytes = options.span_bytes
    if span_bytes is None:  # (else the caller's own)
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
    """Read every span: each thread streams one contiguous run of the rank's bytes.

    Contiguous runs, not spans handed out round-robin: every thread is one sequential
    stream with its own readahead, and the storage sees ``threads`` of them at once.
    """
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
                    # One failure ends the read: the other streams stop at their next span
                    # (the pool's exit waits only for the spans in flight).
                    reader.cancelled.set()
                    raise error
                total += future.result()
        while progress is not None and not finished.empty():
            progress(finished.get(), planned)
    return total
