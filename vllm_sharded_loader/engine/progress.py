"""Progress bars for loading and saving: bytes, one bar per call, shown only where asked."""

from __future__ import annotations

import time
from types import TracebackType

# vLLM's loaders use this format: one line per update, which survives the prefixes
# that multiprocessing puts on worker output.
BAR_FORMAT = "{desc}: {percentage:3.0f}% Completed | {n_fmt}B/{total_fmt}B [{elapsed}<{remaining}, {rate_fmt}]\n"


class ByteProgress:
    """A callback ``(bytes_done_now, bytes_total)`` that drives a tqdm bar and times the work.

    The bar opens on the first call (when the total is known) and only when ``enabled``;
    ``seconds`` and ``nbytes`` are kept either way, for the log line.
    """

    def __init__(self, desc: str, enabled: bool) -> None:
        self.desc, self.enabled = desc, enabled
        self.bar = None
        self.nbytes = 0
        self.started = time.perf_counter()
        self.seconds = 0.0

    def __call__(self, done: int, total: int) -> None:
        if self.enabled and self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, desc=self.desc, unit="B", unit_scale=True, unit_divisor=1000, bar_format=BAR_FORMAT
            )
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
