"""How many intra-op threads torch runs a replay on, in the commands that replay.

Replay overlaps two kinds of work: the main thread applies a step (an optimizer step on
torch's intra-op threads, or an XOR), while one prefetch thread reads and decodes the next
step's row (``ldformat.chain.reader``). torch's default, one thread per core, leaves that decoding
thread no core of its own: torch's OpenMP threads then wait on each other at every parallel
region while one of them is descheduled, and a replay on a busy machine slows down several
times. The commands take one core fewer than the cores this process may run on
(``os.sched_getaffinity``), and never more than torch's default.

``--threads N`` or the environment variable ``LDTOOLS_THREADS=N`` sets the count; with
``OMP_NUM_THREADS`` set (and neither of those), torch's own setting is kept.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import click

from ldformat import UsageError

THREADS_ENV = "LDTOOLS_THREADS"
#: Threads that decode while a step is applied: the replay's prefetch thread.
DECODE_THREADS = 1

THREADS_HELP = (f"Intra-op threads of the replay (default: the cores this process may use, less one for decoding, "
                f"at most torch's default; or {THREADS_ENV}). With OMP_NUM_THREADS set, torch's setting is kept.")

THREADS = click.option("--threads", "threads", type=click.IntRange(min=1), default=None, metavar="N",
                       help=THREADS_HELP)


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on every platform
        return os.cpu_count() or 1


def _from_env() -> int | None:
    text = os.environ.get(THREADS_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"{THREADS_ENV}={text!r}: give a number of threads >= 1")
    return int(text)


def replay_threads(requested: int | None, torch_default: int) -> int | None:
    """The intra-op thread count for a replay; None keeps torch's (``OMP_NUM_THREADS`` set).

    Args:
        requested: ``--threads``, if given.
        torch_default: ``torch.get_num_threads()`` before any change.
    """
    if requested is not None:
        return requested
    from_env = _from_env()
    if from_env is not None:
        return from_env
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return None
    return max(1, min(torch_default, available_cores() - DECODE_THREADS))


@contextmanager
def replay_thread_count(requested: int | None) -> Iterator[None]:
    """Run the body with the intra-op threads :func:`replay_threads` chooses, then restore torch's."""
    import torch

    before = torch.get_num_threads()
    chosen = replay_threads(requested, before)
    if chosen is None or chosen == before:
        yield
        return
    torch.set_num_threads(chosen)
    try:
        yield
    finally:
        torch.set_num_threads(before)
