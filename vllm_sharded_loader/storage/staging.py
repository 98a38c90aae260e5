"""Per-thread buffers of the reader: staging for converted and accelerator targets, scratch, descriptors."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .memory import Destination


@dataclass
class ThreadState:
    """Per-thread buffers: staging (pinned for accelerators) and scratch for verified spans."""

    pin: bool
    staging: list[torch.Tensor | None] = field(default_factory=lambda: [None, None])
    events: list[object | None] = field(default_factory=lambda: [None, None])
    turn: int = 0
    scratch: bytearray = field(default_factory=bytearray)
    stream: object | None = None
    fds: dict[int, int] = field(default_factory=dict)  # this thread's own descriptors

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def staging_buffer(self, nbytes: int) -> tuple[torch.Tensor, int]:
        # Two buffers alternate: the accelerator copies out of one while the next span is read into the other.
        self.turn ^= 1
        event = self.events[self.turn]
        if event is not None:
            event.synchronize()  # type: ignore[attr-defined]
            self.events[self.turn] = None
        buffer = self.staging[self.turn]
        if buffer is None or buffer.numel() < nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
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
    if state.stream is not None:
        with torch.cuda.stream(state.stream):  # type: ignore[arg-type]
            for dest, a, b, at, n in copies:
                dest.flat[a:b].copy_(staging[at : at + n].view(dest.stored), non_blocking=True)
            event = torch.cuda.Event()
            event.record(state.stream)  # type: ignore[arg-type]
            state.events[turn] = event
    else:
        for dest, a, b, at, n in copies:
            dest.flat[a:b].copy_(staging[at : at + n].view(dest.stored))
