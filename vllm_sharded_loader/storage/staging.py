"""Per-thread buffers of the reader: staging for converted and accelerator targets, scratch, descriptors.
CUDA calls name the load's device: a fresh thread's is GPU 0, and a one-stream reader runs on the caller's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..format.errors import Unsupported
from .memory import Destination

if TYPE_CHECKING:
    from .location import ByteStream


def accelerator_device(destinations: Sequence[Destination]) -> torch.device | None:
    """The one CUDA device that ``destinations`` land on, or None; several are refused. Pure."""
    devices = {d.landing.device for d in destinations if d.cuda}
    if not devices:
        return None
    if len(devices) > 1:
        names = ", ".join(sorted(str(device) for device in devices))
        raise Unsupported(
            f"the targets of one load are on several accelerator devices ({names}); the reader fills "
            "one device per load. Load each device's tensors in a separate call."
        )
    (device,) = devices
    return device


@dataclass
class ThreadState:
    """Per-thread buffers: staging (pinned for accelerators) and scratch for verified spans; with a
    ``device``, :meth:`on_device` must make the thread's stream before the first copy."""

    device: torch.device | None = None
    staging: list[torch.Tensor | None] = field(default_factory=lambda: [None, None])
    events: list[object | None] = field(default_factory=lambda: [None, None])
    turn: int = 0
    scratch: bytearray = field(default_factory=bytearray)
    stream: object | None = None
    streams: dict[int, ByteStream] = field(default_factory=dict)  # this thread's own stream of each file

    def on_device(self, after: object | None = None) -> None:
        """Give the calling thread's state its own stream on :attr:`device` (none without one), which
        first waits for ``after``, the caller's stream: its pending work on the targets must not race."""
        if self.device is None:
            return
        stream = torch.cuda.Stream(device=self.device)
        if after is not None:
            stream.wait_stream(after)  # type: ignore[arg-type]
        self.stream = stream

    @contextlib.contextmanager
    def issuing(self) -> Iterator[None]:
        """Where this thread issues copies: on its device and its stream, or as it is without a stream."""
        if self.stream is None:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):  # type: ignore[arg-type]
            yield

    def close(self) -> None:
        for stream in self.streams.values():
            stream.close()
        self.streams.clear()

    def staging_buffer(self, nbytes: int) -> tuple[torch.Tensor, int]:
        # Two buffers alternate: the accelerator copies out of one while the next span is read into the other.
        self.turn ^= 1
        event = self.events[self.turn]
        if event is not None:
            event.synchronize()  # type: ignore[attr-defined]
            self.events[self.turn] = None
        buffer = self.staging[self.turn]
        if buffer is None or buffer.numel() < nbytes:
            if self.device is None:
                buffer = torch.empty(nbytes, dtype=torch.uint8)
            else:
                # Pinned through the current device's context: device N's, never a fresh thread's GPU 0.
                with torch.cuda.device(self.device):
                    buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self.staging[self.turn] = buffer
        return buffer, self.turn

    def scratch_view(self, nbytes: int) -> memoryview:
        if len(self.scratch) < nbytes:
            self.scratch = bytearray(nbytes)
        return memoryview(self.scratch)


def copy_out(
    state: ThreadState,
    staging: torch.Tensor,
    turn: int,
    copies: list[tuple[Destination, int, int, int, int]],
) -> None:
    """Copy staged runs into their destinations: ``(destination, first, stop, at, nbytes)`` each;
    with a stream, non-blocking, recording the event :meth:`ThreadState.staging_buffer` waits for."""
    if state.stream is not None:
        with state.issuing():
            for dest, a, b, at, n in copies:
                dest.flat[a:b].copy_(staging[at : at + n].view(dest.stored), non_blocking=True)
            event = torch.cuda.Event()
            event.record(state.stream)  # type: ignore[arg-type]
            state.events[turn] = event
    else:
        for dest, a, b, at, n in copies:
            dest.flat[a:b].copy_(staging[at : at + n].view(dest.stored))
