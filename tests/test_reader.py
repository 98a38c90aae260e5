"""The parallel reader (:mod:`vllm_sharded_loader.storage.reader`) and its pure span planning, on real files."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import time

import blake3
import pytest
import torch
from safetensors.torch import save_file

from tests.support.pagecache import evict, resident
from vllm_sharded_loader.format import HASH_NAME, FileChecksum, ShardedStateError
from vllm_sharded_loader.format.errors import CheckpointCorrupt, InvalidOption
from vllm_sharded_loader.planning.spans import FileGrid, Piece, plan_spans, split_streams
from vllm_sharded_loader.storage import local, memory, oscalls, reader, tensor_files
from vllm_sharded_loader.storage.reader import ReadOptions

# ------------------------------------------------------------------ planning


def test_the_ranks_of_one_host_split_its_budget_of_requests_to_object_storage():
    assert [reader.remote_threads(n) for n in (1, 2, 3, 4, 8, 64)] == [16, 8, 5, 4, 4, 4]
    assert reader.remote_threads() == reader.REMOTE_THREADS
    with pytest.raises(InvalidOption):
        reader.remote_threads(0)


def test_only_whole_pages_inside_a_range_are_prefaulted():
    page = mmap.PAGESIZE
    assert memory.page_interior(page, 3 * page) == (page, 3 * page)
    assert memory.page_interior(100, 3 * page) == (page, 2 * page)
    assert memory.page_interior(100, page) is None  # no whole page inside
    assert memory.page_interior(0, 0) is None


def test_prefaulting_keeps_the_bytes_already_there_and_those_beside():
    data = torch.arange(3 * mmap.PAGESIZE, dtype=torch.int32)
    expected = data.clone()
    fresh = torch.empty(3 * mmap.PAGESIZE, dtype=torch.int32)  # fresh pages among them
    memory.prefault_pages([(data.data_ptr() + 12, data.numel() * 4 - 24), (fresh.data_ptr(), fresh.numel() * 4)])
    assert torch.equal(data, expected)
    fresh.fill_(5)
    assert torch.equal(fresh, torch.full_like(fresh, 5))


def test_asking_ahead_brings_a_whole_cold_range_into_the_page_cache(tmp_path):
    path = tmp_path / "cold.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        window = oscalls.read_ahead_window(fd)
        assert window >= oscalls.WILLNEED_STEP
        size = 3 * window + 12345  # more than one call reads, and a part window at the end
        os.write(fd, os.urandom(size))
        evict(str(path))
        if resident(path) == size_in_pages(size):
            pytest.skip(f"{tmp_path}: its pages stay cached (tmpfs?): nothing here is cold")
        oscalls.will_need(fd, 0, size)
        deadline = time.monotonic() + 30
        while resident(path) < size_in_pages(size) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert resident(path) == size_in_pages(size)
    finally:
        os.close(fd)


def size_in_pages(size: int) -> int:
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE


def test_spans_cut_pieces_on_the_grid_and_keep_file_order():
    pieces = [Piece(0, 90, 30, dest=1, start=0), Piece(0, 10, 60, dest=0, start=4), Piece(1, 0, 5, dest=2)]
    spans = plan_spans(pieces, [FileGrid(200, 50), FileGrid(5, 50)])
    assert [(s.file, s.index, s.begin, s.end) for s in spans] == [
        (0, 0, 10, 50),
        (0, 1, 50, 100),
        (0, 2, 100, 120),
        (1, 0, 0, 5),
    ]
    # The piece crossing cells 0 and 1 is split with its destination offset carried along.
    assert spans[0].pieces == (Piece(0, 10, 40, 0, 4),)
    assert spans[1].pieces == (Piece(0, 50, 20, 0, 44), Piece(0, 90, 10, 1, 0))
    assert spans[2].pieces == (Piece(0, 100, 20, 1, 10),)
    assert sum(s.nbytes for s in spans) == 95
    assert not any(s.verified for s in spans)


def test_verified_spans_cover_whole_cells():
    pieces = [Piece(0, 60, 10, dest=0)]
    touched = plan_spans(pieces, [FileGrid(130, 50, "touched")])
    assert [(s.index, s.begin, s.end, s.verified) for s in touched] == [(1, 50, 100, True)]
    every = plan_spans(pieces, [FileGrid(130, 50, "all")])
    assert [(s.index, s.begin, s.end) for s in every] == [(0, 0, 50), (1, 50, 100), (2, 100, 130)]
    assert every[0].pieces == () and every[2].pieces == ()
    # An empty file still has its one (empty) block.
    assert [(s.begin, s.end) for s in plan_spans([], [FileGrid(0, 50, "all")])] == [(0, 0)]


def test_a_piece_outside_its_file_is_refused():
    with pytest.raises(
        ShardedStateError, match=r"file 0: a read of bytes 90\.\.110 falls outside the file's 100 bytes"
    ):
        plan_spans([Piece(0, 90, 20, dest=0)], [FileGrid(100, 50)])


# ------------------------------------------------------------------ reading


def odd_layout(tmp_path, name="odd.safetensors"):
    """A file whose f32 and f64 tensors start at offsets that are not multiples of their element size."""
    g = torch.Generator().manual_seed(1)
    tensors = {
        "a_bf16": torch.randn(3, 7, generator=g).to(torch.bfloat16),  # 42 bytes
        "b_f32": torch.randn(33, 5, generator=g),
        "c_i8": torch.arange(-5, 8, dtype=torch.int8),  # 13 bytes
        "d_f64": torch.randn(17, generator=g, dtype=torch.float64),
        "e_bf16": torch.randn(20, 30, generator=g).to(torch.bfloat16),
    }
    path = str(tmp_path / name)
    save_file(tensors, path)
    return path, tensors


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("span_bytes", [16, 100, 4096])
def test_direct_cast_and_strided_targets_match_the_library(tmp_path, threads, span_bytes):
    path, tensors = odd_layout(tmp_path)
    header = local.read_header(path)
    assert any((e.begin - header.data_start) % 4 for e in header.tensors.values())  # really odd offsets
    targets = {
        "a_bf16": torch.empty(3, 7, dtype=torch.bfloat16),  # direct
        "b_f32": torch.empty(33, 5, dtype=torch.float64),  # cast, elements cut by span boundaries
        "c_i8": torch.empty(13, dtype=torch.int8),
        "d_f64": torch.empty(17, dtype=torch.float32),  # cast the other way
        "e_bf16": torch.empty(30, 20, dtype=torch.bfloat16).t(),  # not contiguous
    }
    seen = []
    stats = tensor_files.read_files(
        [header],
        targets,
        options=ReadOptions(threads=threads, progress=lambda n, total: seen.append((n, total)), span_bytes=span_bytes),
    )
    nbytes = sum(e.end - e.begin for e in header.tensors.values())
    assert stats.bytes_read == sum(n for n, _ in seen) == nbytes
    assert seen[0] == (0, nbytes) and {total for _, total in seen} == {nbytes}
    assert torch.equal(targets["a_bf16"], tensors["a_bf16"])
    assert torch.equal(targets["b_f32"], tensors["b_f32"].double())
    assert torch.equal(targets["c_i8"], tensors["c_i8"])
    assert torch.equal(targets["d_f64"], tensors["d_f64"].float())
    assert torch.equal(targets["e_bf16"], tensors["e_bf16"])


def test_only_named_tensors_are_read_and_others_untouched(tmp_path):
    path, tensors = odd_layout(tmp_path)
    target = torch.empty(17, dtype=torch.float64)
    stats = tensor_files.read_files([local.read_header(path)], {"d_f64": target}, options=ReadOptions(span_bytes=64))
    assert stats.bytes_read == 17 * 8
    assert torch.equal(target, tensors["d_f64"])


def test_overlapping_pieces_and_zero_runs(tmp_path):
    path = str(tmp_path / "raw.bin")
    data = torch.arange(64, dtype=torch.int16)
    with open(path, "wb") as f:
        f.write(data.numpy().tobytes())
    first, second = torch.full((32,), -1, dtype=torch.int16), torch.full((8,), -1, dtype=torch.float32)
    pieces = [
        Piece(0, 0, 40, dest=0, start=0, itemsize=2),  # elements 0..19 into first[0:20]
        Piece(0, 20, 16, dest=1, start=0, itemsize=2),  # elements 10..17 again, cast into second
    ]
    targets = [memory.Target(first, torch.int16, zero_runs=[(20, 32)]), memory.Target(second, torch.int16)]
    reader.read_pieces([path], pieces, targets, options=ReadOptions(threads=2, span_bytes=24))
    assert torch.equal(first, torch.cat([data[:20], torch.zeros(12, dtype=torch.int16)]))
    assert torch.equal(second, data[10:18].float())


def checksum_of(path: str, block: int) -> FileChecksum:
    with open(path, "rb") as f:
        data = f.read()
    blocks = tuple(blake3.blake3(data[i : i + block]).hexdigest() for i in range(0, max(len(data), 1), block))
    return FileChecksum(HASH_NAME, block, blocks)


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 1]))


@pytest.mark.parametrize("threads", [1, 4])
def test_checksums_are_verified_per_block_in_parallel(tmp_path, threads):
    path, tensors = odd_layout(tmp_path)
    checksum = checksum_of(path, 128)
    header = local.read_header(path)
    targets = {n: torch.empty_like(t) for n, t in tensors.items()}
    tensor_files.read_files([header], targets, {path: checksum}, options=ReadOptions(threads=threads))
    assert all(torch.equal(targets[n], t) for n, t in tensors.items())
    # A flip in the header, which no tensor reads, is caught too: "all" hashes every block.
    flip(path, 20)
    with pytest.raises(CheckpointCorrupt, match=r"odd.safetensors: checksum mismatch in bytes 0\.\.128 \(block 0\)"):
        tensor_files.read_files([header], targets, {path: checksum}, options=ReadOptions(threads=threads))


def test_touched_verification_reads_only_the_blocks_it_needs(tmp_path):
    path, tensors = odd_layout(tmp_path)
    checksum = checksum_of(path, 128)
    header = local.read_header(path)
    entry = header.tensors["e_bf16"]
    size = os.path.getsize(path)
    flip(path, 5)  # in the header's block, which reading e_bf16 does not touch
    target = torch.empty(20, 30, dtype=torch.bfloat16)
    piece = Piece(0, entry.begin, entry.end - entry.begin, dest=0, itemsize=2)
    args = ([path], [piece], [memory.Target(target, torch.bfloat16)])
    reader.read_pieces(*args, checksums={0: checksum}, verify="touched")
    assert torch.equal(target, tensors["e_bf16"])
    with pytest.raises(CheckpointCorrupt, match=r"checksum mismatch in bytes 0\.\.128"):
        reader.read_pieces(*args, checksums={0: checksum}, verify="all")
    flip(path, size - 1)  # in a block e_bf16 does touch
    with pytest.raises(CheckpointCorrupt, match=rf"checksum mismatch in bytes \d+\.\.{size} "):
        reader.read_pieces(*args, checksums={0: checksum}, verify="touched")


def test_a_file_shorter_than_its_reads_names_the_file(tmp_path):
    path, tensors = odd_layout(tmp_path)
    header = local.read_header(path)
    os.truncate(path, header.file_size - 100)
    targets = {n: torch.empty_like(t) for n, t in tensors.items()}
    with pytest.raises(CheckpointCorrupt, match=r"odd.safetensors: a read of bytes \d+\.\.\d+ falls outside"):
        tensor_files.read_files([header], targets, options=ReadOptions(threads=2, span_bytes=64))
    # A file that shrinks while it is read (after planning) fails the same way, named.
    buffers = [memoryview(bytearray(64)), memoryview(bytearray(64))]
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CheckpointCorrupt, match=r"odd.safetensors: file ended at byte \d+ while reading"):
            local.preadv_all(fd, buffers, os.path.getsize(path) - 100, path)
    finally:
        os.close(fd)


def test_a_checksum_of_another_length_is_refused(tmp_path):
    path, tensors = odd_layout(tmp_path)
    checksum = checksum_of(path, 128)
    short = FileChecksum(HASH_NAME, 128, checksum.blocks[:-1])
    header = local.read_header(path)
    with pytest.raises(CheckpointCorrupt, match=r"odd.safetensors: \d+ checksum blocks of \d+ bytes, but \d+ recorded"):
        tensor_files.read_files([header], {n: torch.empty_like(t) for n, t in tensors.items()}, {path: short})


def thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def anon_huge_bytes(start: int, end: int) -> int:
    """AnonHugePages of the mappings overlapping ``[start, end)``, from /proc/self/smaps.

    ``madvise`` splits a mapping, so a tensor's memory spans several of them.
    """
    inside, total = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split()[0]
            if "-" in first and ":" not in first:
                lo, hi = (int(x, 16) for x in first.split("-"))
                inside = lo < end and start < hi
            elif inside and first == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(thp_mode() == "never", reason="transparent huge pages are disabled on this machine")
def test_fresh_targets_are_backed_by_huge_pages(tmp_path):
    nbytes = 64 * 1024 * 1024
    path = str(tmp_path / "big.safetensors")
    save_file({"w": torch.ones(nbytes // 2, dtype=torch.bfloat16)}, path)
    target = torch.empty(nbytes // 2, dtype=torch.bfloat16)  # fresh, untouched memory
    stats = tensor_files.read_files(
        [local.read_header(path)], {"w": target}, options=ReadOptions(threads=2, huge_pages=True)
    )
    assert stats.huge_pages
    assert torch.equal(target, torch.ones_like(target))
    # At least half the tensor faulted in as 2 MiB pages (the kernel may fall back for some).
    assert anon_huge_bytes(target.data_ptr(), target.data_ptr() + nbytes) >= nbytes // 2


def test_progress_bar_counts_bytes_and_times_the_work(capsys):
    from vllm_sharded_loader.storage.progress import ByteProgress

    with ByteProgress("Loading sharded_state (test)", enabled=True) as shown:
        shown(0, 300)
        shown(100, 300)
        shown(200, 300)
    assert shown.nbytes == 300 and shown.seconds > 0 and shown.rate > 0
    assert "Loading sharded_state (test): 100% Completed | 300B/300B" in capsys.readouterr().err
    with ByteProgress("hidden", enabled=False) as hidden:
        hidden(0, 10)
        hidden(10, 10)
    assert hidden.nbytes == 10 and hidden.bar is None
    assert "hidden" not in capsys.readouterr().err


def test_streams_are_contiguous_balanced_runs_in_file_order():
    spans = plan_spans([Piece(0, 0, 1000, dest=0), Piece(1, 0, 300, dest=1)], [FileGrid(1000, 100), FileGrid(300, 100)])
    runs = split_streams(spans, 3)
    assert [s for run in runs for s in run] == spans  # every span once, in order
    assert [sum(s.end - s.begin for s in run) for run in runs] == [500, 400, 400]
    assert split_streams(spans, 1) == [spans]
    assert len(split_streams(spans[:2], 8)) == 2


def test_without_asking_targets_keep_their_pages(tmp_path):
    if thp_mode() != "madvise":
        pytest.skip("only in madvise mode does the advice decide")
    nbytes = 16 * 1024 * 1024
    path = str(tmp_path / "w.safetensors")
    save_file({"w": torch.ones(nbytes // 2, dtype=torch.bfloat16)}, path)
    # Fresh memory of its own: from malloc, the target could reuse heap memory an earlier
    # test advised (glibc serves 16 MiB from the heap once large frees raised its mmap threshold).
    target = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.bfloat16)
    stats = tensor_files.read_files([local.read_header(path)], {"w": target}, options=ReadOptions(threads=2))
    assert not stats.huge_pages
    assert anon_huge_bytes(target.data_ptr(), target.data_ptr() + nbytes) == 0


# ------------------------------------------------------------------ mapping


def mapped_file_of(tensor: torch.Tensor) -> str | None:
    """The file whose mapping holds ``tensor``'s memory, from /proc/self/maps (None: anonymous memory)."""
    return mapped_file_of_address(tensor.data_ptr())


def mapped_file_of_address(address: int) -> str | None:
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5] if len(fields) > 5 else None
    return None


@pytest.mark.parametrize("threads", [1, 3])
def test_adopted_targets_are_served_from_a_private_mapping_of_the_file(tmp_path, threads):
    path, tensors = odd_layout(tmp_path)
    header = local.read_header(path)
    targets = {
        "a_bf16": torch.empty(3, 7, dtype=torch.bfloat16),  # aligned, stored dtype: mapped
        "b_f32": torch.empty(33, 5, dtype=torch.float32),  # mapped
        "c_i8": torch.empty(13, dtype=torch.int8),  # mapped
        "d_f64": torch.empty(17, dtype=torch.float32),  # cast: read
        "e_bf16": torch.empty(30, 20, dtype=torch.bfloat16).t(),  # not contiguous: read
    }
    adopted: dict[str, torch.Tensor] = {}
    adopt = {name: (lambda t, name=name: adopted.__setitem__(name, t)) for name in targets}
    stats = tensor_files.read_files([header], targets, adopt=adopt, options=ReadOptions(threads=threads, span_bytes=16))
    assert sorted(adopted) == ["a_bf16", "b_f32", "c_i8"]
    assert stats.bytes_mapped == 42 + 33 * 5 * 4 + 13
    assert stats.bytes_read == sum(e.end - e.begin for e in header.tensors.values())
    for name, t in adopted.items():
        assert torch.equal(t, tensors[name]) and t.dtype == tensors[name].dtype
        assert mapped_file_of(t) == path
    assert torch.equal(targets["e_bf16"], tensors["e_bf16"])
    assert torch.equal(targets["d_f64"], tensors["d_f64"].float())
    # Copy-on-write: writing to an adopted tensor never reaches the file.
    adopted["a_bf16"].fill_(7)
    from safetensors.torch import load_file

    assert torch.equal(load_file(path)["a_bf16"], tensors["a_bf16"])


def test_only_cpu_tensors_of_the_stored_dtype_read_in_whole_runs_are_mapped():
    from vllm_sharded_loader.planning.reads import TensorPlan
    from vllm_sharded_loader.planning.runs import Read, Strided
    from vllm_sharded_loader.storage.lowering import placeable

    def plan(*reads: tuple[int, int, int]) -> TensorPlan:
        """One read per (offset, length, count) of 2-byte elements."""
        runs = [Read("f", Strided(o, n, 2 * n, c), Strided(i * 4, n // 2, n, c)) for i, (o, n, c) in enumerate(reads)]
        return TensorPlan("w", "w", (4,), 2, tuple(runs))

    bf16 = torch.empty(4, dtype=torch.bfloat16)
    assert placeable(plan((10, 8, 1)), bf16, torch.bfloat16)  # one whole run
    assert placeable(plan((40, 4, 1), (50, 4, 1)), bf16, torch.bfloat16)  # two pieces joined (dim 0)
    assert not placeable(plan((10, 4, 2)), bf16, torch.bfloat16)  # rows of a dim-1 split
    assert not placeable(plan((10, 8, 1)), bf16, torch.float32)  # cast
    assert not placeable(plan((10, 8, 1)), torch.empty(8, dtype=torch.bfloat16)[::2], torch.bfloat16)  # strided
    assert not placeable(plan((10, 8, 1)), torch.empty(0, dtype=torch.bfloat16), torch.bfloat16)  # empty


def test_a_tensor_at_an_offset_no_view_can_start_at_is_read_not_mapped(tmp_path):
    """A float32 at an odd byte of its file: no tensor view of the mapping can start there."""
    from vllm_sharded_loader.storage.memory import map_pieces

    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(b"\0" * 8192)
    with local.OpenFile.open(path) as opened:
        tensor, ranges = map_pieces([opened], [Piece(0, 21, 16, 0, 0, 4)], torch.float32, (4,))
        assert ranges == [(0, 0)] and mapped_file_of(tensor) != path
        tensor, ranges = map_pieces([opened], [Piece(0, 20, 16, 0, 0, 4)], torch.float32, (4,))
        assert ranges == [(0, 16)] and mapped_file_of(tensor) == path


def test_a_whole_tensor_from_one_run_is_a_private_mapping_and_one_past_the_end_is_not_mapped(tmp_path):
    """The same-topology case: one piece, the whole tensor. Its pages are the file's (writes stay
    private); a piece past the file's end (a file cut since its header was read) is left to the reads,
    which name the file."""
    from vllm_sharded_loader.storage.memory import map_pieces

    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(bytes(range(256)) * 32)
    with local.OpenFile.open(path) as opened:
        tensor, ranges = map_pieces([opened], [Piece(0, 4100, 4000, 0, 0, 1)], torch.uint8, (4000,))
        assert ranges == [(0, 4000)] and mapped_file_of(tensor) == path
        assert bytes(tensor[:3].tolist()) == bytes([4, 5, 6])
        tensor[0] = 255
        tensor, ranges = map_pieces([opened], [Piece(0, 6000, 4000, 0, 0, 1)], torch.uint8, (4000,))
        assert ranges == [(0, 0)] and mapped_file_of(tensor) != path
    with open(path, "rb") as f:
        assert f.read()[4100] == 4  # the write went to a private copy


def test_mapped_bytes_are_verified_and_nothing_is_adopted_on_a_mismatch(tmp_path):
    path, tensors = odd_layout(tmp_path)
    header = local.read_header(path)
    checksum = checksum_of(path, 64)
    adopted: list[torch.Tensor] = []
    targets = {"e_bf16": torch.empty(20, 30, dtype=torch.bfloat16)}
    stats = tensor_files.read_files(
        [header], targets, {path: checksum}, adopt={"e_bf16": adopted.append}, options=ReadOptions(threads=2)
    )
    assert stats.bytes_mapped == 20 * 30 * 2 and torch.equal(adopted.pop(), tensors["e_bf16"])
    flip(path, header.tensors["e_bf16"].begin + 100)  # a byte only the mapping delivers
    with pytest.raises(CheckpointCorrupt, match=r"odd.safetensors: checksum mismatch in bytes \d+\.\.\d+ \(block"):
        tensor_files.read_files(
            [header], targets, {path: checksum}, adopt={"e_bf16": adopted.append}, options=ReadOptions(threads=2)
        )
    assert adopted == []


def test_a_mapped_file_that_shrinks_during_the_load_names_the_file(tmp_path):
    from vllm_sharded_loader.storage.memory import map_pieces

    path = str(tmp_path / "big.safetensors")
    save_file({"w": torch.ones(1 << 20, dtype=torch.bfloat16)}, path)
    entry = local.read_header(path).tensors["w"]
    piece = Piece(0, entry.begin, entry.end - entry.begin, dest=0, itemsize=2)
    tensor, ranges = map_pieces([local.OpenFile.open(path)], [piece], torch.bfloat16, (1 << 20,))
    assert ranges == [(0, piece.length)]
    mapped = memory.Destination(memory.Target(tensor, torch.bfloat16, mapped=True), tensor)
    os.truncate(path, entry.begin + (entry.end - entry.begin) // 2)
    # The kernel reports the pages past the new end (EFAULT) instead of raising SIGBUS later.
    with pytest.raises(CheckpointCorrupt, match=r"big.safetensors: file ended before byte \d+ while reading"):
        memory.page_in(path, [(mapped, piece)])


def referenced_and_resident(address: int) -> tuple[int, int]:
    """``Referenced`` and ``Rss`` bytes of the mapping holding ``address``, from /proc/self/smaps."""
    found, fields = False, {}
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                if found:
                    break
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= address < hi
            elif found and head in ("Referenced:", "Rss:"):
                fields[head[:-1]] = int(line.split()[1]) * 1024
    return fields["Referenced"], fields["Rss"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's madvise(MADV_COLD)")
@pytest.mark.parametrize(
    "setting, flags", [("", "avx2"), ("", "avx2 avx512f avx512_bf16"), ("1", "avx2"), ("0", "avx2 avx512_bf16")]
)
def test_mapped_pages_are_read_by_the_reading_threads_where_vllm_reads_them_next(tmp_path, monkeypatch, setting, flags):
    # MADV_POPULATE_READ maps the pages without a CPU reading them; in a VM whose host took
    # the memory back, the first CPU read of each page then faults in the host. Where vLLM's
    # post-processing reads every weight next (oneDNN repacks float32 anywhere, bfloat16 with
    # AVX-512 BF16 or AMX), the reader reads every page itself; where the weights serve as loaded
    # it leaves them (SHARDED_STATE_TOUCH_PAGES decides where set). Seen through the accessed
    # bits: MADV_COLD clears those of each range right after its real populate, so only a read
    # after it marks a page referenced.
    from vllm_sharded_loader.storage.memory import TOUCH_ENV, touched_by_the_load

    monkeypatch.setenv(TOUCH_ENV, setting)
    monkeypatch.setattr(memory, "CPU_FLAGS", frozenset(flags.split()))  # both CPU classes, on any machine
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    probe = mmap.mmap(-1, mmap.PAGESIZE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(probe))
    if libc.madvise(address, mmap.PAGESIZE, 20) != 0:  # MADV_COLD: Linux 5.4+
        pytest.skip(f"this kernel has no madvise(MADV_COLD): {os.strerror(ctypes.get_errno())}")
    real = oscalls.populate_read

    def populate_then_forget_the_accesses(address: int, nbytes: int) -> int:
        error = real(address, nbytes)
        assert libc.madvise(address, nbytes, 20) == 0, os.strerror(ctypes.get_errno())  # MADV_COLD
        return error

    monkeypatch.setattr(oscalls, "populate_read", populate_then_forget_the_accesses)
    # MADV_COLD skips pages not yet on an LRU list and drains only its own CPU's pending additions:
    # each reading thread stays on one CPU, and the file is read afresh (evicted below), not from
    # pages that save_file left pending on another CPU.
    monkeypatch.setattr(oscalls, "use_binding_cpus", lambda: os.sched_setaffinity(0, {libc.sched_getcpu()}))
    path = str(tmp_path / "w.safetensors")
    tensors = {"a": torch.randn(64, 1024, dtype=torch.float32), "b": torch.randn(96 * 1024 + 3, dtype=torch.bfloat16)}
    save_file(tensors, path)
    evict(path)
    targets = {name: torch.empty_like(t) for name, t in tensors.items()}
    adopted: dict[str, torch.Tensor] = {}
    adopt = {name: (lambda t, name=name: adopted.__setitem__(name, t)) for name in targets}
    stats = tensor_files.read_files([local.read_header(path)], targets, adopt=adopt, options=ReadOptions(threads=2))
    assert sorted(adopted) == ["a", "b"] and stats.bytes_mapped == sum(t.nbytes for t in tensors.values())
    for name, t in adopted.items():
        assert mapped_file_of(t) == path
        referenced, resident = referenced_and_resident(t.data_ptr())
        assert resident >= t.nbytes
        touched = setting == "1" or (setting == "" and (name == "a" or "avx512_bf16" in flags))
        assert touched_by_the_load(t.dtype) == touched, (name, setting)
        if touched:
            assert referenced == resident, f"{name}: {resident - referenced} of {resident} resident bytes never read"
        else:
            assert referenced < resident, f"{name}: every one of {resident} resident bytes read"
        assert torch.equal(t, tensors[name])


def test_a_mapped_tensor_lives_as_long_as_its_views(tmp_path):
    import gc

    from vllm_sharded_loader.storage.memory import map_pieces

    path = str(tmp_path / "w.safetensors")
    save_file({"w": torch.arange(4096, dtype=torch.int32)}, path)
    entry = local.read_header(path).tensors["w"]
    piece = Piece(0, entry.begin, entry.end - entry.begin, dest=0, itemsize=4)
    tensor = map_pieces([local.OpenFile.open(path)], [piece], torch.int32, (4096,))[0]
    view = tensor[100:]
    address = tensor.data_ptr()
    del tensor
    gc.collect()
    assert mapped_file_of(view) == path and torch.equal(view, torch.arange(100, 4096, dtype=torch.int32))
    del view
    gc.collect()
    assert mapped_file_of_address(address) != path  # unmapped with its last view


def test_one_failing_stream_stops_the_others(tmp_path):
    """A checksum mismatch at the start of the first stream ends the whole read: the other stream
    stops at its next span instead of reading (and hashing) its half of the file to the end.
    What it read shows in the target: its bytes are zeros in the file, 7 before the read."""
    size = 256 * 2**20  # two streams of 128 MiB, 1 MiB blocks
    path = str(tmp_path / "big.safetensors")
    save_file({"w": torch.zeros(size, dtype=torch.uint8)}, path)
    checksum = checksum_of(path, 2**20)
    flip(path, 200)  # in the first block: the first stream fails on its first span
    header = local.read_header(path)
    target = torch.full((size,), 7, dtype=torch.uint8)
    with pytest.raises(CheckpointCorrupt):
        tensor_files.read_files([header], {"w": target}, {path: checksum}, options=ReadOptions(threads=2))
    read_by_the_other = int((target[size // 2 :] == 0).sum())
    assert read_by_the_other < size // 4, f"{read_by_the_other / 2**20:.0f} MiB read after the first stream failed"


def test_a_pooled_buffer_is_taken_again_only_once_nothing_uses_its_memory():
    pool = memory.BufferPool(keep=1 << 20)
    first = pool.empty((4, 8), torch.float32)
    address = first.data_ptr()
    held = first[1:]  # a writer still reading a slice of it
    del first
    second = pool.empty((32,), torch.float32)
    assert second.data_ptr() != address and pool.reused == 0
    second.fill_(1.0)
    held.fill_(2.0)
    assert bool((second == 1.0).all())
    del held
    third = pool.empty((8, 4), torch.float32)  # the same size: the first buffer, now idle
    assert third.data_ptr() == address and pool.reused == 1
    assert pool.empty((3,), torch.bfloat16).data_ptr() not in (address, second.data_ptr())


def test_a_pool_lets_idle_buffers_go_beyond_what_it_keeps():
    pool = memory.BufferPool(keep=1024)
    made = [pool.empty((128,), torch.uint8) for _ in range(3)]
    del made
    big = pool.empty((1024,), torch.uint8)  # 384 idle bytes + 1024 > keep: the idle ones go
    assert [b.numel() for b in pool.buffers] == [1024]
    del big
    assert pool.empty((1024,), torch.uint8).numel() == 1024 and pool.reused == 1
