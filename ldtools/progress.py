"""Progress bars on standard error for the long ``ldtools`` commands.

A bar is drawn only when standard error is a terminal, unless the user asks otherwise
(``--progress``/``--no-progress``, or the environment variable ``LDTOOLS_PROGRESS`` set to
``1`` or ``0``). Standard output never carries a bar, so ``ldtools ... --json | jq`` stays
clean. Drawing never fails a command: an error writing to standard error turns the bar off.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

PROGRESS_ENV = "LDTOOLS_PROGRESS"
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def human_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB``; whole bytes below 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"  # pragma: no cover (the loop always returns)


def progress_wanted(flag: bool | None, stream: Any) -> bool:
    """Whether to draw: ``flag`` if given, else ``LDTOOLS_PROGRESS`` if it says yes or no,
    else whether ``stream`` is a terminal."""
    if flag is not None:
        return flag
    env = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if env in _ON:
        return True
    if env in _OFF:
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


def _duration(seconds: float, *, up: bool = False) -> str:
    """``75.2`` -> ``1:15`` (``1:16`` rounded ``up``, as a time left should be)."""
    s = max(0, math.ceil(seconds) if up else math.floor(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class ProgressBar:
    """A ``progress=`` callback of ldformat that draws one bar per stage on standard error.

    ldformat calls it as ``progress(done, total)`` (``ChainReader.materialize``) or
    ``progress(stage, done, total)`` (``validate``, ``compact``, ``sync``); each stage gets
    its own line, ``label [#########---------]  50%  6/12  0:03 left``, redrawn in place at
    most every :attr:`INTERVAL` seconds (and always when a stage completes).

    Args:
        labels: the text before the bar, by stage (``""`` for two-argument calls).
        enabled: draw at all (see :func:`progress_wanted`).
        byte_stages: stages whose counts are bytes (shown as ``1.5 MiB``).
        stream: where to draw (default: ``sys.stderr`` as it is when the bar is made).

    Example:
        >>> bar = ProgressBar({"": "replaying"}, enabled=False)
        >>> bar(3, 10); bar.close()
    """

    WIDTH = 24
    INTERVAL = 0.1

    def __init__(self, labels: Mapping[str, str], *, enabled: bool, byte_stages: Collection[str] = (),
                 stream: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.labels = dict(labels)
        self.enabled = enabled
        self.byte_stages = frozenset(byte_stages)
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self._lock = threading.Lock()
        self._stage: str | None = None
        self._started = 0.0
        self._drawn_at = -math.inf
        self._width = 0  # characters of the line on screen; 0: no line open

    def __call__(self, *args: Any) -> None:
        if not self.enabled or len(args) not in (2, 3):
            return
        stage = str(args[0]) if len(args) == 3 else ""
        done, total = int(args[-2]), int(args[-1])
        if total <= 0:
            return
        with self._lock:
            now = self.clock()
            if stage != self._stage:
                self._end_line()
                self._stage, self._started, self._drawn_at = stage, now, -math.inf
            if done < total and now - self._drawn_at < self.INTERVAL:
                return
            self._drawn_at = now
            self._draw(self.line(stage, done, total, now - self._started))

    def line(self, stage: str, done: int, total: int, elapsed: float) -> str:
        """The text of the bar of ``stage`` at ``done`` of ``total`` after ``elapsed`` seconds."""
        fraction = min(max(done / total, 0.0), 1.0)
        filled = int(self.WIDTH * fraction)
        show = human_bytes if stage in self.byte_stages else str
        text = (f"{self.labels.get(stage, stage or 'working')} [{'#' * filled}{'-' * (self.WIDTH - filled)}] "
                f"{int(100 * fraction):3d}%  {show(done)}/{show(total)}")
        if 0 < done < total and elapsed >= 1.0:
            text += f"  {_duration(elapsed * (total - done) / done, up=True)} left"
        elif done >= total:
            text += f"  {_duration(elapsed)}"
        return text

    def close(self) -> None:
        """End the current line (call before anything else is printed, and in ``finally``)."""
        with self._lock:
            self._end_line()
            self._stage = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- drawing -----------------------------------------------------------------------------
    def _draw(self, text: str) -> None:
        pad = " " * max(0, self._width - len(text))  # wipe what a longer previous line left
        if self._write("\r" + text + pad):
            self._width = len(text)

    def _end_line(self) -> None:
        if self._width:
            self._width = 0
            self._write("\n")

    def _write(self, text: str) -> bool:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError, UnicodeError):
            self.enabled = False  # a closed or broken stderr: no more bars, the command goes on
            self._width = 0
            return False
        return True
