"""A one-line progress bar on stderr; plain lines at quarter marks when stderr is not a terminal."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str, is_enabled: bool = True, stream=None, min_interval_s: float = 0.2):
        self.total = total
        self.label = label
        self.is_enabled = is_enabled
        self.stream = stream or sys.stderr
        self.is_tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.min_interval_s = min_interval_s
        self.num_done = 0
        self.num_in_flight = 0
        self.num_tokens = 0
        self._start_s = time.perf_counter()
        self._last_draw_s = 0.0
        self._next_mark = 1

    def update(self, *, done: int = 0, in_flight: int | None = None, tokens: int = 0) -> None:
        self.num_done += done
        self.num_tokens += tokens
        if in_flight is not None:
            self.num_in_flight = in_flight
        self._draw(force=done > 0 and self.num_done == self.total)

    def close(self) -> None:
        self._draw(force=True)
        if self.is_enabled and self.is_tty:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, force: bool = False) -> None:
        if not self.is_enabled:
            return
        now_s = time.perf_counter()
        if self.is_tty:
            if not force and now_s - self._last_draw_s < self.min_interval_s:
                return
            self.stream.write("\r" + self._line(now_s) + "\x1b[K")
        else:  # a log file: a line at each quarter, not a carriage-return storm
            mark = 4 * self.num_done // max(self.total, 1)
            if mark < self._next_mark and not (force and self.num_done == self.total and self._next_mark <= 4):
                return
            self._next_mark = mark + 1
            self.stream.write(self._line(now_s) + "\n")
        self._last_draw_s = now_s
        self.stream.flush()

    def _line(self, now_s: float) -> str:
        width = 24
        filled = width * self.num_done // max(self.total, 1)
        elapsed_s = now_s - self._start_s
        rate = self.num_tokens / elapsed_s if elapsed_s > 0 else 0.0
        return (f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.num_done}/{self.total} done, "
                f"{self.num_in_flight} in flight, {self.num_tokens} tok, {rate:.0f} tok/s, {elapsed_s:.1f}s")
