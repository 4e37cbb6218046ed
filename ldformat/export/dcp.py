"""Export a step as a ``torch.distributed.checkpoint`` directory (spec §20.9, informative).

The directory holds ``{"model": state by FQN, "optimizer": state by FQN}``, the optimizer
part laid out as ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` lays
it out, so a job of any world size and mesh loads it with DCP's own tools::

    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)
    sd = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=DIR)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optimizer"])

Works for sharded chains and ordinary ones, in one process without a process group::

    from ldformat.export.dcp import export_dcp
    export_dcp("runs/chain", 120, "step120-dcp")

Hyperparameters (``lr``, ``betas``, ...) and non-tensor optimizer state are stored too. DCP
loads only the keys the state dict passed to ``dcp.load`` has: build the optimizer (and its
learning-rate scheduler, which adds ``initial_lr`` to the param groups) and take
``get_optimizer_state_dict`` after that, as above. Entries of ``optimizer.state_dict()``
besides ``state`` and ``param_groups`` are not exported (``set_optimizer_state_dict`` would
not restore them either).
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..chain.reader import ChainReader
from ..errors import OutputWriteError, UsageError
from ..sharded.chain import ShardedReader, open_reader
from .files import WriteFailure, output_failure, write_atomically


def dcp_state_dict(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """``{"model", "optimizer"}`` of a materialized state, the optimizer keyed by FQN.

    ``names[i]`` is the FQN of optimizer parameter ``i`` (``schema.optimizer.params``).
    """
    optimizer = state["optimizer"]
    per_param = {}
    for key, value in optimizer.get("state", {}).items():
        if not (isinstance(key, int) and 0 <= key < len(names)):
            raise UsageError(f"optimizer state key {key!r} is not a parameter index; a DCP export keys the "
                             "state by parameter name and cannot hold it")
        per_param[names[key]] = value
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
              for g in optimizer.get("param_groups", [])]
    return {"model": dict(state["model"]), "optimizer": {"state": per_param, "param_groups": groups}}


def _save(sd: dict[str, Any], tmp: Path, out: Path) -> None:
    """``dcp.save`` in this process; its failures (a ``CheckpointException``, a
    ``BaseException`` that names each rank's error) as the OS error behind them or a
    ``RuntimeError``."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process.*", category=UserWarning)
            dcp_save(sd, checkpoint_id=str(tmp), no_dist=True)
    except CheckpointException as e:
        causes = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        for cause in causes:
            if isinstance(cause, OSError):
                raise cause from None
        detail = "; ".join(f"{type(c).__name__}: {c}" for c in causes) or str(e)
        raise RuntimeError(f"{out}: torch.distributed.checkpoint.save failed: {detail}") from None


def _write_error(out: Path, doing: str, e: OSError) -> OutputWriteError:
    name = errno.errorcode.get(e.errno, "") if e.errno is not None else ""
    err = OutputWriteError(f"{out}: {doing}: {e.strerror or e}{f' [{name}]' if name else ''}; "
                           "nothing was written there")
    err.errno = e.errno
    return err


def _as_write_error(failure: WriteFailure) -> None:
    """An OS error as the :class:`OutputWriteError` of a DCP export; any other error is left as it is."""
    if isinstance(failure.error, OSError):
        doing = "cannot write the DCP checkpoint" if failure.created else "cannot create the output directory"
        raise _write_error(failure.out, doing, failure.error) from None


def export_dcp(chain: str | os.PathLike[str] | ChainReader | ShardedReader, step: int | None,
               out_dir: str | os.PathLike[str], *, progress: Callable[[int, int], None] | None = None,
               replace: bool = False) -> int:
    """Write step ``step`` (default: the latest) of ``chain`` as a DCP directory at ``out_dir``.

    The directory is written beside ``out_dir`` and renamed into place, so ``out_dir``
    either holds a whole checkpoint or does not exist. With ``replace``, a file or a directory
    already at ``out_dir`` is replaced once the new checkpoint is complete (written beside it,
    then swapped in). Returns the step written.

    Raises:
        UsageError: ``out_dir`` exists and is not an empty directory (without ``replace``).
        OutputWriteError: the directory cannot be written.
    """
    out = Path(out_dir)
    if replace and os.path.lexists(out) and (not out.is_dir() or any(out.iterdir())):
        return _replace_dcp(chain, step, out, progress)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out}: exists and is not an empty directory; pick a new output directory")
    reader = chain if isinstance(chain, (ChainReader, ShardedReader)) else open_reader(chain)
    state = reader.materialize(step, progress=progress)
    schema = reader.ranks[0].root.schema if isinstance(reader, ShardedReader) else reader.root.schema
    sd = dcp_state_dict(state, list(schema["optimizer"]["params"]))
    write_atomically(out, lambda tmp: _save(sd, Path(tmp), out), directory=True, on_error=_as_write_error)
    return int(state["step"])


def _replace_dcp(chain: str | os.PathLike[str] | ChainReader | ShardedReader, step: int | None, out: Path,
                 progress: Callable[[int, int], None] | None) -> int:
    """Write a DCP directory beside ``out``, then swap it in for what is at ``out`` (put back on failure)."""
    fresh = Path(tempfile.mkdtemp(prefix=f".{out.name}.new-", dir=out.parent)) / out.name
    try:
        written = export_dcp(chain, step, fresh, progress=progress)
        old = out.parent / f"{fresh.parent.name}-old"
        try:
            os.replace(out, old)
            try:
                os.replace(fresh, out)
            except OSError:
                os.replace(old, out)  # put the old one back
                raise
        except OSError as e:
            raise output_failure(out, f"step {written}", e, True) from e
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    finally:
        shutil.rmtree(fresh.parent, ignore_errors=True)
    return written
