"""``ldtools``: a thin click layer over ldformat's public API.

Exit codes (spec section 18.1): 0 success; 1 a problem with the chain (invalid, corrupt, missing
object, unsupported version, step not committed, I/O error on the chain); 2 a usage error or a
path that is not a chain; 3 an output file or standard output could not be written; 4 the chain
is locked by another writer; 70 an internal error (a bug); 130 interrupted or not confirmed; 141
standard output closed (broken pipe). An error is one line on stderr, without a traceback unless
``LDTOOLS_DEBUG=1`` or ``ldtools --debug`` asks for one.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import sys
import tempfile
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NoReturn, TypeVar

import click

import ldformat  # light: its public names are imported on first use (torch and zarr with them)
from ldformat.errors import (
    ChainLockedError,
    LdformatError,
    NotAChainError,
    OutputWriteError,
    UsageError,
)

from .consent import (
    BREAK_LOCK_HELP,
    YES_HELP,
    confirm,
    refuse_break_lock_without_consent,
    with_lock,
)
from .progress import PROGRESS_ENV, ProgressBar, human_bytes, progress_wanted
from .threads import THREADS, replay_thread_count

if TYPE_CHECKING:
    import torch

    from ldformat import ChainReader, ShardedReader

F = TypeVar("F", bound=Callable[..., Any])

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_OUTPUT = 3
EXIT_LOCKED = 4
EXIT_INTERNAL = 70  # EX_SOFTWARE of sysexits.h
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE

DEBUG_ENV = "LDTOOLS_DEBUG"
_STEP_CONTEXT = "_ldtools_step_context"


class _Session:
    """Per-invocation settings (reset each time the command line is parsed)."""

    debug = False


def _debug_from_env() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


# -- printing ----------------------------------------------------------------------------------
def printable(text: str, stream: Any = None) -> str:
    """``text`` as the stream can encode it: undecodable path bytes (``\\udcff``) become ``\\xff``.

    A path with bytes that are not UTF-8 comes from the OS as lone surrogates; a strict
    UTF-8 stream cannot encode them. They are shown as backslash escapes of the original bytes.
    """
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
        return text
    except (UnicodeEncodeError, LookupError):
        pass
    try:
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # surrogates that are not escaped bytes
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    try:
        return text.encode(encoding, "backslashreplace").decode(encoding)
    except LookupError:
        return text.encode("ascii", "backslashreplace").decode("ascii")


def _is_broken_pipe(e: BaseException) -> bool:
    return isinstance(e, BrokenPipeError) or (
        isinstance(e, OSError) and not isinstance(e, OutputWriteError) and e.errno == errno.EPIPE
    )


def _errno_text(e: OSError) -> str:
    name = errno.errorcode.get(e.errno, str(e.errno)) if e.errno is not None else None
    cause = e.strerror or str(e) or type(e).__name__
    return f"{cause} [{name}]" if name else cause


def _write_all(stream: Any, text: str) -> None:
    """Write ``text`` and flush, failing on a short write.

    Python's text layer ignores the count a buffered binary write returns, and that write
    returns a short count, without an error, when the disk fills up half-way: the rest of the
    output would be lost silently. The bytes go to the binary buffer in a loop instead.
    """
    buffer = getattr(stream, "buffer", None)
    if buffer is None:  # a text-only stream (an IDE, a test double)
        stream.write(text)
        stream.flush()
        return
    stream.flush()  # anything already written through the text layer goes first
    data = memoryview(text.encode(getattr(stream, "encoding", None) or "utf-8", "backslashreplace"))
    while data:
        n = buffer.write(data)
        if not n:
            raise OSError(errno.EIO, "short write")
        data = data[n:]
    buffer.flush()


def _echo(message: str = "") -> None:
    """Print one line on stdout; an error writing it (other than a closed pipe) is an output error."""
    try:
        _write_all(sys.stdout, printable(message, sys.stdout) + "\n")
    except OSError as e:
        if _is_broken_pipe(e):
            raise
        raise _output_error("standard output", e) from e


def _say(message: str) -> None:
    """Print one line on stderr, whatever state stderr is in."""
    with contextlib.suppress(OSError, ValueError):
        click.echo(printable(" ".join(message.splitlines()), sys.stderr), err=True)


def _output_error(what: str, e: OSError) -> OutputWriteError:
    err = OutputWriteError(f"{what}: cannot write: {_errno_text(e)}")
    err.errno = e.errno
    return err


def _silence_stdout() -> None:
    """After a broken pipe, send what is still buffered for stdout to /dev/null (no error at exit)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        fd = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(fd, sys.stdout.fileno())
        finally:
            os.close(fd)


# -- errors and exit codes ---------------------------------------------------------------------
@contextlib.contextmanager
def _about_step(step: int | None, doing: str) -> Iterator[None]:
    """Make an error raised inside name ``step`` (the step the user asked for) if it does not already."""
    try:
        yield
    except (LdformatError, OSError) as e:
        if step is not None and not isinstance(e, OutputWriteError) and not hasattr(e, _STEP_CONTEXT):
            setattr(e, _STEP_CONTEXT, f"{doing} step {step}")
        raise


def _os_message(e: OSError) -> str:
    names = [str(n) for n in (e.filename, e.filename2) if n is not None]
    where = " -> ".join(names) if names else "I/O error"
    return f"{where}: {_errno_text(e)}"


def classify(e: BaseException) -> tuple[int, str | None]:
    """The exit code of an exception and its one-line message (None: exit quietly)."""
    if isinstance(e, OutputWriteError):
        code, message = EXIT_OUTPUT, str(e)
    elif _is_broken_pipe(e):
        return EXIT_BROKEN_PIPE, None
    elif isinstance(e, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted"
    elif isinstance(e, click.Abort):
        return EXIT_INTERRUPTED, "aborted; nothing was changed"
    elif isinstance(e, ChainLockedError):  # LockLostError too
        code, message = EXIT_LOCKED, str(e)
    elif isinstance(e, (NotAChainError, UsageError)):
        code, message = EXIT_USAGE, str(e)
    elif isinstance(e, LdformatError):
        code, message = EXIT_PROBLEM, str(e)
    elif isinstance(e, OSError):
        code, message = EXIT_PROBLEM, _os_message(e)
    else:
        detail = " ".join(str(e).splitlines()) or "(no message)"
        return EXIT_INTERNAL, (
            f"internal error: {type(e).__name__}: {detail} (this is a bug in ldtools: please report it "
            f"with the command line; {DEBUG_ENV}=1 shows the traceback)"
        )
    context = getattr(e, _STEP_CONTEXT, None)
    if context is not None:
        step = context.rsplit(" ", 1)[-1]
        if not re.search(rf"\bstep {re.escape(step)}\b", message):
            message += f"; while {context}"
    return code, f"error: {message}"


def exit_for(e: BaseException) -> NoReturn:
    """Report ``e`` as documented (spec section 18.1) and exit with its code."""
    code, message = classify(e)
    if message is None:
        _silence_stdout()
        sys.exit(code)
    if _Session.debug or _debug_from_env():
        with contextlib.suppress(OSError, ValueError):
            traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    _say(f"ldtools: {message}")
    sys.exit(code)


_CLICK_FLOW = (click.exceptions.Exit, click.ClickException)


@contextlib.contextmanager
def _exit_codes() -> Iterator[None]:
    try:
        yield
    except _CLICK_FLOW:
        raise  # --help, --version, bad options: click reports them (exit 0 or 2)
    except (Exception, KeyboardInterrupt) as e:
        exit_for(e)


def errors_to_exit_codes(fn: F) -> F:
    """Turn every error of a command into one line on stderr and its documented exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _exit_codes():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


class LdtoolsGroup(click.Group):
    """A click group that applies the exit codes to everything it runs, help and version included."""

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        if parent is None:
            _Session.debug = _debug_from_env()
        with _exit_codes():
            return super().make_context(info_name, args, parent, **extra)
        raise AssertionError("unreachable")  # pragma: no cover

    def invoke(self, ctx: click.Context) -> Any:
        with _exit_codes():
            return super().invoke(ctx)
        raise AssertionError("unreachable")  # pragma: no cover


CHAIN = click.argument("chain", type=click.Path(path_type=str))


@click.group(cls=LdtoolsGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(ldformat.__version__, prog_name="ldtools")
@click.option("--debug", is_flag=True, help=f"On an error, also print the Python traceback (or set {DEBUG_ENV}=1).")
def cli(debug: bool) -> None:
    """Inspect, materialize, validate and compact ldformat checkpoint chains.

    CHAIN is a directory or a URL: s3://bucket/prefix, gs://bucket/prefix,
    az://container/prefix (the account in AZURE_STORAGE_ACCOUNT_NAME),
    http(s)://host/prefix (pip install 'ldformat[s3]'), configured by each cloud's
    environment variables (AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID,
    AWS_ALLOW_HTTP=true for an http:// endpoint, GOOGLE_SERVICE_ACCOUNT, ...).

    An error is one line on stderr. Exit codes (spec section 18.1):

    \b
      0    success
      1    a problem with the chain (corrupt, missing object, unsupported
           version, step not committed, I/O error on the chain)
      2    usage error, the path is not a chain, or a command that deletes
           was not confirmed (no --yes, stdin not a terminal)
      3    the output file (or stdout) could not be written
      4    the chain is locked by another writer
      70   internal error (a bug in ldtools: please report it)
      130  interrupted, or a confirmation was declined
      141  stdout was closed (broken pipe)

    Commands that delete ask first: truncate, compact with --keep-last or
    --keep-every, and --break-lock. They ask on a terminal; with --yes they do not
    ask; with neither (stdin is not a terminal) they change nothing and exit 2.
    materialize replaces an existing output only with --force.

    materialize, validate, compact and sync draw a progress bar on stderr when
    stderr is a terminal (--progress/--no-progress, or LDTOOLS_PROGRESS=1 or 0,
    change that); stdout never gets one. Commands that replay use the cores they
    may run on less one (--threads, LDTOOLS_THREADS).
    """
    _Session.debug = _Session.debug or debug


def full_checkpoint(reader: ChainReader) -> dict[str, int]:
    """The size of one full checkpoint of the latest step: the anchor that step would get.

    That is the state ``materialize`` returns, as an anchor object stores it (spec section
    9.1): model tensors (tied weights once) and optimizer state, in a safetensors file, header
    included, without top-k residuals (which only a compressor needs). A latest step that is
    not an anchor is replayed from its anchor, as ``materialize`` does: the size of an older
    anchor misses what the optimizer state gained since (the anchor a chain is created with,
    written before the first optimizer step, holds no optimizer state at all).

    Returns:
        ``{"step", "bytes", "model_bytes", "optimizer_bytes"}``.

    Raises:
        EmptyChainError: the chain has no committed step.
        LdformatError: an object it needs is missing or damaged.
    """
    from ldformat.format.anchor import anchor_parts

    step = reader.latest_step
    if step is None:
        raise ldformat.EmptyChainError(f"{reader.path}: the chain has no committed step yet")
    state = _stored_state(reader, step)

    def nbytes(prefix: str) -> int:
        return sum(t.numel() * t.element_size() for n, t in state.items() if n.startswith(prefix))

    return {"step": step, "bytes": anchor_parts(state, step).size, "model_bytes": nbytes("model/"),
            "optimizer_bytes": nbytes("optimizer/")}


def _stored_state(reader: ChainReader, step: int) -> dict[str, Any]:
    """The tensors of ``step`` as an anchor stores them (``model/<name>``, tied weights once;
    ``optimizer/<index>/<key>``, ``optimizer/ref/...``), replayed from its anchor if need be,
    without top-k residuals."""
    anchor_step, path = reader.state.replay_path(step)
    if path:
        replayer = reader.start_replay(anchor_step)
        reader.replay_steps(replayer, path)
        replayer.sync_optimizer_tensors()
        tensors = replayer.tensors
    else:
        tensors = reader.load_anchor_tensors(step)
    return {n: t for n, t in tensors.items() if not n.startswith("compressor")}


def sharded_full_state(reader: ldformat.ShardedReader) -> dict[str, int]:
    """The size of the full unsharded state of the latest committed step of a sharded chain.

    Measured without assembling it: rank 0's chain is replayed to that step, and each of its
    tensors counts at the global shape the layout gives it (a model tensor the layout splits,
    and an optimizer state tensor shaped like its parameter's shard), else once (a replicated
    tensor, a scalar such as Adam's ``step``). Model and optimizer bytes of the tensors, tied
    weights once; unlike :func:`full_checkpoint`, no file header.

    Returns:
        ``{"step", "bytes", "model_bytes", "optimizer_bytes"}``.

    Raises:
        EmptyChainError: the chain has no committed step.
        LdformatError: an object it needs is missing or damaged.
    """
    step = reader.latest_step
    if step is None:
        raise ldformat.EmptyChainError(f"{reader.path}: the chain has no committed step yet")
    rank0 = reader.ranks[0]
    layouts = reader.root.tensors
    params: list[str] = list(rank0.root.schema["optimizer"]["params"])
    sizes = {"model/": 0, "optimizer/": 0}
    for name, t in _stored_state(rank0, step).items():
        numel = t.numel()
        if name.startswith("model/"):
            layout = layouts.get(name)
            if layout is not None:
                shard = layout.of_rank(0)
                if shard is not None and tuple(t.shape) != shard.lengths:
                    raise ldformat.CorruptChainError(
                        f"{rank0.path} (step {step}) {name}: rank 0 stores shape {list(t.shape)}, the layout of "
                        f"{reader.path} says {list(shard.lengths)}")
                numel = _numel(layout.shape)
        elif name.startswith("optimizer/"):
            _, index, _key = (name.split("/", 2) + ["", ""])[:3]
            param = params[int(index)] if index.isdigit() and int(index) < len(params) else None
            layout = layouts.get(f"model/{param}") if param is not None else None
            if layout is not None and layout.split:
                shard = layout.of_rank(0)
                mine = shard.lengths if shard is not None else None
                if tuple(t.shape) == mine or (mine is None and t.dim() == len(layout.shape) and t.dim() > 0):
                    numel = _numel(layout.shape)
        else:
            continue
        sizes["model/" if name.startswith("model/") else "optimizer/"] += numel * t.element_size()
    return {"step": step, "bytes": sizes["model/"] + sizes["optimizer/"], "model_bytes": sizes["model/"],
            "optimizer_bytes": sizes["optimizer/"]}


_Reader = TypeVar("_Reader", "ChainReader", "ShardedReader")


def _full_state_or_error(reader: _Reader, measure: Callable[[_Reader], dict[str, int]]
                         ) -> tuple[dict[str, int] | None, str | None]:
    """``measure(reader)``, or None and why not (info still summarizes a damaged chain)."""
    if reader.latest_step is None:
        return None, None
    try:
        try:
            return measure(reader), None
        except ldformat.MissingObjectError:
            reader.refresh()  # a compaction removed what this view of the log referenced
            return measure(reader), None
    except LdformatError as e:
        return None, str(e)


def _full_checkpoint_or_error(reader: ChainReader) -> tuple[dict[str, int] | None, str | None]:
    """:func:`full_checkpoint`, or None and why not (info still summarizes a damaged chain)."""
    return _full_state_or_error(reader, full_checkpoint)


def sharded_parent(chain: str) -> tuple[str, int] | None:
    """``(sharded chain, rank)`` when ``chain`` is one rank's chain of a sharded chain
    (``<sharded>/ranks/<rank:05d>``), else None (also when that cannot be read)."""
    from ldformat.chain.reader import open_store
    from ldformat.chain.sharded_probe import RANKS_DIR, SHARDED_ROOT, is_sharded
    from ldformat.stores import parse_location

    try:
        loc = parse_location(chain)
        if loc.path is not None:
            here = loc.path
            if re.fullmatch(r"\d{5}", here.name) and here.parent.name == RANKS_DIR and (
                    here.parent.parent / SHARDED_ROOT).is_file():
                return str(here.parent.parent), int(here.name)
            return None
        found = re.match(rf"^(.+)/{RANKS_DIR}/(\d{{5}})/*$", chain)
        if found is not None and is_sharded(open_store(found.group(1), None, None)):
            return found.group(1), int(found.group(2))
    except (OSError, LdformatError):
        pass
    return None


def _sharded_world_size(chain: str) -> int | None:
    """The world size of the sharded chain ``chain``; None for any other (or unreadable) path."""
    from ldformat.chain.reader import chain_name, open_store
    from ldformat.chain.sharded_probe import is_sharded
    from ldformat.sharded.chain import read_sharded_root

    try:
        store = open_store(chain, None, None)
        return read_sharded_root(store, chain_name(chain, None)).world_size if is_sharded(store) else None
    except (OSError, LdformatError):
        return None


def chain_info(reader: ChainReader) -> dict[str, Any]:
    full, full_error = _full_checkpoint_or_error(reader)  # first: it may re-read the log
    # Sizes read every segment: one consistent view, re-read if a compaction removes one meanwhile.
    return reader.retrying(lambda: _chain_info(reader, full, full_error))


def _chain_info(reader: ChainReader, full: dict[str, int] | None, full_error: str | None) -> dict[str, Any]:
    state = reader.state
    anchors = sorted(state.anchors.items())
    delta_bytes = sum(o.size for d in state.delta_entries() for o in d.objects)
    n_deltas = len(state.deltas)
    full_bytes = full["bytes"] if full is not None else None
    total = reader.bytes_on_disk()
    anchor_bytes = sum(a.object.size for _, a in anchors)
    steps = reader.steps
    return {
        "path": reader.path,
        "format_version": reader.root.format_version,
        "chain_id": reader.root.chain_id,
        "kind": reader.kind,
        "optimizer": reader.root.schema["optimizer"]["class"],
        "steps": len(steps),
        "first_step": steps[0] if steps else None,
        "latest_step": reader.latest_step,
        "anchors": [s for s, _ in anchors],
        "commits": len(reader.records),
        "bytes_on_disk": total,
        "anchor_bytes": anchor_bytes,
        "delta_bytes": delta_bytes,
        "log_bytes": total - anchor_bytes - delta_bytes,  # commit records and snapshot segments
        "delta_bytes_per_step": delta_bytes / n_deltas if n_deltas else None,
        "slot_encodings": dict(sorted(Counter(s.encoding for d in state.delta_entries() for s in d.slots).items())),
        "full_checkpoint_bytes": full_bytes,
        "full_checkpoint": {**(full or {}), "error": full_error},
        "compression_vs_full_checkpoints": (len(steps) * full_bytes / total) if total and full_bytes else None,
        "environment": reader.root.environment,
        "capture_policy": _capture_policy(reader),
    }


def sharded_info(reader: ldformat.ShardedReader) -> dict[str, Any]:
    """What ``ldtools info`` says of a sharded chain (spec section 20)."""
    from ldformat.format.jsonvalue import parse_dtype
    from ldformat.sharded.chain import commit_numbers

    full, full_error = _full_state_or_error(reader, sharded_full_state)  # first: it may re-read the logs
    steps = reader.steps
    root = reader.root
    laid_out = sum(parse_dtype(lay.dtype).itemsize * _numel(lay.shape) for lay in root.tensors.values())
    per_rank = [reader.ranks[r].bytes_on_disk() if r in reader.ranks else 0 for r in range(root.world_size)]
    total = sum(per_rank)
    full_bytes = full["bytes"] if full is not None else None
    return {
        "path": reader.path,
        "format_version": root.format_version,
        "chain_id": root.chain_id,
        "kind": reader.kind,
        "optimizer": reader.ranks[0].root.schema["optimizer"]["class"],
        "world_size": root.world_size,
        "mesh": {"shape": list(root.mesh_shape), "dim_names": None if root.dim_names is None else list(root.dim_names)},
        "sharded_tensors": len(root.tensors),
        "sharded_model_bytes": laid_out,
        "copies": {str(r): src for r, src in sorted(root.copies.items())},
        "steps": len(steps),
        "first_step": steps[0] if steps else None,
        "latest_step": reader.latest_step,
        "anchors": reader.anchors,
        "commits": len(commit_numbers(reader.store)),
        "pending_steps": sorted({s for r in reader.ranks.values() for s in r.steps} - set(steps)),
        "bytes_on_disk": total,
        "bytes_per_rank": per_rank,
        "full_checkpoint_bytes": full_bytes,
        "full_checkpoint": {**(full or {}), "error": full_error},
        "compression_vs_full_checkpoints": (len(steps) * full_bytes / total) if total and full_bytes else None,
    }


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


#: ``info`` lists the bytes of every rank up to this world size, else the smallest and largest.
RANKS_LISTED = 8


def _sharded_info(reader: ldformat.ShardedReader, as_json: bool, lag: dict[str, Any] | None) -> None:
    data = sharded_info(reader)
    if lag is not None:
        data["mirror"] = lag
    if as_json:
        _echo(json.dumps(data, indent=2))
        return
    mesh = data["mesh"]
    names = f" ({', '.join(mesh['dim_names'])})" if mesh["dim_names"] else ""
    _echo(f"chain        {data['path']}  (sharded, format {data['format_version']}, kind {data['kind']})")
    _echo(f"optimizer    {data['optimizer']}")
    _echo(f"ranks        {data['world_size']}, mesh {mesh['shape']}{names}; {data['sharded_tensors']} sharded "
          f"tensors ({human_bytes(data['sharded_model_bytes'])} of model state)")
    if data["steps"]:
        _echo(f"steps        {data['steps']} committed ({data['first_step']} .. {data['latest_step']}), "
              f"{plural(data['commits'], 'commit record')}")
    else:
        _echo(f"steps        none committed yet, {plural(data['commits'], 'commit record')}")
    anchors = data["anchors"]
    shown = ", ".join(map(str, anchors[:10])) + (" ..." if len(anchors) > 10 else "")
    _echo(f"anchors      {len(anchors)}  [{shown}]  (anchors in every rank's chain)")
    if data["pending_steps"]:
        pending = data["pending_steps"]
        _echo(f"pending      {plural(len(pending), 'step')} some ranks hold beyond the last commit "
              f"({pending[0]}..{pending[-1]}); the next writer removes them")
    per_rank = data["bytes_per_rank"]
    copies = {int(r): src for r, src in data["copies"].items()}
    if len(per_rank) <= RANKS_LISTED:
        ranks = ", ".join(f"rank {r}: copy of rank {copies[r]}" if r in copies else f"rank {r}: {human_bytes(n)}"
                          for r, n in enumerate(per_rank))
    else:
        own = [n for r, n in enumerate(per_rank) if r not in copies]
        ranks = f"per rank {human_bytes(min(own))} .. {human_bytes(max(own))}"
        if copies:
            ranks += f"; {plural(len(copies), 'copy rank')} write none"
    _echo(f"on disk      {human_bytes(data['bytes_on_disk'])}  ({ranks})")
    full = data["full_checkpoint"]
    if data["full_checkpoint_bytes"] is not None:
        _echo(f"full state   {human_bytes(full['bytes'])} at step {full['step']} (model "
              f"{human_bytes(full['model_bytes'])}, optimizer {human_bytes(full['optimizer_bytes'])}): "
              "the unsharded state that materialize writes")
    elif full["error"] is not None:
        _echo(f"full state   unknown: measuring step {data['latest_step']} from rank 0's chain failed "
              f"({full['error']}); run `ldtools validate` on the chain")
    ratio = data["compression_vs_full_checkpoints"]
    if ratio is not None and ratio >= 1:
        _echo(f"compression  {ratio:.1f}x smaller than a full checkpoint per step")
    elif ratio:
        _echo(f"compression  none yet: the chain takes {1 / ratio:.1f}x the bytes of a full checkpoint per step "
              f"({plural(data['steps'], 'step')} so far)")
    _echo(f"rank chains  {data['path']}/ranks/<rank>: `ldtools info` or `ldtools log` of one shows that rank's chain")
    _echo_mirror_lag(data)


def _sharded_log(reader: ldformat.ShardedReader, as_json: bool) -> None:
    from ldformat.sharded.chain import read_commits

    rows = [{"seq": c.seq, "time": c.time, "step": c.step, "writer": c.writer}
            for c in read_commits(reader.store, reader.path)]
    if as_json:
        _echo(json.dumps(rows, indent=2))
        return
    lines = [("SEQ", "TIME", "STEP", "WRITER")] + [(str(r["seq"]), str(r["time"]), str(r["step"]), str(r["writer"]))
                                                   for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(4)]
    for line in lines:
        cells = [cell.rjust(w) if i in (0, 2) else cell.ljust(w)  # numbers to the right
                 for i, (cell, w) in enumerate(zip(line, widths, strict=True))]
        _echo("  ".join(cells).rstrip())


def _capture_policy(reader: ChainReader) -> dict[str, Any] | None:
    """The anchor interval and batch size a Checkpointer chose, from the latest step's extra state."""
    latest = reader.latest_step
    if latest is None:
        return None
    entry = reader.state.deltas.get(latest)
    extra = entry[1].extra if entry is not None else reader.state.anchors[latest].extra
    from ldformat.format.jsonvalue import decode

    decoded = decode(extra)
    policy = decoded.get("policy") if isinstance(decoded, dict) else None
    return policy if isinstance(policy, dict) else None


def mirror_lag(reader: ChainReader, mirror: str) -> dict[str, Any]:
    """How far the replica at ``mirror`` (made by ``ldtools sync`` or ``Checkpointer(mirror=)``)
    lags behind ``reader``'s chain: committed steps and records it lacks, and the age of the
    oldest commit it lacks (by the record's time; 0 when it is up to date).

    Raises:
        ReplicaDivergedError: ``mirror`` holds another chain.
    """
    replica = ldformat.ChainReader(mirror)
    if replica.root.chain_id != reader.root.chain_id:
        raise ldformat.ReplicaDivergedError(
            f"{mirror}: holds another chain (chain_id {replica.root.chain_id}), not a replica of {reader.path} "
            f"(chain_id {reader.root.chain_id})")
    last_seq = replica.records[-1].seq if replica.records else 0
    missing = [(r.seq, r.time) for r in reader.records if r.seq > last_seq]
    ours = reader.records[-1].seq if reader.records else 0
    ahead = len([r for r in replica.records if r.seq > ours])
    return _lag(reader.steps, replica.path, replica.latest_step, missing, ahead)


def sharded_mirror_lag(reader: ldformat.ShardedReader, mirror: str) -> dict[str, Any]:
    """:func:`mirror_lag` of a sharded chain: committed steps and commit records the replica
    at ``mirror`` lacks (spec §20.12)."""
    from ldformat.sharded.chain import read_commits

    replica = ldformat.open_reader(mirror)
    if not isinstance(replica, ldformat.ShardedReader) or replica.root.chain_id != reader.root.chain_id:
        raise ldformat.ReplicaDivergedError(f"{mirror}: holds another chain, not a replica of the sharded chain "
                                            f"{reader.path} (chain_id {reader.root.chain_id})")
    last_seq = replica.commit.seq if replica.commit is not None else 0
    missing = [(c.seq, c.time) for c in read_commits(reader.store, reader.path) if c.seq > last_seq]
    ours = reader.commit.seq if reader.commit is not None else 0
    ahead = len([c for c in read_commits(replica.store, replica.path) if c.seq > ours])
    return _lag(reader.steps, replica.path, replica.latest_step, missing, ahead)


def _lag(steps: list[int], mirror: str, theirs: int | None, missing: list[tuple[int, str]],
         ahead: int) -> dict[str, Any]:
    """The lag of a replica at ``theirs`` that lacks the records ``missing`` (number, time) and
    holds ``ahead`` records the chain lacks."""
    age = None
    if missing:
        import datetime as dt

        oldest = dt.datetime.fromisoformat(missing[0][1].replace("Z", "+00:00"))
        age = max(0.0, (dt.datetime.now(dt.timezone.utc) - oldest).total_seconds())
    return {"mirror": mirror, "mirror_latest_step": theirs,
            "lag_steps": len([s for s in steps if theirs is None or s > theirs]),
            "lag_records": len(missing), "lag_seconds": 0.0 if age is None else round(age, 3),
            "ahead_records": ahead}


@cli.command()
@CHAIN
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--mirror", "mirror", default=None, metavar="URL",
              help="Also say how far this replica of the chain (ldtools sync, Checkpointer(mirror=)) lags behind it.")
@THREADS
@errors_to_exit_codes
def info(chain: str, as_json: bool, mirror: str | None, threads: int | None) -> None:
    """Summarize a chain: steps, anchors, kind, bytes on disk, compression.

    "full state" is the size of one full checkpoint of the latest step (model, tied weights
    once, and optimizer state, as an anchor of that step would hold them); a latest step that
    is not an anchor is replayed from its anchor to measure it, as materialize does.

    A sharded chain (spec section 20) is summarized as a whole (world size, mesh, committed
    steps, commit records, bytes per rank); its "full state" is the size of the unsharded
    model and optimizer tensors of the latest committed step (what materialize writes),
    measured from rank 0's chain and the layout without assembling them. `ldtools info
    PATH/ranks/00000` shows one rank's chain.

    With --mirror URL it also says how far that replica lags: the committed steps and commit
    records it lacks, and how old the oldest commit it lacks is; or that it is ahead of this
    chain, when it holds commits this chain does not.

    \b
    Example: ldtools info runs/chain --json
    Example: ldtools info runs/chain --mirror s3://bucket/runs/chain
    """
    reader = ldformat.open_reader(chain)
    if isinstance(reader, ldformat.ShardedReader):
        with replay_thread_count(threads):
            _sharded_info(reader, as_json, None if mirror is None else sharded_mirror_lag(reader, mirror))
        return
    with replay_thread_count(threads):
        data = chain_info(reader)
    if mirror is not None:
        data["mirror"] = mirror_lag(reader, mirror)
    if as_json:
        _echo(json.dumps(data, indent=2))
        return
    _echo(f"chain        {data['path']}  (format {data['format_version']}, kind {data['kind']})")
    parent = sharded_parent(chain)
    if parent is not None:
        _echo(f"part of      the sharded chain {parent[0]}, as rank {parent[1]}: this chain holds that rank's local "
              f"shards; `ldtools info {parent[0]}` summarizes the whole")
    _echo(f"optimizer    {data['optimizer']}")
    _echo(f"steps        {data['steps']}  ({data['first_step']} .. {data['latest_step']})")
    anchors = data["anchors"]
    shown = ", ".join(map(str, anchors[:10])) + (" ..." if len(anchors) > 10 else "")
    _echo(f"anchors      {len(anchors)}  [{shown}]")
    _echo(f"on disk      {human_bytes(data['bytes_on_disk'])}  (anchors {human_bytes(data['anchor_bytes'])}, "
          f"deltas {human_bytes(data['delta_bytes'])}, log and segments {human_bytes(data['log_bytes'])})")
    full = data["full_checkpoint"]
    if data["full_checkpoint_bytes"] is not None:
        _echo(f"full state   {human_bytes(full['bytes'])} at step {full['step']} (model "
              f"{human_bytes(full['model_bytes'])}, optimizer {human_bytes(full['optimizer_bytes'])}): "
              "the size of one full checkpoint")
    elif full["error"] is not None:
        _echo(f"full state   unknown: replaying to step {data['latest_step']} failed ({full['error']}); "
              "run `ldtools validate` on the chain")
    if data["delta_bytes_per_step"] is not None:
        _echo(f"per step     {human_bytes(data['delta_bytes_per_step'])} of deltas")
    if data["slot_encodings"]:
        counts = ", ".join(f"{enc} {n}" for enc, n in data["slot_encodings"].items())
        predicted = ""
        if "adam.v" in data["slot_encodings"] or "adam.w" in data["slot_encodings"]:
            predicted = " (adam.v/adam.w: Adam prediction, spec section 11.3.1)"
        _echo(f"encodings    {counts} slot(s) in the delta batches{predicted}")
    ratio = data["compression_vs_full_checkpoints"]
    if ratio is not None and ratio >= 1:
        _echo(f"compression  {ratio:.1f}x smaller than a full checkpoint per step")
    elif ratio:
        _echo(f"compression  none yet: the chain takes {1 / ratio:.1f}x the bytes of a full checkpoint per step "
              f"({plural(data['steps'], 'step')} so far)")
    policy = data["capture_policy"]
    if policy:
        line = f"policy       anchor_every={policy.get('anchor_every')} batch_steps={policy.get('batch_steps')}"
        inputs = policy.get("inputs")
        if inputs:
            line += (f" (step {inputs['step_time_s']:.3f}s, anchor write {inputs['anchor_write_s']:.3f}s, "
                     f"replay {inputs['replay_step_s']:.4f}s/step, commit {inputs['commit_s']:.4f}s, "
                     f"MTBF {inputs['mtbf_s'] / 3600:.1f}h)")
        _echo(line)
        _echo_cadence(policy)
        bounds = []
        if isinstance(policy.get("max_lost_s"), (int, float)):
            bounds.append(f"at most {policy['max_lost_s']:g} s of training lost in a crash (max_lost_s)")
        if isinstance(policy.get("max_bytes"), int):
            bounds.append(f"disk budget {human_bytes(policy['max_bytes'])} (max_bytes)")
        if bounds:
            _echo(f"bounds       {'; '.join(bounds)}")
    env: dict[str, Any] = data["environment"]
    _echo(f"recorded on  torch {env.get('torch')}, {env.get('device')}, cpu {env.get('cpu_capability')}, "
          f"optimizer path {','.join(env.get('implementation', []))}")
    _echo_mirror_lag(data)


def _echo_cadence(policy: dict[str, Any]) -> None:
    """The capture interval of the latest step (docs/capture-runtime.md "Bounded cost")."""
    every, budget = policy.get("capture_every"), policy.get("max_overhead")
    if not isinstance(every, int) or not isinstance(budget, (int, float)):
        return
    line = f"capture      every {plural(every, 'step')}"
    step_s, batch = policy.get("step_time_s"), policy.get("batch_steps")
    if isinstance(step_s, (int, float)):
        line += f" ({every * step_s:.3g} s of training)"
        if isinstance(batch, int):
            line += f", committed every {batch * every * step_s:.3g} s"
    measured = policy.get("measured_overhead")
    line += f"; overhead budget {100 * budget:g} %"
    if isinstance(measured, (int, float)):
        line += f", measured {100 * measured:.1f} %"
    _echo(line)


def _echo_mirror_lag(data: dict[str, Any]) -> None:
    lag = data.get("mirror")
    if lag is None:
        return
    behind, ahead = lag["lag_records"], lag["ahead_records"]
    where = f"the mirror at step {lag['mirror_latest_step']}, this chain at step {data['latest_step']}"
    if not behind and not ahead:
        _echo(f"mirror       {lag['mirror']}: up to date (step {lag['mirror_latest_step']})")
    elif not behind:
        _echo(f"mirror       {lag['mirror']}: ahead of this chain: it holds {plural(ahead, 'commit record')} this "
              f"chain lacks ({where}); `ldtools sync {lag['mirror']} {data['path']}` brings this chain up to it")
    elif ahead:
        _echo(f"mirror       {lag['mirror']}: diverged: it holds {plural(ahead, 'commit record')} this chain lacks, "
              f"and lacks {behind} of this chain's ({where})")
    else:
        _echo(f"mirror       {lag['mirror']}: {plural(lag['lag_steps'], 'step')} and {plural(behind, 'commit record')} "
              f"behind (at step {lag['mirror_latest_step']}; the oldest commit it lacks is "
              f"{lag['lag_seconds']:.1f} s old); `ldtools sync {data['path']} {lag['mirror']}` catches it up")


@cli.command()
@CHAIN
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--rank", type=click.IntRange(min=0), default=None,
              help="With a sharded chain: list the commit records of this rank's own chain instead.")
@errors_to_exit_codes
def log(chain: str, as_json: bool, rank: int | None) -> None:
    """List the commit records in effect, oldest first.

    The table has a header row (SEQ TIME TYPE DELTAS ANCHORS BYTES REASON); --json prints
    the records alone.

    For a sharded chain, the global commit records (SEQ TIME STEP WRITER): a step is
    committed once a record names it (or a later step) and every rank's chain holds it.
    --rank R lists rank R's own chain instead (the same as `ldtools log PATH/ranks/<R>`).

    \b
    Example: ldtools log runs/chain
    """
    opened = ldformat.open_reader(chain)
    if isinstance(opened, ldformat.ShardedReader):
        if rank is None:
            _sharded_log(opened, as_json)
            return
        if rank >= opened.world_size:
            raise UsageError(f"{opened.path}: --rank {rank}: the sharded chain has ranks 0..{opened.world_size - 1}")
        if rank in opened.root.copies:
            raise UsageError(f"{opened.path}: --rank {rank}: rank {rank} is a copy of rank "
                             f"{opened.root.copies[rank]} and has no chain of its own; pass --rank "
                             f"{opened.root.copies[rank]}")
        _chain_log(opened.ranks[rank], as_json)
    elif rank is not None:
        parent = sharded_parent(chain)
        if parent is not None:
            raise UsageError(f"{opened.path}: --rank applies to a sharded chain; this is rank {parent[1]}'s chain of "
                             f"{parent[0]} (leave out --rank, or pass {parent[0]})")
        raise UsageError(f"{opened.path}: --rank applies to a sharded chain; this is an ordinary chain "
                         "(leave out --rank)")
    else:
        _chain_log(opened, as_json)


def _chain_log(reader: ChainReader, as_json: bool) -> None:
    from ldformat.format.manifest import expand, range_count

    rows: list[dict[str, Any]] = []
    for r in reader.records:
        # A snapshot's segments list their steps (spec §7.9); their entries are not read here,
        # so its bytes are those of its segment objects and inline entries.
        steps = sorted([s.step for d in r.deltas for s in d.steps]
                       + [step for g in r.segments if g.delta_steps for step in (g.delta_steps[0][0],
                                                                                 g.delta_steps[-1][1])])
        anchors = sorted([a.step for a in r.anchors] + [s for g in r.segments for s in expand(g.anchor_steps)])
        rows.append({
            "seq": r.seq,
            "type": r.type,
            "reason": r.reason,
            "time": r.time,
            "anchors": anchors,
            "delta_steps": [steps[0], steps[-1]] if steps else None,
            # Fewer than the span when the capture runtime captured every k-th step.
            "delta_count": sum(len(d.steps) for d in r.deltas) + sum(range_count(g.delta_steps) for g in r.segments),
            "segments": len(r.segments),
            "bytes": sum(a.object.size for a in r.anchors) + sum(o.size for d in r.deltas for o in d.objects)
            + sum(g.object.size for g in r.segments),
        })
    if as_json:
        _echo(json.dumps(rows, indent=2))
        return
    lines = [("SEQ", "TIME", "TYPE", "DELTAS", "ANCHORS", "BYTES", "REASON")]
    for row in rows:
        ds = row["delta_steps"]
        span = f"deltas {ds[0]}-{ds[1]}" if ds else "no deltas"
        if ds and row["delta_count"] != ds[1] - ds[0] + 1:
            span += f" ({row['delta_count']} steps)"
        lines.append((str(row["seq"]), row["time"], row["type"], span,
                      f"anchors {row['anchors']}" if row["anchors"] else "no anchors", human_bytes(row["bytes"]),
                      row["reason"]))
    # The first columns are as wide as their longest value; the reason, last, is free text.
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]) - 1)]
    for line in lines:
        cells = [cell.rjust(w) if i in (0, 5) else cell.ljust(w)  # numbers to the right
                 for i, (cell, w) in enumerate(zip(line[:-1], widths, strict=True))]
        _echo("  ".join([*cells, line[-1]]).rstrip())


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _write_cause(e: BaseException) -> OSError | None:
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


def _remove(tmp: str | None) -> bool:
    """Remove a temporary file; False if it is still there."""
    if tmp is None:
        return True
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def _output_failure(out: Path, what: str, cause: OSError, existed: bool,
                    tmp_left: str | None = None) -> OutputWriteError:
    kept = "the existing file is unchanged" if existed else "no file was written"
    message = f"{out}: cannot write {what}: {_errno_text(cause)}; {kept}"
    if tmp_left is not None:
        message += f"; remove the temporary file {tmp_left}"
    err = OutputWriteError(message)
    err.errno = cause.errno
    return err


def check_output(out: Path, what: str) -> None:
    """Fail early (before a long replay) when ``out`` can obviously not be written."""
    existed = os.path.lexists(out)
    if out.is_dir():
        raise _output_failure(out, what, OSError(errno.EISDIR, os.strerror(errno.EISDIR)), existed)
    ancestor = out.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise _output_failure(out, what, OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)), existed)
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise _output_failure(out, what, OSError(errno.EACCES, os.strerror(errno.EACCES)), existed)


def write_output(out: Path, what: str, write: Callable[[IO[bytes], str], None]) -> int:
    """Write an output file atomically and return its size in bytes.

    ``write(f, tmp)`` writes the content into ``f``, a temporary file opened next to ``out``
    (or into its path ``tmp``). The file is synced and renamed onto ``out``; on any failure
    the temporary file is removed and ``out`` is left as it was. An OS error (disk full, I/O
    error, permission), also one a serializer wraps, raises :class:`OutputWriteError` naming
    ``out``, ``what`` and the cause. The file gets the mode ``open()`` would give it (umask).
    """
    existed = os.path.lexists(out)
    tmp: str | None = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            write(f, tmp)
        # After writing: a serializer may have replaced the file at ``tmp`` (safetensors does).
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the mode open() would
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
            size = os.fstat(f.fileno()).st_size
        os.replace(tmp, out)
        tmp = None
    except Exception as e:
        cause = _write_cause(e)
        removed = _remove(tmp)
        if cause is None:
            raise  # not an I/O failure: a bug, reported as an internal error
        raise _output_failure(out, what, cause, existed, None if removed else tmp) from e
    except BaseException:
        _remove(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename durable; not every file system can sync a directory
        dir_fd = os.open(out.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return size


def _tie_key(name: str, t: Any) -> tuple[Any, ...]:
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
    that share memory are copied (safetensors refuses shared memory).
    """

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
        from ldformat.format.jsonvalue import encode
        from ldformat.format.optstate import REF_PREFIX, split_state

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


PROGRESS = click.option(
    "--progress/--no-progress", "show_progress", default=None,
    help=f"Draw a progress bar on stderr (default: only when stderr is a terminal; {PROGRESS_ENV}=1 "
         "or 0 changes the default). Standard output never gets one.")


def _progress_bar(show_progress: bool | None, labels: dict[str, str], byte_stages: tuple[str, ...] = ()) -> ProgressBar:
    return ProgressBar(labels, enabled=progress_wanted(show_progress, sys.stderr), byte_stages=byte_stages)


@cli.command()
@CHAIN
@click.option("--step", type=int, default=None, help="Step to materialize (default: the latest committed step).")
@click.option("-o", "--output", "out", required=True, type=click.Path(path_type=Path),
              help="Output: a .pt file (torch.save of the whole state), a .safetensors file (model state_dict), "
                   "or with --format dcp a torch.distributed.checkpoint directory.")
@click.option("--format", "fmt", type=click.Choice(["auto", "pt", "safetensors", "dcp"]), default="auto",
              show_default=True, help="Output format; auto takes it from the suffix of -o (.pt, .pth, .safetensors).")
@click.option("--with-optimizer", is_flag=True, help="With .safetensors: add the flattened optimizer state.")
@click.option("--replay-device", default=None, metavar="DEVICE",
              help="Replay gradient deltas on this torch device (e.g. cuda) instead of the CPU: bit-exact for a "
                   "chain recorded on that device type (see `ldtools info`). The output holds CPU tensors.")
@click.option("--force", is_flag=True, help="Replace an existing output file (or a non-empty dcp directory).")
@THREADS
@PROGRESS
@errors_to_exit_codes
def materialize(chain: str, step: int | None, out: Path, fmt: str, with_optimizer: bool,
                replay_device: str | None, force: bool, threads: int | None, show_progress: bool | None) -> None:
    """Write the state of one step as a plain checkpoint.

    A .pt file holds {"model", "optimizer", "step", "extra"} and loads with
    torch.load(path, weights_only=True); "model" is a state_dict with every key, tied
    weights included. A .safetensors file holds the model as safetensors.torch.save_model
    writes it (tied weights once) and loads with safetensors.torch.load_model(model, path).
    The write is atomic; the file gets the mode the umask gives (0666 & ~umask).
    --format dcp writes a torch.distributed.checkpoint directory {"model", "optimizer"}
    (optimizer state keyed by parameter name, as get_optimizer_state_dict lays it out),
    which dcp.load reads on any world size and mesh.

    A sharded chain (written by every rank of an FSDP2 or tensor-parallel job) gives the
    full unsharded state: model keys are the FQNs of the unwrapped model, and a .pt file also
    holds every rank's "rank_extra".

    An existing output is refused (exit 2) unless --force is given; missing parent folders
    of -o are created.

    \b
    Example: ldtools materialize runs/chain --step 120 -o step120.pt
    """
    import safetensors.torch
    import torch

    suffix = out.suffix.lower()
    if fmt == "auto":
        if suffix not in (".pt", ".pth", ".safetensors"):
            raise UsageError(f"{out}: output must end in .pt, .pth or .safetensors, or pass --format")
        fmt = "safetensors" if suffix == ".safetensors" else "pt"
    if with_optimizer and fmt != "safetensors":
        raise UsageError("--with-optimizer applies to .safetensors output (.pt and dcp always hold the optimizer)")
    reader = ldformat.open_reader(chain, replay_device=_replay_device(replay_device))
    target = step if step is not None else reader.latest_step
    if isinstance(reader, ldformat.ShardedReader):
        label = f"reading {reader.world_size} rank chains at step {target}"
    else:
        label = f"replaying to step {target}"
        parent = sharded_parent(chain)
        if parent is not None:
            _say(f"ldtools: note: {chain} is rank {parent[1]}'s chain of the sharded chain {parent[0]}: the output "
                 f"holds that rank's local shards only; materialize {parent[0]} for the full state")
    if fmt == "dcp":
        refuse_existing_output(out, force, directory=True)
        with (replay_thread_count(threads), _progress_bar(show_progress, {"": label}) as bar,
              _about_step(target, "materializing")):
            written = _export_dcp(reader, step, out, bar, force)
        _echo(f"wrote step {written} to {out}/ (torch.distributed.checkpoint)")
        return
    what = f"step {target}" if target is not None else "the output"
    check_output(out, what)
    refuse_existing_output(out, force, directory=False)
    with (replay_thread_count(threads), _progress_bar(show_progress, {"": label}) as bar,
          _about_step(target, "materializing")):
        state = reader.materialize(step, progress=bar)
    if fmt == "safetensors":
        tensors, metadata = flatten_for_safetensors(state, with_optimizer)
        size = write_output(out, what, lambda f, tmp: safetensors.torch.save_file(tensors, tmp, metadata=metadata))
    else:
        size = write_output(out, what, lambda f, tmp: torch.save(state, f))
    _echo(f"wrote step {state['step']} to {out} ({human_bytes(size)})")


def refuse_existing_output(out: Path, force: bool, *, directory: bool) -> None:
    """Refuse (exit 2) to replace an existing output without ``--force``, before any replay.

    A file is in the way of a file output if it exists at all; a dcp output (a directory) is
    in the way unless it is an empty directory (which is written into).
    """
    if force or not os.path.lexists(out):
        return
    if directory and out.is_dir() and not any(out.iterdir()):
        return
    what = "exists and is not an empty directory" if directory and out.is_dir() else "exists"
    raise UsageError(f"{out}: {what}; pass --force to replace it, or choose another -o; nothing was written")


def _export_dcp(reader: ChainReader | ShardedReader, step: int | None, out: Path, bar: ProgressBar,
                force: bool) -> int:
    """Write a dcp directory at ``out``; with ``force``, one already there is replaced once the
    new one is complete (written beside it, then swapped in)."""
    import shutil

    from ldformat.export.dcp import export_dcp

    if not (force and os.path.lexists(out) and (not out.is_dir() or any(out.iterdir()))):
        return export_dcp(reader, step, out, progress=bar)
    fresh = Path(tempfile.mkdtemp(prefix=f".{out.name}.new-", dir=out.parent)) / out.name
    try:
        written = export_dcp(reader, step, fresh, progress=bar)
        old = out.parent / f"{fresh.parent.name}-old"
        try:
            os.replace(out, old)
            try:
                os.replace(fresh, out)
            except OSError:
                os.replace(old, out)  # put the old one back
                raise
        except OSError as e:
            raise _output_failure(out, f"step {written}", e, True) from e
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    finally:
        shutil.rmtree(fresh.parent, ignore_errors=True)
    return written


def _replay_device(name: str | None) -> torch.device | None:
    """The ``--replay-device`` as a torch device, refused (usage error) if torch cannot use it here."""
    if name is None:
        return None
    import torch

    try:
        device = torch.device(name)
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as e:  # torch raises AssertionError for a build without CUDA
        raise UsageError(f"--replay-device {name}: torch cannot use this device here ({e}); leave the option out "
                         "to replay on the CPU") from None
    return device


@cli.command()
@CHAIN
@click.option("--deep", is_flag=True, help="Also replay between anchors and compare bits with the stored anchors.")
@click.option("--strict", is_flag=True,
              help="Implies --deep, and fails (exit 1, the code of an invalid chain) when the deep check compared "
                   "no anchor with a replay: with one anchor, or none reached by replay from another, --deep "
                   "checks nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@THREADS
@PROGRESS
@errors_to_exit_codes
def validate(chain: str, deep: bool, strict: bool, as_json: bool, threads: int | None,
             show_progress: bool | None) -> None:
    """Check every record and object of a chain. Exit 0 if valid, 1 if not.

    --deep also replays the deltas from each anchor to the next one and compares the result
    with that stored anchor, bit for bit; it says how many anchors it compared
    ("anchors_compared" in --json). --strict fails when that number is 0.

    \b
    Example: ldtools validate runs/chain --deep
    """
    deep = deep or strict
    labels = {"objects": "checking objects", "replay": "replaying to anchors",
              "replicas": "comparing the ranks' copies"}
    with replay_thread_count(threads), _progress_bar(show_progress, labels) as bar:
        report = ldformat.chain.validate(chain, deep=deep, progress=bar)
    world = _sharded_world_size(chain)
    compared = len(report.drift) if deep else None
    if strict and report.ok and not compared:
        report.problems.append(ldformat.Problem(report.path, None, (
            f"--strict: the deep check compared no anchor with a replay ({plural(len(report.anchors), 'anchor')}, none "
            "reached by replaying deltas from another), so nothing showed that replay reproduces the stored "
            "state; validate again once the writer has stored a later anchor, or leave out --strict")))
    if as_json:
        _echo(json.dumps({**report.to_dict(), "anchors_compared": compared, "strict": strict}, indent=2))
    else:
        for p in report.problems:
            _echo(str(p))
        if report.ok:
            if compared is None:
                drift = ""
            elif compared:
                drift = f", replay at {plural(compared, 'anchor')} bit-exact"
                if world is not None:
                    drift = f", replay bit-exact at {plural(compared, 'rank-chain anchor')}"
            else:
                drift = ("; --deep compared no anchor with a replay (none is reached by replay from another), "
                         "so replay was not checked (--strict makes this an error)")
            if world is None:
                _echo(f"ok: {plural(report.steps, 'step')}, {plural(len(report.anchors), 'anchor')}{drift}")
            else:
                where = (plural(report.steps, "committed step") if deep
                         else plural(len(report.anchors), "anchor"))
                _echo(f"ok: sharded chain of {plural(world, 'rank')}, {plural(report.steps, 'committed step')}, "
                      f"{plural(len(report.anchors), 'anchor')}, the ranks' copies agree at {where}{drift}")
        else:
            _say(f"invalid: {plural(len(report.problems), 'problem')}")
    if not report.ok:
        sys.exit(EXIT_PROBLEM)


@cli.command()
@CHAIN
@click.option("--max-replay", type=click.IntRange(min=0), default=None, metavar="K",
              help="No step may need more than K deltas replayed; longer runs get new anchors.")
@click.option("--keep-last", type=click.IntRange(min=1), default=None, metavar="N",
              help="Keep the newest N steps; remove older ones (asks first, see --yes).")
@click.option("--keep-every", type=click.IntRange(min=1), default=None, metavar="M",
              help="With retention, also keep every M-th step.")
@click.option("--dry-run", is_flag=True,
              help="Print what the real run would do (the same counts and objects) without changing anything.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--yes", is_flag=True, help=YES_HELP)
@click.option("--break-lock", is_flag=True, help=BREAK_LOCK_HELP)
@THREADS
@PROGRESS
@errors_to_exit_codes
def compact(chain: str, max_replay: int | None, keep_last: int | None, keep_every: int | None,
            dry_run: bool, as_json: bool, yes: bool, break_lock: bool, threads: int | None,
            show_progress: bool | None) -> None:
    """Fold delta runs into anchors, apply retention and remove garbage.

    Crash-safe and idempotent; every step that stays materializes bit-identically. A sharded
    chain is compacted under every rank chain's lock with one plan, so that every rank chain
    keeps the same steps (spec section 20.8); one rank's chain on its own is refused (exit 2).

    Without --keep-last and --keep-every every step stays, and compact does not ask. When
    they remove committed steps, it asks on a terminal (saying which), and without a
    terminal it needs --yes (else it changes nothing and exits 2). --dry-run never asks.

    \b
    Example: ldtools compact runs/chain --max-replay 50
    Example: ldtools compact runs/chain --keep-last 200 --keep-every 1000 --yes
    """
    retention = keep_last is not None or keep_every is not None
    if not dry_run:
        refuse_break_lock_without_consent(chain, break_lock, yes)
    if retention and not dry_run and not yes:
        confirm_compaction(chain, max_replay, keep_last, keep_every)

    def run(break_it: bool) -> ldformat.CompactionPlan:
        with replay_thread_count(threads), _progress_bar(show_progress, {"anchors": "writing anchors"}) as bar:
            return ldformat.chain.maintenance(chain, max_replay=max_replay, keep_last=keep_last, keep_every=keep_every,
                                    dry_run=dry_run, break_lock=break_it, progress=bar)

    plan = run(False) if dry_run else with_lock(chain, run, break_lock=break_lock, yes=yes)
    if as_json:
        _echo(json.dumps(plan.to_dict(), indent=2))
        return
    _echo(compaction_summary(plan, dry_run))
    verb = "would" if dry_run else "did"
    if plan.aborted_uploads:
        _echo(f"{verb} abort {plural(len(plan.aborted_uploads), 'incomplete multipart upload')} that killed "
              "writers left")
    if plan.uploads_problem:
        _say(f"ldtools: warning: incomplete multipart uploads were not cleaned up: {plan.uploads_problem}")


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``1 step``, ``2 steps`` (``nouns``: an irregular plural)."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"


def step_span(steps: list[int]) -> str:
    """``6..12`` (``6`` for one step)."""
    return f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}..{steps[-1]}"


def compaction_summary(plan: ldformat.CompactionPlan, dry_run: bool) -> str:
    """The one line ``compact`` prints (``would`` for a dry run, ``did`` for the real one)."""
    verb = "would" if dry_run else "did"
    shown = f" {plan.new_anchors[:10]}" if plan.new_anchors else ""
    return (f"{verb} keep {plural(len(plan.kept_steps), 'step')}, drop {len(plan.dropped_steps)}, "
            f"write {plural(len(plan.new_anchors), 'new anchor')}{shown}, "
            f"merge {plural(len(plan.merged_deltas), 'xor run')}, drop {plural(len(plan.dropped_anchors), 'anchor')}, "
            f"remove {plural(len(plan.removed_objects), 'object')}")


def confirm_compaction(chain: str, max_replay: int | None, keep_last: int | None, keep_every: int | None) -> None:
    """Ask before a compaction whose retention removes committed steps, or refuse without a
    terminal (:mod:`ldtools.consent`). A dry run of the same compaction says which steps it
    removes; none: nothing to ask."""
    plan = ldformat.chain.maintenance(chain, max_replay=max_replay, keep_last=keep_last, keep_every=keep_every, dry_run=True)
    if plan.dropped_steps:
        steps = f"{plural(len(plan.dropped_steps), 'step')} ({step_span(plan.dropped_steps)})"
        confirm(f"remove {steps} of {chain}?", yes=False, refusal=f"{chain}: compact would remove {steps}")


@cli.command()
@CHAIN
@click.option("--after", type=int, required=True, help="Keep steps up to and including this one.")
@click.option("--yes", is_flag=True, help=YES_HELP)
@click.option("--break-lock", is_flag=True, help=BREAK_LOCK_HELP)
@errors_to_exit_codes
def truncate(chain: str, after: int, yes: bool, break_lock: bool) -> None:
    """Remove every step after --after (rewind after a loss spike). Crash-safe.

    It asks before removing steps when stdin is a terminal; --yes skips the question, and
    without a terminal --yes is required (else nothing changes and it exits 2).

    A sharded chain is truncated in every rank's chain, under every rank chain's lock (spec
    section 20.8); one rank's chain of it on its own is refused (exit 2).

    \b
    Example: ldtools truncate runs/chain --after 1200 --yes
    """
    from ldformat.chain.sharded_probe import refuse_sharded

    refuse_break_lock_without_consent(chain, break_lock, yes)
    reader = ldformat.open_reader(chain)
    if isinstance(reader, ldformat.ChainReader):
        refuse_sharded(chain, None, None, "truncated")
    later = [s for s in reader.steps if s > after]
    if after not in reader.steps:
        raise ldformat.StepNotFoundError(f"{chain}: step {after} is not in the chain (as a committed step); "
                                         "nothing was changed")
    if later:
        confirm(f"remove {plural(len(later), 'step')} ({step_span(later)})?", yes=yes,
                refusal=f"{chain}: truncate --after {after} would remove {plural(len(later), 'step')} "
                        f"({step_span(later)})")

    def run(break_it: bool) -> list[int]:
        with _about_step(after, "truncating after"):
            return ldformat.truncate(chain, after, break_lock=break_it)

    removed = with_lock(chain, run, break_lock=break_lock, yes=yes)
    _echo(f"removed {plural(len(removed), 'step')}; the chain now ends at step {after}")


@cli.command()
@click.argument("src", type=click.Path(path_type=str))
@click.argument("dst", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--break-lock", is_flag=True, help=BREAK_LOCK_HELP.replace("the writer lock", "DST's writer lock"))
@click.option("--yes", is_flag=True, help="With --break-lock: do not ask (required when stdin is not a terminal).")
@PROGRESS
@errors_to_exit_codes
def sync(src: str, dst: str, as_json: bool, break_lock: bool, yes: bool, show_progress: bool | None) -> None:
    """Replicate the chain SRC to DST, copying only what DST lacks (spec sections 17.5, 20.12).

    SRC is only read (a writer may append to it, a compaction rewrite it, meanwhile); DST is
    locked while it is written and is a valid chain at every moment. An interrupted sync
    continues where it stopped when run again. A DST that is not a replica of SRC is refused
    (exit 1): delete it, or sync to a new location.

    DST follows SRC: steps that SRC no longer has (truncated, or removed by compact's
    retention) go from DST too. To keep a copy that does not follow, sync to a new DST.

    A sharded chain is replicated whole: sharded.json, every rank chain and the commit
    records, each record once every rank chain of DST holds its step. A sharded chain is
    not synced into an ordinary one nor the reverse, nor anything into one rank chain of a
    sharded chain (exit 2); one rank's chain may be copied out, as any chain.

    \b
    Example: ldtools sync runs/chain /mnt/backup/chain
    """
    from ldformat.chain.reader import open_store

    open_store(src, None)  # a missing local SRC: the same error as every command's CHAIN
    refuse_break_lock_without_consent(dst, break_lock, yes)

    def run(break_it: bool) -> ldformat.SyncReport:
        with _progress_bar(show_progress, {"bytes": "copying"}, byte_stages=("bytes",)) as bar:
            return ldformat.sync(src, dst, progress=bar, break_lock=break_it)

    report = with_lock(dst, run, break_lock=break_lock, yes=yes)
    if as_json:
        _echo(json.dumps(report.to_dict(), indent=2))
        return
    steps_behind = "" if report.lag_steps is None else f" ({plural(report.lag_steps, 'step')})"
    lag = "up to date" if report.up_to_date else (
        f"{plural(report.src_last_seq - report.dst_last_seq, 'record')}{steps_behind} behind")
    deferred = "; garbage kept until a record is copied (the lock was taken over)" if report.garbage_deferred else ""
    records = (f"{plural(report.records_copied, 'commit record')} and {plural(report.rank_records_copied, 'record')} "
               f"of {plural(report.world_size or 0, 'rank chain')}" if report.sharded
               else plural(report.records_copied, "record"))
    _echo(f"synced {records}, {plural(report.objects_copied, 'object')} "
          f"({human_bytes(report.bytes_copied)}) copied, {report.objects_skipped} already there, "
          f"{report.garbage_removed} removed; {report.dst} at step "
          f"{report.dst_latest_step}, {lag} ({report.src} at step {report.src_latest_step}); "
          f"{report.seconds:.1f} s{deferred}")


from . import history  # noqa: E402, F401  (registers stats, diff and plot on cli)


def main() -> None:
    cli(prog_name="ldtools")


if __name__ == "__main__":
    main()
