"""``ldtools``: a thin click layer over ldformat's public API (the library computes, this displays).

Exit codes (spec section 18.1): 0 success; 1 a problem with the chain (invalid, corrupt, missing
object, unsupported version, step not committed, I/O error on the chain); 2 a usage error or a
path that is not a chain; 3 an output file or standard output could not be written; 4 the chain
is locked by another writer; 70 an internal error (a bug); 130 interrupted or not confirmed; 141
standard output closed (broken pipe). The printing and the exit codes are :mod:`.terminal`'s;
``stats``, ``diff`` and ``plot`` are :mod:`.history`'s.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

import ldformat  # light: its public names are imported on first use (torch and zarr with them)
from ldformat import (
    ChainInfo,
    UsageError,
    chain_info,
    check_chain_location,
    check_output,
    commit_log,
    save_step,
    sharded_parent,
    sharded_world_size,
)

from . import history
from .consent import (
    BREAK_LOCK_HELP,
    YES_HELP,
    confirm,
    refuse_break_lock_without_consent,
    with_lock,
)
from .progress import human_bytes
from .terminal import (
    CHAIN,
    DEBUG_ENV,
    EXIT_BROKEN_PIPE,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_LOCKED,
    EXIT_OK,
    EXIT_OUTPUT,
    EXIT_PROBLEM,
    EXIT_USAGE,
    PROGRESS,
    LdtoolsGroup,
    Session,
    about_step,
    classify,
    echo,
    errors_to_exit_codes,
    exit_for,
    plural,
    printable,
    progress_bar,
    refuse_existing_output,
    say,
    step_span,
)
from .threads import THREADS, replay_thread_count

if TYPE_CHECKING:
    import torch

    from ldformat import OrdinaryInfo, ShardedInfo

__all__ = [  # what tests and scripts import from here, besides the commands
    "EXIT_BROKEN_PIPE", "EXIT_INTERNAL", "EXIT_INTERRUPTED", "EXIT_LOCKED", "EXIT_OK", "EXIT_OUTPUT", "EXIT_PROBLEM",
    "EXIT_USAGE", "chain_info", "classify", "cli", "exit_for", "main", "plural", "printable", "step_span",
]


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
    Session.debug = Session.debug or debug


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
    with replay_thread_count(threads):
        # One argument without --mirror: the tests stand in for chain_info with a function of the reader alone.
        summary = chain_info(reader) if mirror is None else chain_info(reader, mirror=mirror)
    if as_json:
        echo(json.dumps(summary.to_dict(), indent=2))
    elif summary.sharded is not None:
        _echo_sharded_info(summary, summary.sharded)
    elif summary.ordinary is not None:
        _echo_info(chain, summary, summary.ordinary)


def _echo_info(chain: str, info: ChainInfo, parts: OrdinaryInfo) -> None:
    echo(f"chain        {info.path}  (format {info.format_version}, kind {info.kind})")
    parent = sharded_parent(chain)
    if parent is not None:
        echo(f"part of      the sharded chain {parent[0]}, as rank {parent[1]}: this chain holds that rank's local "
             f"shards; `ldtools info {parent[0]}` summarizes the whole")
    echo(f"optimizer    {info.optimizer}")
    echo(f"steps        {info.steps}  ({info.first_step} .. {info.latest_step})")
    _echo_anchors(info.anchors, "")
    echo(f"on disk      {human_bytes(info.bytes_on_disk)}  (anchors {human_bytes(parts.anchor_bytes)}, "
         f"deltas {human_bytes(parts.delta_bytes)}, log and segments {human_bytes(parts.log_bytes)})")
    full = info.full_checkpoint
    if full.bytes is not None:
        echo(f"full state   {human_bytes(full.bytes)} at step {full.step} (model "
             f"{human_bytes(full.model_bytes or 0)}, optimizer {human_bytes(full.optimizer_bytes or 0)}): "
             "the size of one full checkpoint")
    elif full.error is not None:
        echo(f"full state   unknown: replaying to step {info.latest_step} failed ({full.error}); "
             "run `ldtools validate` on the chain")
    if parts.delta_bytes_per_step is not None:
        echo(f"per step     {human_bytes(parts.delta_bytes_per_step)} of deltas")
    if parts.slot_encodings:
        counts = ", ".join(f"{enc} {n}" for enc, n in parts.slot_encodings.items())
        predicted = ""
        if "adam.v" in parts.slot_encodings or "adam.w" in parts.slot_encodings:
            predicted = " (adam.v/adam.w: Adam prediction, spec section 11.3.1)"
        echo(f"encodings    {counts} slot(s) in the delta batches{predicted}")
    _echo_compression(info)
    policy = parts.capture_policy
    if policy:
        line = f"policy       anchor_every={policy.get('anchor_every')} batch_steps={policy.get('batch_steps')}"
        inputs = policy.get("inputs")
        if inputs:
            line += (f" (step {inputs['step_time_s']:.3f}s, anchor write {inputs['anchor_write_s']:.3f}s, "
                     f"replay {inputs['replay_step_s']:.4f}s/step, commit {inputs['commit_s']:.4f}s, "
                     f"MTBF {inputs['mtbf_s'] / 3600:.1f}h)")
        echo(line)
        _echo_cadence(policy)
        bounds = []
        if isinstance(policy.get("max_lost_s"), (int, float)):
            bounds.append(f"at most {policy['max_lost_s']:g} s of training lost in a crash (max_lost_s)")
        if isinstance(policy.get("max_bytes"), int):
            bounds.append(f"disk budget {human_bytes(policy['max_bytes'])} (max_bytes)")
        if bounds:
            echo(f"bounds       {'; '.join(bounds)}")
    env = parts.environment
    echo(f"recorded on  torch {env.get('torch')}, {env.get('device')}, cpu {env.get('cpu_capability')}, "
         f"optimizer path {','.join(env.get('implementation', []))}")
    _echo_mirror_lag(info)


def _echo_anchors(anchors: tuple[int, ...], note: str) -> None:
    shown = ", ".join(map(str, anchors[:10])) + (" ..." if len(anchors) > 10 else "")
    echo(f"anchors      {len(anchors)}  [{shown}]{note}")


def _echo_compression(info: ChainInfo) -> None:
    ratio = info.compression_vs_full_checkpoints
    if ratio is not None and ratio >= 1:
        echo(f"compression  {ratio:.1f}x smaller than a full checkpoint per step")
    elif ratio:
        echo(f"compression  none yet: the chain takes {1 / ratio:.1f}x the bytes of a full checkpoint per step "
             f"({plural(info.steps, 'step')} so far)")


def _echo_cadence(policy: Mapping[str, Any]) -> None:
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
    echo(line)


def _echo_mirror_lag(info: ChainInfo) -> None:
    lag = info.mirror
    if lag is None:
        return
    behind, ahead, mirror = lag.lag_records, lag.ahead_records, lag.mirror
    where = f"the mirror at step {lag.mirror_latest_step}, this chain at step {info.latest_step}"
    if not behind and not ahead:
        echo(f"mirror       {mirror}: up to date (step {lag.mirror_latest_step})")
    elif not behind:
        echo(f"mirror       {mirror}: ahead of this chain: it holds {plural(ahead, 'commit record')} this "
             f"chain lacks ({where}); `ldtools sync {mirror} {info.path}` brings this chain up to it")
    elif ahead:
        echo(f"mirror       {mirror}: diverged: it holds {plural(ahead, 'commit record')} this chain lacks, "
             f"and lacks {behind} of this chain's ({where})")
    else:
        echo(f"mirror       {mirror}: {plural(lag.lag_steps, 'step')} and {plural(behind, 'commit record')} "
             f"behind (at step {lag.mirror_latest_step}; the oldest commit it lacks is "
             f"{lag.lag_seconds:.1f} s old); `ldtools sync {info.path} {mirror}` catches it up")


#: ``info`` lists the bytes of every rank up to this world size, else the smallest and largest.
RANKS_LISTED = 8


def _echo_sharded_info(info: ChainInfo, parts: ShardedInfo) -> None:
    names = f" ({', '.join(parts.dim_names)})" if parts.dim_names else ""
    echo(f"chain        {info.path}  (sharded, format {info.format_version}, kind {info.kind})")
    echo(f"optimizer    {info.optimizer}")
    echo(f"ranks        {parts.world_size}, mesh {list(parts.mesh_shape)}{names}; {parts.sharded_tensors} sharded "
         f"tensors ({human_bytes(parts.sharded_model_bytes)} of model state)")
    if info.steps:
        echo(f"steps        {info.steps} committed ({info.first_step} .. {info.latest_step}), "
             f"{plural(info.commits, 'commit record')}")
    else:
        echo(f"steps        none committed yet, {plural(info.commits, 'commit record')}")
    _echo_anchors(info.anchors, "  (anchors in every rank's chain)")
    pending = parts.pending_steps
    if pending:
        echo(f"pending      {plural(len(pending), 'step')} some ranks hold beyond the last commit "
             f"({pending[0]}..{pending[-1]}); the next writer removes them")
    per_rank, copies = parts.bytes_per_rank, parts.copies
    if len(per_rank) <= RANKS_LISTED:
        ranks = ", ".join(f"rank {r}: copy of rank {copies[r]}" if r in copies else f"rank {r}: {human_bytes(n)}"
                          for r, n in enumerate(per_rank))
    else:
        own = [n for r, n in enumerate(per_rank) if r not in copies]
        ranks = f"per rank {human_bytes(min(own))} .. {human_bytes(max(own))}"
        if copies:
            ranks += f"; {plural(len(copies), 'copy rank')} write none"
    echo(f"on disk      {human_bytes(info.bytes_on_disk)}  ({ranks})")
    full = info.full_checkpoint
    if full.bytes is not None:
        echo(f"full state   {human_bytes(full.bytes)} at step {full.step} (model "
             f"{human_bytes(full.model_bytes or 0)}, optimizer {human_bytes(full.optimizer_bytes or 0)}): "
             "the unsharded state that materialize writes")
    elif full.error is not None:
        echo(f"full state   unknown: measuring step {info.latest_step} from rank 0's chain failed "
             f"({full.error}); run `ldtools validate` on the chain")
    _echo_compression(info)
    echo(f"rank chains  {info.path}/ranks/<rank>: `ldtools info` or `ldtools log` of one shows that rank's chain")
    _echo_mirror_lag(info)


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
            _echo_sharded_log(commit_log(opened), as_json)
            return
        if rank >= opened.world_size:
            raise UsageError(f"{opened.path}: --rank {rank}: the sharded chain has ranks 0..{opened.world_size - 1}")
        if rank in opened.root.copies:
            raise UsageError(f"{opened.path}: --rank {rank}: rank {rank} is a copy of rank "
                             f"{opened.root.copies[rank]} and has no chain of its own; pass --rank "
                             f"{opened.root.copies[rank]}")
        _echo_log(commit_log(opened.ranks[rank]), as_json)
    elif rank is not None:
        parent = sharded_parent(chain)
        if parent is not None:
            raise UsageError(f"{opened.path}: --rank applies to a sharded chain; this is rank {parent[1]}'s chain of "
                             f"{parent[0]} (leave out --rank, or pass {parent[0]})")
        raise UsageError(f"{opened.path}: --rank applies to a sharded chain; this is an ordinary chain "
                         "(leave out --rank)")
    else:
        _echo_log(commit_log(opened), as_json)


def _echo_log(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        echo(json.dumps(rows, indent=2))
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
        echo("  ".join([*cells, line[-1]]).rstrip())


def _echo_sharded_log(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        echo(json.dumps(rows, indent=2))
        return
    lines = [("SEQ", "TIME", "STEP", "WRITER")] + [(str(r["seq"]), str(r["time"]), str(r["step"]), str(r["writer"]))
                                                   for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(4)]
    for line in lines:
        cells = [cell.rjust(w) if i in (0, 2) else cell.ljust(w)  # numbers to the right
                 for i, (cell, w) in enumerate(zip(line, widths, strict=True))]
        echo("  ".join(cells).rstrip())


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
            say(f"ldtools: note: {chain} is rank {parent[1]}'s chain of the sharded chain {parent[0]}: the output "
                 f"holds that rank's local shards only; materialize {parent[0]} for the full state")
    if fmt == "dcp":
        from ldformat import export_dcp  # imports torch

        refuse_existing_output(out, force, directory=True)
        with (replay_thread_count(threads), progress_bar(show_progress, {"": label}) as bar,
              about_step(target, "materializing")):
            written = export_dcp(reader, step, out, progress=bar, replace=force)
        echo(f"wrote step {written} to {out}/ (torch.distributed.checkpoint)")
        return
    what = f"step {target}" if target is not None else "the output"
    check_output(out, what)
    refuse_existing_output(out, force, directory=False)
    with (replay_thread_count(threads), progress_bar(show_progress, {"": label}) as bar,
          about_step(target, "materializing")):
        state = reader.materialize(step, progress=bar)
    size = save_step(state, out, format=fmt, with_optimizer=with_optimizer)
    echo(f"wrote step {state['step']} to {out} ({human_bytes(size)})")


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
    with replay_thread_count(threads), progress_bar(show_progress, labels) as bar:
        report = ldformat.validate(chain, deep=deep, strict=strict, progress=bar)
    world = sharded_world_size(chain)
    compared = len(report.drift) if deep else None
    if as_json:
        echo(json.dumps({**report.to_dict(), "anchors_compared": compared, "strict": strict}, indent=2))
    else:
        for p in report.problems:
            echo(str(p))
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
                echo(f"ok: {plural(report.steps, 'step')}, {plural(len(report.anchors), 'anchor')}{drift}")
            else:
                where = (plural(report.steps, "committed step") if deep
                         else plural(len(report.anchors), "anchor"))
                echo(f"ok: sharded chain of {plural(world, 'rank')}, {plural(report.steps, 'committed step')}, "
                      f"{plural(len(report.anchors), 'anchor')}, the ranks' copies agree at {where}{drift}")
        else:
            say(f"invalid: {plural(len(report.problems), 'problem')}")
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
        with replay_thread_count(threads), progress_bar(show_progress, {"anchors": "writing anchors"}) as bar:
            return ldformat.compact(chain, max_replay=max_replay, keep_last=keep_last, keep_every=keep_every,
                                    dry_run=dry_run, break_lock=break_it, progress=bar)

    plan = run(False) if dry_run else with_lock(chain, run, break_lock=break_lock, yes=yes)
    if as_json:
        echo(json.dumps(plan.to_dict(), indent=2))
        return
    echo(compaction_summary(plan, dry_run))
    verb = "would" if dry_run else "did"
    if plan.aborted_uploads:
        echo(f"{verb} abort {plural(len(plan.aborted_uploads), 'incomplete multipart upload')} that killed "
              "writers left")
    if plan.uploads_problem:
        say(f"ldtools: warning: incomplete multipart uploads were not cleaned up: {plan.uploads_problem}")


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
    plan = ldformat.compact(chain, max_replay=max_replay, keep_last=keep_last, keep_every=keep_every, dry_run=True)
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
    refuse_break_lock_without_consent(chain, break_lock, yes)
    reader = ldformat.open_reader(chain)
    if isinstance(reader, ldformat.ChainReader) and sharded_parent(chain) is not None:
        raise UsageError(f"{chain}: this is one rank's chain of a sharded chain; it is truncated only with the "
                         "others (spec §20.8), never on its own")
    later = [s for s in reader.steps if s > after]
    if after not in reader.steps:
        raise ldformat.StepNotFoundError(f"{chain}: step {after} is not in the chain (as a committed step); "
                                         "nothing was changed")
    if later:
        confirm(f"remove {plural(len(later), 'step')} ({step_span(later)})?", yes=yes,
                refusal=f"{chain}: truncate --after {after} would remove {plural(len(later), 'step')} "
                        f"({step_span(later)})")

    def run(break_it: bool) -> list[int]:
        with about_step(after, "truncating after"):
            return ldformat.truncate(chain, after, break_lock=break_it)

    removed = with_lock(chain, run, break_lock=break_lock, yes=yes)
    echo(f"removed {plural(len(removed), 'step')}; the chain now ends at step {after}")


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
    check_chain_location(src)  # a missing local SRC: the same error as every command's CHAIN
    refuse_break_lock_without_consent(dst, break_lock, yes)

    def run(break_it: bool) -> ldformat.SyncReport:
        with progress_bar(show_progress, {"bytes": "copying"}, byte_stages=("bytes",)) as bar:
            return ldformat.sync(src, dst, progress=bar, break_lock=break_it)

    report = with_lock(dst, run, break_lock=break_lock, yes=yes)
    if as_json:
        echo(json.dumps(report.to_dict(), indent=2))
        return
    steps_behind = "" if report.lag_steps is None else f" ({plural(report.lag_steps, 'step')})"
    lag = "up to date" if report.up_to_date else (
        f"{plural(report.src_last_seq - report.dst_last_seq, 'record')}{steps_behind} behind")
    deferred = "; garbage kept until a record is copied (the lock was taken over)" if report.garbage_deferred else ""
    records = (f"{plural(report.records_copied, 'commit record')} and {plural(report.rank_records_copied, 'record')} "
               f"of {plural(report.world_size or 0, 'rank chain')}" if report.sharded
               else plural(report.records_copied, "record"))
    echo(f"synced {records}, {plural(report.objects_copied, 'object')} "
          f"({human_bytes(report.bytes_copied)}) copied, {report.objects_skipped} already there, "
          f"{report.garbage_removed} removed; {report.dst} at step "
          f"{report.dst_latest_step}, {lag} ({report.src} at step {report.src_latest_step}); "
          f"{report.seconds:.1f} s{deferred}")



for command in (history.stats, history.diff, history.plot):
    cli.add_command(command)


def main() -> None:
    cli(prog_name="ldtools")


if __name__ == "__main__":
    main()
