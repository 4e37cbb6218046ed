"""``ldtools``: a thin click layer over ldformat's public API.

Exit codes: 0 success, 1 a problem with the chain (invalid, corrupt, locked, step missing),
2 a usage error or a path that is not a chain. Errors are one line on stderr.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

import ldformat
from ldformat import ChainError, ChainReader, LdformatError, NotAChainError, UsageError

F = TypeVar("F", bound=Callable[..., Any])

EXIT_PROBLEM = 1
EXIT_USAGE = 2


def _fail(message: str, code: int) -> None:
    click.echo(f"ldtools: error: {message}", err=True)
    sys.exit(code)


def errors_to_exit_codes(fn: F) -> F:
    """Turn ldformat errors into one line on stderr and the documented exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except NotAChainError as e:
            _fail(str(e), EXIT_USAGE)
        except UsageError as e:
            _fail(str(e), EXIT_USAGE)
        except ChainError as e:
            _fail(str(e), EXIT_PROBLEM)
        except LdformatError as e:
            _fail(str(e), EXIT_PROBLEM)
        except OSError as e:
            _fail(f"{e.filename or ''}: {e.strerror or e}".lstrip(": "), EXIT_PROBLEM)

    return wrapper  # type: ignore[return-value]


class _Progress:
    """A click progress bar on a terminal; silent otherwise."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.bar: Any = None
        self.done = 0

    def __call__(self, *args: Any) -> None:
        done, total = args[-2], args[-1]
        if not sys.stderr.isatty():
            return
        if self.bar is None:
            self.bar = click.progressbar(length=total, label=self.label, file=sys.stderr)
            self.bar.__enter__()
        self.bar.update(done - self.done)
        self.done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


CHAIN = click.argument("chain", type=click.Path(path_type=str))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(ldformat.__version__, prog_name="ldtools")
def cli() -> None:
    """Inspect, materialize, validate and compact ldformat checkpoint chains.

    Exit codes: 0 success, 1 a problem with the chain, 2 a usage error or a path that is
    not a chain.
    """


def _state_bytes(reader: ChainReader, step: int) -> int:
    """An anchor's size without top-k residuals: the size of one full checkpoint of the state."""
    from ldformat.anchor import tensor_bytes

    entry = reader.state.anchors[step]
    if reader.kind != "grad.topk":
        return entry.object.size
    return entry.object.size - tensor_bytes(reader.read_object(entry.object, step), "compressor")


def chain_info(reader: ChainReader) -> dict[str, Any]:
    state = reader.state
    anchors = sorted(state.anchors.items())
    delta_bytes = sum(o.size for d in state.delta_entries() for o in d.objects)
    n_deltas = len(state.deltas)
    full = _state_bytes(reader, anchors[-1][0]) if anchors else 0
    total = reader.bytes_on_disk()
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
        "anchor_bytes": sum(a.object.size for _, a in anchors),
        "delta_bytes": delta_bytes,
        "delta_bytes_per_step": delta_bytes / n_deltas if n_deltas else None,
        "full_checkpoint_bytes": full,
        "compression_vs_full_checkpoints": (len(steps) * full / total) if total and full else None,
        "environment": reader.root.environment,
        "capture_policy": _capture_policy(reader),
    }


def _capture_policy(reader: ChainReader) -> dict[str, Any] | None:
    """The anchor interval and batch size a Checkpointer chose, from the latest step's extra state."""
    latest = reader.latest_step
    if latest is None:
        return None
    entry = reader.state.deltas.get(latest)
    extra = entry[1].extra if entry is not None else reader.state.anchors[latest].extra
    from ldformat.jsonvalue import decode

    policy = decode(extra).get("policy") if isinstance(extra, dict) else None
    return policy if isinstance(policy, dict) else None


@cli.command()
@CHAIN
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@errors_to_exit_codes
def info(chain: str, as_json: bool) -> None:
    """Summarize a chain: steps, anchors, kind, bytes on disk, compression.

    Example: ldtools info runs/chain --json
    """
    data = chain_info(ChainReader(chain))
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(f"chain        {data['path']}  (format {data['format_version']}, kind {data['kind']})")
    click.echo(f"optimizer    {data['optimizer']}")
    click.echo(f"steps        {data['steps']}  ({data['first_step']} .. {data['latest_step']})")
    anchors = data["anchors"]
    shown = ", ".join(map(str, anchors[:10])) + (" ..." if len(anchors) > 10 else "")
    click.echo(f"anchors      {len(anchors)}  [{shown}]")
    click.echo(f"on disk      {_human(data['bytes_on_disk'])}  (anchors {_human(data['anchor_bytes'])}, "
               f"deltas {_human(data['delta_bytes'])})")
    if data["delta_bytes_per_step"] is not None:
        click.echo(f"per step     {_human(data['delta_bytes_per_step'])} of deltas; one full checkpoint is "
                   f"{_human(data['full_checkpoint_bytes'])}")
    if data["compression_vs_full_checkpoints"]:
        click.echo(f"compression  {data['compression_vs_full_checkpoints']:.1f}x smaller than a full "
                   "checkpoint per step")
    policy = data["capture_policy"]
    if policy:
        line = f"policy       anchor_every={policy.get('anchor_every')} batch_steps={policy.get('batch_steps')}"
        inputs = policy.get("inputs")
        if inputs:
            line += (f" (step {inputs['step_time_s']:.3f}s, anchor write {inputs['anchor_write_s']:.3f}s, "
                     f"replay {inputs['replay_step_s']:.4f}s/step, commit {inputs['commit_s']:.4f}s, "
                     f"MTBF {inputs['mtbf_s'] / 3600:.1f}h)")
        click.echo(line)
    env: dict[str, Any] = data["environment"]
    click.echo(f"recorded on  torch {env.get('torch')}, {env.get('device')}, cpu {env.get('cpu_capability')}, "
               f"optimizer path {','.join(env.get('implementation', []))}")


@cli.command()
@CHAIN
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@errors_to_exit_codes
def log(chain: str, as_json: bool) -> None:
    """List the commit records in effect, oldest first.

    Example: ldtools log runs/chain
    """
    reader = ChainReader(chain)
    rows: list[dict[str, Any]] = []
    for r in reader.records:
        steps = sorted(s.step for d in r.deltas for s in d.steps)
        rows.append({
            "seq": r.seq,
            "type": r.type,
            "reason": r.reason,
            "time": r.time,
            "anchors": [a.step for a in r.anchors],
            "delta_steps": [steps[0], steps[-1]] if steps else None,
            "bytes": sum(a.object.size for a in r.anchors) + sum(o.size for d in r.deltas for o in d.objects),
        })
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        ds = row["delta_steps"]
        deltas = f"deltas {ds[0]}-{ds[1]}" if ds else "no deltas"
        anchors = f"anchors {row['anchors']}" if row["anchors"] else "no anchors"
        click.echo(f"{row['seq']:>6}  {row['time']}  {row['type']:<8} {deltas:<20} {anchors:<24} "
                   f"{_human(row['bytes'])}  {row['reason']}")


def _atomic_write(out: Path, write: Callable[[str], None]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the mode open() would
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def flatten_for_safetensors(state: dict[str, Any], with_optimizer: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """Model tensors (aliases copied, since safetensors refuses shared memory) and metadata."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in state["model"].items():
        ptr = t.untyped_storage().data_ptr()
        tensors[name] = t.clone() if ptr in seen and t.numel() else t.contiguous()
        seen.add(ptr)
    metadata = {"ldformat.step": str(state["step"])}
    if with_optimizer:
        for i, entry in state["optimizer"]["state"].items():
            for key, t in entry.items():
                tensors[f"optimizer.state.{i}.{key}"] = t.contiguous()
        from ldformat.jsonvalue import encode

        metadata["optimizer.param_groups"] = json.dumps(encode(state["optimizer"]["param_groups"]))
    return tensors, metadata


@cli.command()
@CHAIN
@click.option("--step", type=int, default=None, help="Step to materialize (default: the latest committed step).")
@click.option("-o", "--output", "out", required=True, type=click.Path(path_type=Path),
              help="Output file: .pt (torch.save of the whole state) or .safetensors (model state_dict).")
@click.option("--with-optimizer", is_flag=True, help="With .safetensors: add the flattened optimizer state.")
@errors_to_exit_codes
def materialize(chain: str, step: int | None, out: Path, with_optimizer: bool) -> None:
    """Write the state of one step as a plain checkpoint file.

    A .pt file holds {"model", "optimizer", "step", "extra"} and loads with
    torch.load(path, weights_only=True). The write is atomic.

    Example: ldtools materialize runs/chain --step 120 -o step120.pt
    """
    import safetensors.torch
    import torch

    suffix = out.suffix.lower()
    if suffix not in (".pt", ".pth", ".safetensors"):
        raise UsageError(f"{out}: output must end in .pt, .pth or .safetensors")
    if with_optimizer and suffix != ".safetensors":
        raise UsageError("--with-optimizer applies to .safetensors output (.pt always holds the optimizer)")
    reader = ChainReader(chain)
    progress = _Progress(f"replaying to step {step if step is not None else reader.latest_step}")
    try:
        state = reader.materialize(step, progress=progress)
    finally:
        progress.close()
    if suffix == ".safetensors":
        tensors, metadata = flatten_for_safetensors(state, with_optimizer)
        _atomic_write(out, lambda p: safetensors.torch.save_file(tensors, p, metadata=metadata))
    else:
        _atomic_write(out, lambda p: torch.save(state, p))
    click.echo(f"wrote step {state['step']} to {out} ({_human(out.stat().st_size)})")


@cli.command()
@CHAIN
@click.option("--deep", is_flag=True, help="Also replay between anchors and compare bits with the stored anchors.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@errors_to_exit_codes
def validate(chain: str, deep: bool, as_json: bool) -> None:
    """Check every record and object of a chain. Exit 0 if valid, 1 if not.

    Example: ldtools validate runs/chain --deep
    """
    progress = _Progress("validating")
    try:
        report = ldformat.validate(chain, deep=deep, progress=progress)
    finally:
        progress.close()
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        for p in report.problems:
            click.echo(str(p))
        if report.ok:
            drift = f", replay at {len(report.drift)} anchors bit-exact" if deep else ""
            click.echo(f"ok: {report.steps} steps, {len(report.anchors)} anchors{drift}")
        else:
            click.echo(f"invalid: {len(report.problems)} problem(s)", err=True)
    if not report.ok:
        sys.exit(EXIT_PROBLEM)


@cli.command()
@CHAIN
@click.option("--max-replay", type=click.IntRange(min=0), default=None,
              help="No step may need more than K deltas replayed; longer runs get new anchors.")
@click.option("--keep-last", type=click.IntRange(min=1), default=None, help="Keep the newest N steps.")
@click.option("--keep-every", type=click.IntRange(min=1), default=None, help="Also keep every M-th step.")
@click.option("--dry-run", is_flag=True, help="Print the plan without changing anything.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@errors_to_exit_codes
def compact(chain: str, max_replay: int | None, keep_last: int | None, keep_every: int | None,
            dry_run: bool, as_json: bool) -> None:
    """Fold delta runs into anchors, apply retention and remove garbage.

    Crash-safe and idempotent; every step that stays materializes bit-identically.

    Example: ldtools compact runs/chain --max-replay 50 --keep-last 200 --keep-every 1000
    """
    progress = _Progress("writing anchors")
    try:
        plan = ldformat.compact(chain, max_replay=max_replay, keep_last=keep_last, keep_every=keep_every,
                                dry_run=dry_run, progress=progress)
    finally:
        progress.close()
    if as_json:
        click.echo(json.dumps(plan.to_dict(), indent=2))
        return
    verb = "would" if dry_run else "did"
    click.echo(f"{verb} keep {len(plan.kept_steps)} steps, drop {len(plan.dropped_steps)}, "
               f"write {len(plan.new_anchors)} new anchors {plan.new_anchors[:10]}, "
               f"merge {len(plan.merged_deltas)} xor runs, drop {len(plan.dropped_anchors)} anchors, "
               f"remove {len(plan.removed_objects)} objects")


@cli.command()
@CHAIN
@click.option("--after", type=int, required=True, help="Keep steps up to and including this one.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@errors_to_exit_codes
def truncate(chain: str, after: int, yes: bool) -> None:
    """Remove every step after --after (rewind after a loss spike). Crash-safe.

    Example: ldtools truncate runs/chain --after 1200 --yes
    """
    reader = ChainReader(chain)
    later = [s for s in reader.steps if s > after]
    if after not in reader.steps:
        raise ldformat.StepNotFoundError(f"{chain}: step {after} is not in the chain; nothing was changed")
    if later and not yes and sys.stdin.isatty():
        click.confirm(f"remove {len(later)} steps ({later[0]}..{later[-1]})?", abort=True)
    removed = ldformat.truncate(chain, after)
    click.echo(f"removed {len(removed)} steps; the chain now ends at step {after}")


def main() -> None:
    cli(prog_name="ldtools")


if __name__ == "__main__":
    main()
