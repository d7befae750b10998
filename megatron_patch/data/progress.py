"""Progress of a long data job: one refreshed line on a terminal, plain log lines otherwise.

    progress = Progress(total_bytes=os.path.getsize("corpus.jsonl"), log_interval=1000)
    progress.update(documents=1000, input_bytes=5_000_000, tokens=1_200_000, position=5_000_000)
    progress.close()
"""

import sys
import time
from typing import TextIO


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Report documents, MB/s, tokens/s and an ETA.

    On a TTY the line is redrawn at most `refresh_s` apart; elsewhere (a log file, CI) one line
    is printed each time the document count passes a multiple of `log_interval`, as Megatron-LM's
    `--log-interval` does. `position` is how far through the `total_bytes` of input the job is
    (compressed bytes for `.gz` input), which drives the ETA.
    """

    def __init__(
        self, total_bytes: int, log_interval: int = 1000, stream: TextIO | None = None, refresh_s: float = 0.25
    ):
        self.total_bytes = max(total_bytes, 1)
        self.log_interval = log_interval
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.refresh_s = refresh_s
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._last_logged = 0

    def line(self, documents: int, input_bytes: int, tokens: int, position: int) -> str:
        """The progress text, e.g. `12000 docs | 9.1 MB/s | 2.3M tok/s | 41% | ETA 0:00:12`."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        fraction = min(position / self.total_bytes, 1.0)
        eta = elapsed * (1 - fraction) / fraction if fraction > 0 else float("nan")
        return (
            f"{documents} docs | {input_bytes / elapsed / 1e6:.1f} MB/s | "
            f"{tokens / elapsed / 1e6:.2f}M tok/s | {100 * fraction:.0f}% | "
            f"ETA {_duration(eta) if eta == eta else '?'}"
        )

    def update(self, documents: int, input_bytes: int, tokens: int, position: int) -> None:
        now = time.perf_counter()
        if self.tty:
            if now - self._last_draw >= self.refresh_s:
                self.stream.write("\r\x1b[K" + self.line(documents, input_bytes, tokens, position))
                self.stream.flush()
                self._last_draw = now
        elif documents // self.log_interval > self._last_logged // self.log_interval:
            self.stream.write(self.line(documents, input_bytes, tokens, position) + "\n")
            self.stream.flush()
            self._last_logged = documents

    def close(self, summary: str = "") -> None:
        """End the progress display, then print `summary` on its own line."""
        if self.tty:
            self.stream.write("\r\x1b[K")
        if summary:
            self.stream.write(summary + "\n")
        self.stream.flush()
