"""The reader's accelerator path works on the targets' device, checked without a GPU.

CUDA cannot run here, so the ``torch.cuda`` entry points the reader uses are replaced
by small recording fakes that keep, as CUDA does, a current device per thread and a
current stream per thread and device. The bug they guard against: a fresh thread's
current device is 0, so a stream made without a device, and an event recorded on it,
do not follow copies into ``cuda:1`` (those run on device 1's current stream), and a
staging buffer is refilled while its copy may still read it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from vllm_sharded_loader.format.errors import Unsupported
from vllm_sharded_loader.planning.spans import FileGrid, Piece, plan_spans
from vllm_sharded_loader.storage import memory, reader
from vllm_sharded_loader.storage.local import OpenFile
from vllm_sharded_loader.storage.reader import ReadOptions
from vllm_sharded_loader.storage.staging import accelerator_device


def index(device: torch.device | int | None) -> int:
    return device if isinstance(device, int) else torch.device(device).index


class FakeCuda:
    """Recording stand-ins for ``torch.cuda``; every call that reaches them is logged."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.log: list[tuple] = []
        self.defaults: dict[int, object] = {}
        fake = self

        class Stream:
            def __init__(self, device: torch.device | int | None = None, *, default: bool = False) -> None:
                # As in CUDA: without a device, a stream belongs to the thread's current device.
                self.device = index(fake.current_device() if device is None else device)
                self.waited: list[Stream] = []
                if not default:
                    fake.log.append(("stream", self))

            def wait_stream(self, other: Stream) -> None:
                self.waited.append(other)

        class Event:
            def __init__(self) -> None:
                self.stream: Stream | None = None

            def record(self, stream: Stream | None = None) -> None:
                self.stream = stream if stream is not None else fake.stream_of(fake.current_device())
                fake.log.append(("record", self, self.stream))

            def synchronize(self) -> None:
                fake.log.append(("wait", self, self.stream))

        self.Stream, self.Event = Stream, Event

    def current_device(self) -> int:
        return getattr(self.local, "device", 0)

    def stream_of(self, device: int) -> object:
        """The calling thread's current stream on ``device`` (its default one unless set)."""
        streams = getattr(self.local, "streams", {})
        return streams.get(device) or self.defaults.setdefault(device, self.Stream(device, default=True))

    def current_stream(self, device: torch.device | int | None = None) -> object:
        d = self.current_device() if device is None else index(device)
        self.log.append(("current_stream", d))
        return self.stream_of(d)

    def set_device(self, device: torch.device | int) -> None:
        self.log.append(("set_device", index(device)))
        self.local.device = index(device)

    def synchronize(self, device: torch.device | int | None = None) -> None:
        self.log.append(("synchronize", self.current_device() if device is None else index(device)))

    @contextlib.contextmanager
    def device(self, device: torch.device | int) -> Iterator[None]:
        self.log.append(("device", index(device)))
        previous = self.current_device()
        self.local.device = index(device)
        try:
            yield
        finally:
            self.local.device = previous

    @contextlib.contextmanager
    def stream(self, stream) -> Iterator[None]:
        # As torch.cuda.stream: the stream becomes current on its own device, which is
        # made current for the duration; both are restored after.
        streams = self.local.__dict__.setdefault("streams", {})
        previous, previous_device = streams.get(stream.device), self.current_device()
        streams[stream.device], self.local.device = stream, stream.device
        try:
            yield
        finally:
            streams[stream.device], self.local.device = previous, previous_device

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ("set_device", "synchronize", "current_stream", "device", "stream", "Stream", "Event"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        empty = torch.empty

        def pinned_empty(*args, pin_memory: bool = False, **kwargs):
            # No pinned memory without CUDA: note under which device it was asked for, allocate plain.
            if pin_memory:
                self.log.append(("pinned", self.current_device()))
            return empty(*args, **kwargs)

        monkeypatch.setattr(torch, "empty", pinned_empty)


class FakeCudaTarget:
    """A destination on ``cuda:1``: its bytes land in a CPU tensor; each copy logs the stream it really runs on.

    A copy into ``cuda:1`` runs on the current stream of device 1, whatever the thread's current device.
    """

    def __init__(self, fake: FakeCuda, numel: int, dtype: torch.dtype) -> None:
        self.fake, self.data = fake, torch.zeros(numel, dtype=dtype)
        self.stored, self.direct, self.mapped, self.cuda = dtype, False, None, True
        self.landing = SimpleNamespace(device=torch.device("cuda", 1))
        self.flat = self

    def __getitem__(self, index: slice) -> SimpleNamespace:
        def copy_(source: torch.Tensor, non_blocking: bool = False) -> None:
            self.fake.log.append(("copy", self.fake.stream_of(1), non_blocking))
            self.data[index].copy_(source)

        return SimpleNamespace(copy_=copy_)


@pytest.mark.parametrize("on_caller_thread", [False, True])
def test_reader_threads_copy_and_wait_on_the_targets_device(tmp_path, monkeypatch, on_caller_thread):
    fake = FakeCuda()
    fake.install(monkeypatch)
    values = torch.arange(600, dtype=torch.int16)
    path = tmp_path / "raw.bin"
    path.write_bytes(values.numpy().tobytes())
    target = FakeCudaTarget(fake, 600, torch.int16)
    spans = plan_spans([Piece(0, 0, 1200, dest=0, itemsize=2)], [FileGrid(1200, 256)])
    assert len(spans) == 5  # more spans than staging buffers: each buffer is reused
    caller_stream = fake.stream_of(1)  # where the caller zeroed the targets
    with OpenFile.open(str(path)) as file:
        span_reader = reader._SpanReader([file], [target], {})
        if on_caller_thread:
            reader._run(span_reader, spans, 1, None)  # one stream: the reader runs on the caller's thread
        else:
            with ThreadPoolExecutor(1) as pool:  # a fresh thread, as the reader's own pool gives
                pool.submit(span_reader.read_stream, spans, lambda n: None).result()
        span_reader.synchronize()

    assert torch.equal(target.data, values)
    # The caller's thread keeps its device and streams.
    assert fake.current_device() == 0 and fake.stream_of(1) is caller_stream
    log = fake.log
    # One stream, on device 1, after the caller's work there; the pinned buffers made under device 1.
    streams = [entry[1] for entry in log if entry[0] == "stream"]
    assert len(streams) == 1 and streams[0].device == 1
    stream = streams[0]
    assert stream.waited == [caller_stream]
    assert [entry[1] for entry in log if entry[0] == "pinned"] == [1, 1]
    # Every copy ran, non-blocking, on that stream.
    copies = [entry for entry in log if entry[0] == "copy"]
    assert len(copies) == 5 and all(c[1:] == (stream, True) for c in copies)
    # Each span's event is recorded on that stream right after its copy, and a staging
    # buffer is reused only after waiting on the event recorded after its last copy.
    assert all(entry[2] is stream for entry in log if entry[0] in ("record", "wait"))
    kinds = [entry[0] for entry in log if entry[0] in ("copy", "record", "wait")]
    assert kinds == ["copy", "record"] * 2 + ["wait", "copy", "record"] * 3
    recorded = [entry[1] for entry in log if entry[0] == "record"]
    waited = [entry[1] for entry in log if entry[0] == "wait"]
    assert waited == recorded[:3]  # buffers alternate: span i reuses span i-2's
    # The end waits for device 1, and nothing set a thread's device.
    assert log[-1] == ("synchronize", 1)
    assert not [entry for entry in log if entry[0] == "set_device"]


def test_a_cpu_load_makes_no_cuda_call(tmp_path, monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    values = torch.arange(600, dtype=torch.int16)
    path = tmp_path / "raw.bin"
    path.write_bytes(values.numpy().tobytes())
    same, converted = torch.zeros(600, dtype=torch.int16), torch.zeros(600, dtype=torch.float32)
    pieces = [Piece(0, 0, 1200, dest=0, itemsize=2), Piece(0, 0, 1200, dest=1, itemsize=2)]
    targets = [memory.Target(same, torch.int16), memory.Target(converted, torch.int16)]
    reader.read_pieces([str(path)], pieces, targets, options=ReadOptions(threads=2, span_bytes=256))
    assert torch.equal(same, values) and torch.equal(converted, values.float())
    assert fake.log == []


def cuda_destination(index: int) -> SimpleNamespace:
    return SimpleNamespace(cuda=True, landing=SimpleNamespace(device=torch.device("cuda", index)))


def test_the_accelerator_device_is_the_one_the_cuda_targets_are_on():
    cpu = memory.Destination(memory.Target(torch.empty(4), torch.float32))
    converted = memory.Destination(memory.Target(torch.empty(4, dtype=torch.float64), torch.float32))
    assert accelerator_device([]) is None
    assert accelerator_device([cpu, converted]) is None  # CPU loads stay off CUDA entirely
    assert accelerator_device([cpu, cuda_destination(3), cuda_destination(3)]) == torch.device("cuda", 3)
    with pytest.raises(Unsupported, match=r"several accelerator devices \(cuda:0, cuda:1\)"):
        accelerator_device([cuda_destination(1), cpu, cuda_destination(0)])
