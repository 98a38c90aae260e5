"""Progress bars for loading and saving: bytes, one bar per call, shown only where asked."""

from __future__ import annotations

import threading
import time
from types import TracebackType

# vLLM's loaders' format: a line per update survives the prefixes on worker output.
BAR_FORMAT = "{desc}: {percentage:3.0f}% Completed | {n_fmt}B/{total_fmt}B [{elapsed}<{remaining}, {rate_fmt}]\n"


class ByteProgress:
    """A thread-safe callback ``(bytes_done_now, bytes_total)`` that times the work and, if ``enabled``,
    drives a tqdm bar from its first call (vLLM's one-line format with ``line_per_update``)."""

    def __init__(self, desc: str, enabled: bool, line_per_update: bool = True) -> None:
        self.desc, self.enabled, self.line_per_update = desc, enabled, line_per_update
        self.bar = None
        self.nbytes = 0
        self.total: int | None = None
        self.started = time.perf_counter()
        self.seconds = 0.0
        self._lock = threading.Lock()

    def __call__(self, done: int, total: int) -> None:
        with self._lock:
            if self.total is None:
                self._open(total)
            self._advance(done)

    def advance(self, done: int) -> None:
        """Count ``done`` bytes more, for a caller that gave the total in its first call."""
        with self._lock:
            self._advance(done)

    def start_over(self) -> None:
        """Count from nothing again, on a new bar at the next call."""
        with self._lock:
            if self.bar is not None:
                self.bar.close()
            self.bar, self.total, self.nbytes = None, None, 0

    def _open(self, total: int) -> None:
        self.total = total
        if self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                desc=self.desc,
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                bar_format=BAR_FORMAT if self.line_per_update else None,
            )

    def _advance(self, done: int) -> None:
        self.nbytes += done
        if self.bar is not None and done:
            self.bar.update(done)

    def __enter__(self) -> ByteProgress:
        self.started = time.perf_counter()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.seconds = time.perf_counter() - self.started
        if self.bar is not None:
            self.bar.close()

    @property
    def rate(self) -> float:
        """GB/s over the timed block."""
        return self.nbytes / max(self.seconds, 1e-9) / 1e9
