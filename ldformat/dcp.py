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

Works for sharded chains and ordinary ones, in one process without a process group.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import OutputWriteError, UsageError
from .reader import ChainReader
from .sharded import ShardedReader, open_reader


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


def export_dcp(chain: str | os.PathLike[str] | ChainReader | ShardedReader, step: int | None,
               out_dir: str | os.PathLike[str], *, progress: Callable[[int, int], None] | None = None) -> int:
    """Write step ``step`` (default: the latest) of ``chain`` as a DCP directory at ``out_dir``.

    The directory is written beside ``out_dir`` and renamed into place, so ``out_dir``
    either holds a whole checkpoint or does not exist. Returns the step written.

    Raises:
        UsageError: ``out_dir`` exists and is not an empty directory.
        OutputWriteError: the directory cannot be written.
    """
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out}: exists and is not an empty directory; pick a new output directory")
    reader = chain if isinstance(chain, (ChainReader, ShardedReader)) else open_reader(chain)
    state = reader.materialize(step, progress=progress)
    schema = reader.ranks[0].root.schema if isinstance(reader, ShardedReader) else reader.root.schema
    sd = dcp_state_dict(state, list(schema["optimizer"]["params"]))
    parent = out.parent if str(out.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    except OSError as e:
        raise OutputWriteError(f"{out}: cannot create the output directory: {e.strerror or e}") from None
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process.*", category=UserWarning)
            dcp_save(sd, checkpoint_id=str(tmp), no_dist=True)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except OSError as e:
        raise OutputWriteError(f"{out}: cannot write the DCP checkpoint: {e.strerror or e}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return int(state["step"])
