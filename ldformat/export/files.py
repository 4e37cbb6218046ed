"""Writing a materialized step to files, and the one atomic write every output goes through.

:func:`save_step` writes the state ``materialize`` returns as a ``.pt`` file (``torch.save``)
or a ``.safetensors`` file (:func:`flatten_for_safetensors`: the model as
``safetensors.torch.save_model`` writes it, tied weights once). :func:`write_atomically`
creates a file or a directory whole or not at all (a temporary beside it, synced, renamed
into place: the commit discipline of spec §7.4 "Commit protocol" applied to an output);
:func:`write_output` is that write with its OS errors as :class:`OutputWriteError`, the
exit code 3 of ``ldtools`` (spec section 18.1).

This module imports torch and safetensors only when it serializes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ..errors import OutputWriteError

if TYPE_CHECKING:
    import torch

__all__ = [
    "WriteFailure",
    "check_output",
    "flatten_for_safetensors",
    "output_failure",
    "save_step",
    "write_atomically",
    "write_output",
]


@dataclass(frozen=True, kw_only=True)
class WriteFailure:
    """What :func:`write_atomically` tells its ``on_error`` about a failed write.

    ``created`` is False when the temporary (or a folder above it) could not even be created;
    ``temporary_left`` names a temporary that could not be removed (else None); ``existed``
    says whether ``out`` existed before (it is unchanged either way).
    """

    out: Path
    error: BaseException
    existed: bool
    created: bool
    temporary_left: str | None


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _remove(tmp: str | None, directory: bool) -> bool:
    """Remove a temporary file or directory; False if it is still there."""
    if tmp is None:
        return True
    if directory:
        shutil.rmtree(tmp, ignore_errors=True)
        return not os.path.lexists(tmp)
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def _sync_directory(path: Path) -> None:
    """Make a rename in ``path`` durable; not every file system can sync a directory."""
    with contextlib.suppress(OSError):
        dir_fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def write_atomically(out: str | os.PathLike[str], write: Callable[[str], None], *, directory: bool = False,
                     on_error: Callable[[WriteFailure], None] | None = None) -> int:
    """Create ``out`` whole or not at all: the one atomic write of every ldformat output.

    A temporary beside ``out`` (``.<name>.<random>.tmp``; a directory ``.<name>.tmp-<random>``
    with ``directory=True``) is created, with the folders above it, and gets the mode that
    ``open()`` (``mkdir``) would give ``out`` under the umask; ``write(path)`` fills it (a
    serializer may replace the file at that path). A file is then synced; the temporary is
    renamed onto ``out`` (an empty directory at ``out`` is replaced) and the rename synced.

    On any failure the temporary is removed and ``out`` is left as it was. ``on_error``, if
    given, is called with a :class:`WriteFailure` and may raise the error its caller reports
    instead; else (or if it returns) the original exception propagates.

    Args:
        out: the file or directory to create or replace.
        write: fills the temporary at the path it is given.
        directory: create a directory (``out`` must not exist, or be an empty directory).
        on_error: turns a failure into the caller's error.

    Returns:
        The size of the file in bytes (0 for a directory).

    Example:
        >>> write_atomically("out.bin", lambda tmp: Path(tmp).write_bytes(b"data"))   # doctest: +SKIP
        4
    """
    out = Path(out)
    existed = os.path.lexists(out)
    parent = out.parent if str(out.parent) else Path(".")
    tmp: str | None = None
    size = 0
    try:
        parent.mkdir(parents=True, exist_ok=True)
        if directory:
            tmp = tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent)
        else:
            fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{out.name}.", suffix=".tmp")
            os.close(fd)
    except BaseException as e:
        _fail(on_error, WriteFailure(out=out, error=e, existed=existed, created=False, temporary_left=None))
        raise
    try:
        if directory:
            os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp creates 0700; give the mode mkdir would
        write(tmp)
        if directory:
            if out.is_dir():
                out.rmdir()  # empty: a directory with content is refused before any work
        else:
            # After writing: a serializer may have replaced the file at ``tmp`` (safetensors does).
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the mode open() would
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
                size = os.fstat(f.fileno()).st_size
        os.replace(tmp, out)
        tmp = None
    except BaseException as e:
        removed = _remove(tmp, directory)
        _fail(on_error, WriteFailure(out=out, error=e, existed=existed, created=True,
                                     temporary_left=None if removed else tmp))
        raise
    _sync_directory(parent)
    return size


def _fail(on_error: Callable[[WriteFailure], None] | None, failure: WriteFailure) -> None:
    if on_error is not None and isinstance(failure.error, Exception):
        on_error(failure)


# -- output errors -------------------------------------------------------------------------------
def _errno_text(e: OSError) -> str:
    name = errno.errorcode.get(e.errno, str(e.errno)) if e.errno is not None else None
    cause = e.strerror or str(e) or type(e).__name__
    return f"{cause} [{name}]" if name else cause


def write_cause(e: BaseException) -> OSError | None:
    """The OS error behind a failed write: ``e`` itself, one it was raised from or during, or one a
    serializer only names in its message (safetensors: ``... (os error 28)``)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, OSError):
            return cur
        found = re.search(r"\(os error (\d+)\)", str(cur))
        if found:
            code = int(found.group(1))
            return OSError(code, os.strerror(code))
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def output_failure(out: Path, what: str, cause: OSError, existed: bool,
                   tmp_left: str | None = None) -> OutputWriteError:
    """The error of an output that could not be written: it names ``out``, ``what`` and the cause."""
    kept = "the existing file is unchanged" if existed else "no file was written"
    message = f"{out}: cannot write {what}: {_errno_text(cause)}; {kept}"
    if tmp_left is not None:
        message += f"; remove the temporary file {tmp_left}"
    err = OutputWriteError(message)
    err.errno = cause.errno
    return err


def check_output(out: Path, what: str) -> None:
    """Fail early (before a long replay) when ``out`` can obviously not be written.

    Raises:
        OutputWriteError: ``out`` is a directory, is below a file, or its folder is not writable.
    """
    existed = os.path.lexists(out)
    if out.is_dir():
        raise output_failure(out, what, OSError(errno.EISDIR, os.strerror(errno.EISDIR)), existed)
    ancestor = out.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise output_failure(out, what, OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)), existed)
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise output_failure(out, what, OSError(errno.EACCES, os.strerror(errno.EACCES)), existed)


def write_output(out: Path, what: str, write: Callable[[IO[bytes], str], None]) -> int:
    """Write an output file atomically (:func:`write_atomically`) and return its size in bytes.

    ``write(f, tmp)`` writes the content into ``f``, the temporary file opened for writing
    (or into its path ``tmp``). An OS error (disk full, I/O error, permission), also one a
    serializer wraps, raises :class:`OutputWriteError` naming ``out``, ``what`` and the cause;
    any other error propagates as it is. The file gets the mode ``open()`` would give it.
    """

    def fill(tmp: str) -> None:
        with open(tmp, "wb") as f:
            write(f, tmp)

    def as_output_error(failure: WriteFailure) -> None:
        cause = write_cause(failure.error)
        if cause is not None:  # else not an I/O failure: a bug, reported as it is
            raise output_failure(out, what, cause, failure.existed, failure.temporary_left) from failure.error

    return write_atomically(out, fill, on_error=as_output_error)


# -- a materialized step as a file ----------------------------------------------------------------
def _tie_key(name: str, t: torch.Tensor) -> tuple[Any, ...]:
    """Equal for the names of one tied weight (the same tensor under several names)."""
    if t.numel() == 0:
        return ("empty", name)  # empty tensors share no data, whatever their pointers say
    return (t.device, t.untyped_storage().data_ptr(), t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


def flatten_for_safetensors(state: dict[str, Any], with_optimizer: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """The tensors and metadata of a ``.safetensors`` output, written as ``safetensors.torch.save_model`` would.

    Tied weights (names of the same tensor, as ``materialize`` returns a chain's aliases) are
    stored once, under the first of their names in sorted order, and each name left out is
    recorded in the metadata as ``{left_out: kept}``, as ``save_model`` records it. So
    ``safetensors.torch.load_model(model, path)`` loads the file, strictly, into a model whose
    weights are tied the same way, and ``load_file`` gives every tensor once. Other tensors
    that share memory are copied (safetensors refuses shared memory). With ``with_optimizer``
    the optimizer state is added as ``optimizer.state.<index>.<key>`` tensors and its
    ``param_groups`` (and any structure that is not a per-parameter tensor, spec §8.2) as JSON
    metadata.
    """
    from ..format.jsonvalue import encode
    from ..format.optstate import REF_PREFIX, split_state

    model: dict[str, torch.Tensor] = state["model"]
    ties: dict[tuple[Any, ...], list[str]] = {}
    for name, t in model.items():
        ties.setdefault(_tie_key(name, t), []).append(name)
    left_out: dict[str, str] = {}
    for names in ties.values():
        kept, *others = sorted(names)
        left_out.update((other, kept) for other in others)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.items():
        if name in left_out:
            continue
        ptr = t.untyped_storage().data_ptr()
        tensors[name] = t.clone() if ptr in seen and t.numel() else t.contiguous()
        seen.add(ptr)
    metadata = {"ldformat.step": str(state["step"])}
    for other, kept in sorted(left_out.items()):
        metadata.setdefault(other, kept)
    if with_optimizer:
        groups = state["optimizer"]["param_groups"]
        stored, structure = split_state(state["optimizer"], sum(len(g["params"]) for g in groups))
        for name, t in stored.items():
            if name.startswith(REF_PREFIX):  # a tensor inside the optimizer structure (spec §8.2)
                tensors["optimizer." + name[len("optimizer/"):]] = t.contiguous()
            else:
                _, i, key = name.split("/", 2)
                tensors[f"optimizer.state.{i}.{key}"] = t.contiguous()
        metadata["optimizer.param_groups"] = json.dumps(encode(groups))
        if structure is not None:  # what is not a per-parameter tensor, with $ref to the tensors above
            metadata["optimizer.structure"] = json.dumps(structure)
    return tensors, metadata


def save_step(state: dict[str, Any], out: str | os.PathLike[str], *, format: str = "pt",
              with_optimizer: bool = False) -> int:
    """Write a materialized step (what ``materialize`` returns) to the file ``out``, atomically.

    Args:
        state: ``{"model", "optimizer", "step", "extra"}`` of one step.
        out: the file to create or replace.
        format: ``"pt"``: ``torch.save`` of the whole state, which loads with
            ``torch.load(path, weights_only=True)``; ``"safetensors"``: the model as
            :func:`flatten_for_safetensors` lays it out, which loads with
            ``safetensors.torch.load_model(model, path)``.
        with_optimizer: with ``"safetensors"``, also the flattened optimizer state.

    Returns:
        The size of the file in bytes.

    Raises:
        OutputWriteError: the file cannot be written (``out`` is then unchanged).
    """
    path, what = Path(out), f"step {state['step']}"
    if format == "safetensors":
        import safetensors.torch

        tensors, metadata = flatten_for_safetensors(state, with_optimizer)
        return write_output(path, what, lambda f, tmp: safetensors.torch.save_file(tensors, tmp, metadata=metadata))
    if format != "pt":
        raise ValueError(f"{out}: format must be 'pt' or 'safetensors', not {format!r}")
    import torch

    return write_output(path, what, lambda f, tmp: torch.save(state, f))
