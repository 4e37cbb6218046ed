"""Openers of object stores for the store contract's multi-process tests.

A child process started by the ``forkserver`` method inherits the environment of the fork
server, which is started once per test run, by whichever test module first needed it: it
may not hold the variables that point this module's store at its local server (moto's
``AWS_*``, Azurite's ``AZURE_*``). An opener made here carries them and sets them in the
child before it opens the store.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
from collections.abc import Callable

from ldformat.stores import FaultyStore, ObjectStore, Store

PREFIXES = ("AWS_", "AZURE_", "AZURITE_", "GOOGLE_", "LDFORMAT_")


def _open(url: str, env: dict[str, str], faulty: bool) -> Store:
    for name in [n for n in os.environ if n.startswith(PREFIXES)]:
        del os.environ[name]
    os.environ.update(env)
    store = ObjectStore(url)
    return FaultyStore(store) if faulty else store


def object_store_opener(url: str, *, faulty: bool = False) -> Callable[[], Store]:
    """Opens ``ObjectStore(url)`` (in a :class:`FaultyStore` with ``faulty``) in a child
    process, with this process's store environment."""
    # obstore's runtime does not survive fork(): children start from a fork server that has
    # imported ldformat but never used obstore.
    multiprocessing.get_context("forkserver").set_forkserver_preload(["ldformat.stores"])
    env = {n: v for n, v in os.environ.items() if n.startswith(PREFIXES)}
    return functools.partial(_open, url, env, faulty)
