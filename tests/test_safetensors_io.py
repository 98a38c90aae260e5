"""Our safetensors writer and reader against the safetensors library, on real files."""

import os
import struct

import blake3
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.support.engines import package_process
from vllm_sharded_loader.format import ShardedStateError
from vllm_sharded_loader.format.entries import DIGEST_DIGITS, DIGEST_METADATA
from vllm_sharded_loader.format.errors import CheckpointCorrupt, CheckpointNotFound
from vllm_sharded_loader.storage import integrity, local, tensor_files, writer


def sample_tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "f32": torch.randn(3, generator=g),
        "f16": torch.randn(2, 2, 2, generator=g).half(),
        "i64": torch.arange(6).reshape(2, 3),
        "u8": torch.arange(9, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "fp8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
        "strided": torch.randn(4, 6, generator=g).t(),  # not contiguous
    }


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def header(text: bytes, data: bytes = b"\0" * 4) -> bytes:
    return struct.pack("<Q", len(text)) + text + data


def test_library_reads_what_we_write(tmp_path):
    tensors = sample_tensors()
    path = str(tmp_path / "ours.safetensors")
    written = writer.write_file(path, list(tensors.items()), {"format": "pt"})
    size, checksum = written.size, written.checksum
    assert size == os.path.getsize(path)
    header = local.read_header(path)
    assert written.offsets == {name: h.begin for name, h in header.tensors.items()}
    # The checksum hashed while writing is the checksum of the file's bytes.
    with open(path, "rb") as f:
        assert checksum.blocks == (blake3.blake3(f.read()).hexdigest(),)
    with safe_open(path, framework="pt") as f:
        assert set(f.keys()) == set(tensors)
        assert f.metadata() == {"format": "pt", DIGEST_METADATA: written.digest}
        for name, t in tensors.items():
            assert torch.equal(as_bytes(f.get_tensor(name)), as_bytes(t)), name


@pytest.mark.parametrize("direct", [False, True])
def test_the_header_holds_the_digest_of_the_file_as_written_with_it_zeroed(tmp_path, direct):
    """The digest that tells a stale part from the one saved: of the file's block checksums with its own
    slot all zeros (so it depends on the bytes alone), put in once the data is written, each recorded
    block checksum of the file as it then is. Two blocks, so the patched first block is hashed again."""
    if direct and not direct_io_supported(tmp_path):
        pytest.skip(f"{tmp_path}: the file system takes no O_DIRECT writes")
    block = integrity.BLOCK_SIZE
    path = str(tmp_path / "ours.safetensors")
    tensors = [("big", torch.arange(block // 4 + 99, dtype=torch.int32)), ("small", torch.ones(3))]
    written = writer.write_file(path, tensors, {"format": "pt"}, direct=direct)
    with open(path, "rb") as f:
        data = f.read()
    assert written.checksum.blocks == tuple(blake3.blake3(data[i : i + block]).hexdigest() for i in (0, block))
    place = f'"{DIGEST_METADATA}":"{written.digest}"'.encode()
    slot = data.index(place) + len(place) - DIGEST_DIGITS - 1
    zeroed = data[:slot] + b"0" * DIGEST_DIGITS + data[slot + DIGEST_DIGITS :]
    blocks = "".join(blake3.blake3(zeroed[i : i + block]).hexdigest() for i in (0, block))
    assert written.digest == blake3.blake3(blocks.encode()).hexdigest()[:DIGEST_DIGITS]
    assert writer.write_file(str(tmp_path / "again"), tensors, {"format": "pt"}, direct=direct) == written


def direct_io_supported(directory) -> bool:
    probe = str(directory / "probe")
    sink = writer._DirectSink.open(probe, 1)
    if sink is None:
        return False
    with sink:
        pass
    os.remove(probe)
    return True


@pytest.mark.parametrize("passed", [False, True])
@pytest.mark.parametrize("chunk", [4096, 12288, 1 << 20])
def test_direct_and_buffered_writes_give_the_same_file_and_checksums(tmp_path, monkeypatch, chunk, passed):
    if not direct_io_supported(tmp_path):
        pytest.skip("this file system does not take O_DIRECT writes")
    # Small staging buffers: the two buffers take many turns, tensors cross their edges. Either the
    # module's default, or given by the caller (a save writing several ranks at once: buffer_bytes_for).
    if passed:
        monkeypatch.setattr(writer, "CHUNK_BYTES", 1 << 30)  # would be one turn, were it used
    else:
        monkeypatch.setattr(writer, "CHUNK_BYTES", chunk)
    turns: list[int] = []
    sink_open = writer._DirectSink.open

    def counted_open(path, size, buffer_bytes=None):
        sink = sink_open(path, size, buffer_bytes)
        turns.append(len(sink.buffers[0]))
        return sink

    monkeypatch.setattr(writer._DirectSink, "open", counted_open)
    monkeypatch.setattr(integrity, "BLOCK_SIZE", 5000)  # checksum blocks that straddle the buffers too
    g = torch.Generator().manual_seed(3)
    tensors = [(f"t{i}", torch.randn(n, generator=g)) for i, n in enumerate([1, 3001, 1024, 7, 20000, 5])]
    tensors.append(("strided", torch.randn(50, 30, generator=g).t()))
    # A dim-1 slice (rows copied block by block into the staging buffers, never joined first), one
    # of odd row bytes, and a tensor given as parts (a rank's pieces of a fused weight).
    wide = torch.randn(40, 300, generator=g)
    fused = torch.randn(9, 70, generator=g)
    tensors += [
        ("rows", wide[:, 100:250]),
        ("odd_rows", wide.to(torch.bfloat16)[:, 1:298]),
        ("parts", writer.LazyTensor((5, 70), torch.float32, lambda: (fused[1:3], fused[6:9]))),
    ]
    direct, buffered = str(tmp_path / "direct.safetensors"), str(tmp_path / "buffered.safetensors")
    counted: list[int] = []
    a = writer.write_file(
        direct, tensors, {"format": "pt"}, counted.append, direct=True, buffer_bytes=chunk if passed else None
    )
    b = writer.write_file(buffered, tensors, {"format": "pt"}, direct=False)
    with open(direct, "rb") as f, open(buffered, "rb") as g2:
        data = f.read()
        assert data == g2.read()
    assert a.checksum.block_size == 5000 and len(a.checksum.blocks) > 3
    assert a == b and a.size == len(data) == os.path.getsize(direct)  # the padding is cut off
    assert turns == [min(chunk, -(-a.size // 4096) * 4096)]  # the staging buffers' size
    assert sum(counted) == a.size - local.read_header(direct).data_start
    block = a.checksum.block_size
    assert a.checksum.blocks == tuple(
        blake3.blake3(data[i : i + block]).hexdigest() for i in range(0, len(data), block)
    )
    loaded = load_file(direct)
    assert torch.equal(loaded["rows"], wide[:, 100:250]) and torch.equal(loaded["odd_rows"], tensors[-2][1])
    assert torch.equal(loaded["parts"], torch.cat([fused[1:3], fused[6:9]]))


def test_a_direct_write_cut_by_a_file_size_limit_says_so_not_a_bare_invalid_argument(tmp_path):
    """A file size limit off a block boundary (``RLIMIT_FSIZE``, as ``ulimit -f`` sets it) cuts an
    ``O_DIRECT`` write to an unaligned length, which the kernel refuses with ``EINVAL``: the save
    said "Invalid argument". The writer finishes through the page cache, where the kernel says
    what stopped it (``EFBIG``), as a buffered write would."""
    if not direct_io_supported(tmp_path):
        pytest.skip(f"{tmp_path}: the file system has no O_DIRECT")
    code = """
import errno, resource, signal, sys, torch
from vllm_sharded_loader.storage.writer import write_file
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (the default action ends the process)
resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, resource.RLIM_INFINITY))
try:
    write_file(sys.argv[1], [("w", torch.ones(1 << 18))], {}, direct=True)
    result = "written"
except OSError as e:
    result = errno.errorcode.get(e.errno, str(e.errno))
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))  # (stdout)
print(result)
"""
    run = package_process(["-c", code, str(tmp_path / "part.safetensors")])
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["EFBIG"], run.stdout + run.stderr[-2000:]


@pytest.mark.parametrize("direct", [True, False])
def test_parallel_writers_hold_no_more_memory_than_their_staging_budget(tmp_path, direct):
    """Eight writers at once (a TP=8 convert) share PARALLEL_BUFFER_BYTES of staging buffers. Putting the
    digest in re-hashes each file's first checksum block (16 MiB); the writers kept that block's bytes
    from the stream, 16 MiB each beyond the budget: measured here as the process's peak resident memory
    while they write (VmHWM, reset once the tensor exists and a first write has run), 273 MiB of growth
    with O_DIRECT (128 MiB budget), 129 MiB through the page cache (no staging buffers)."""
    if direct and not direct_io_supported(tmp_path):
        pytest.skip(f"{tmp_path}: the file system takes no O_DIRECT writes")
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("no /proc/self/clear_refs to reset the peak resident memory")
    code = """
import os, sys, threading, torch
from vllm_sharded_loader.storage import writer
folder, direct, n = sys.argv[1], sys.argv[2] == "1", 8
weights = torch.randn(20 * 2**20 // 4)  # 20 MiB: a whole first checksum block, and more
budget = writer.buffer_bytes_for(n)

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

def write(name):
    writer.write_file(os.path.join(folder, name), [("w", weights)], {}, direct=direct, buffer_bytes=budget)

write("first")  # the thread pools, blake3 and the page tables of the writes exist from here on
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident memory starts again from now
base = status("VmRSS:")
threads = [threading.Thread(target=write, args=(f"p{i}",)) for i in range(n)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert len(os.listdir(folder)) == n + 1
print(status("VmHWM:") - base, 2 * budget * n if direct else 0)
"""
    run = package_process(["-c", code, str(tmp_path), "1" if direct else "0"])
    assert run.returncode == 0, run.stderr[-2000:]
    grown, staging = map(int, run.stdout.split())
    assert staging <= writer.PARALLEL_BUFFER_BYTES
    # Beyond the staging buffers: thread stacks, small objects (measured: under 1 MiB with O_DIRECT, 9 MiB without).
    assert grown <= staging + 16 * 2**20, f"{grown / 2**20:.1f} MiB grown, staging {staging / 2**20:.0f} MiB"


@pytest.mark.parametrize("direct", [None, False])
def test_parts_that_do_not_make_the_declared_tensor_fail_the_write(tmp_path, direct):
    short = writer.LazyTensor((5, 70), torch.float32, lambda: (torch.zeros(2, 70), torch.zeros(2, 70)))
    with pytest.raises(ShardedStateError, match="short was made with 1120 bytes, but the file's header gives it 1400"):
        writer.write_file(str(tmp_path / "x.safetensors"), [("short", short)], {}, direct=direct)


def test_we_read_what_the_library_writes_straight_into_targets(tmp_path):
    tensors = {k: v.contiguous() for k, v in sample_tensors().items()}
    path = str(tmp_path / "theirs.safetensors")
    save_file(tensors, path)
    header = local.read_header(path)
    targets = {name: torch.empty_like(t) for name, t in tensors.items()}
    pointers = {name: t.data_ptr() for name, t in targets.items()}
    nbytes = tensor_files.read_files([header], targets).bytes_read
    assert nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    for name, t in tensors.items():
        assert targets[name].data_ptr() == pointers[name]  # read in place, not replaced
        assert torch.equal(as_bytes(targets[name]), as_bytes(t)), name


def test_read_casts_into_targets_of_another_dtype(tmp_path):
    t = torch.randn(16, 4)
    path = str(tmp_path / "f32.safetensors")
    writer.write_file(path, [("w", t)], {})
    target = torch.empty(16, 4, dtype=torch.bfloat16)
    tensor_files.read_files([local.read_header(path)], {"w": target})
    assert torch.equal(target, t.to(torch.bfloat16))


def write_sample(tmp_path) -> str:
    path = str(tmp_path / "x.safetensors")
    writer.write_file(path, [("a", torch.ones(64)), ("b", torch.zeros(8))], {})
    return path


def test_truncated_file_is_refused(tmp_path):
    path = write_sample(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    with pytest.raises(CheckpointCorrupt):
        local.read_header(path)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "too short"),
        (b"\x01\x02", "too short"),
        (struct.pack("<Q", 1 << 40) + b"{}", "header claims"),
        (struct.pack("<Q", 4) + b"nope", "not valid JSON"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
        (header(b'{"a": {"dtype": "F32"}}'), "malformed"),
        (header(b'{"a":{"dtype":"Q9","shape":[1],"data_offsets":[0,4]}}'), "unknown tensor dtype"),
        (header(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}'), "needs 8 bytes"),
        (header(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,8]}}'), "truncated"),
    ],
)
def test_corrupt_headers_are_refused(tmp_path, data, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    with pytest.raises(CheckpointCorrupt, match=message):
        local.read_header(str(path))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(CheckpointNotFound):
        local.read_header(str(tmp_path / "nope.safetensors"))
