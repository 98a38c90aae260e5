"""A model's members as threads of the test: :class:`ThreadExchange` is the exchange
(:class:`vllm_sharded_loader.checkpoint.group.Exchange`) an engine's workers have over gloo, in
process, and :func:`in_threads` runs a function as every member at once."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from vllm_sharded_loader.format.errors import WorkerLost


class ThreadExchange:
    """Member ``index`` of the threads sharing ``shared``: every member's outcome through shared slots."""

    def __init__(self, index: int, size: int, shared: dict[str, Any]) -> None:
        self.index, self.size, self.shared = index, size, shared

    @property
    def alone(self) -> bool:
        return self.size == 1

    def gather(self, outcome: Any, what: str) -> list[Any]:
        slots = self.shared.setdefault("slots", [None] * self.size)
        try:
            slots[self.index] = outcome
            self.shared["gather"].wait()  # every member's outcome is in
            outcomes = list(slots)
            self.shared["gather"].wait()  # every member has read them before the next exchange writes
        except threading.BrokenBarrierError as e:  # a member left (died): gloo's connection reset
            raise WorkerLost(f"another worker of {what} stopped answering") from e
        return outcomes

    def barrier(self, seconds: float, wait_all: bool = False) -> None:
        try:
            self.shared["barrier"].wait(seconds)
        except threading.BrokenBarrierError as e:
            raise RuntimeError(f"a member did not arrive within {seconds} s") from e

    def leave(self) -> None:
        """This member dies: the others' exchanges fail at once."""
        self.shared["gather"].abort()


def in_threads(size: int, member: Callable[[int, ThreadExchange], Any], timeout: float = 60) -> list[Any]:
    """Run ``member(index, exchange)`` as every member at once; each one's result, or the error it raised."""
    shared: dict[str, Any] = {"gather": threading.Barrier(size), "barrier": threading.Barrier(size)}
    results: list[Any] = [None] * size

    def run(index: int) -> None:
        try:
            results[index] = member(index, ThreadExchange(index, size, shared))
        except BaseException as e:
            results[index] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a member hangs"
    return results
