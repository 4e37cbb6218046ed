"""Loopback ports and the environment of ``torch.distributed`` workers on gloo at 127.0.0.1.

Plain functions rather than fixtures: module-scoped fixtures, retry loops and the server helpers
(``s3server``, ``azurite``) call them too.
"""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (a worker may still lose the race for
    it: the launchers retry on ``EADDRINUSE``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gloo_env(**extra: str) -> dict[str, str]:
    """This process's environment for ``torch.distributed`` workers: rendezvous at 127.0.0.1 on
    a free port, one OpenMP thread each (the workers share the cores), these helpers importable
    (a test module run as a worker finds them so), plus ``extra``."""
    path = os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=path)
    env.update(extra)
    return env
