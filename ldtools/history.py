"""``ldtools stats``, ``ldtools diff`` and ``ldtools plot``: the flight recorder's commands
(docs/flight-recorder.md). They display what :mod:`ldformat.export.history` computes.

:mod:`ldtools.cli` adds these commands to its group; they share :mod:`.terminal` with it.
"""

from __future__ import annotations

import html
import json
import math
import shlex
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import click

import ldformat
from ldformat import UsageError, check_output, write_output

from .progress import human_bytes
from .terminal import CHAIN, echo, errors_to_exit_codes, refuse_existing_output

if TYPE_CHECKING:
    from ldformat import StepStats, TensorDiff


def _reader(chain: str) -> ldformat.ChainReader | ldformat.ShardedReader:
    """A plain chain's reader, or a sharded chain's (spec §20): its history and states are
    those of the full tensors, by FQN."""
    return ldformat.open_reader(chain)


def _num(x: float | None, fmt: str = ".4g") -> str:
    return "-" if x is None else format(x, fmt)


RANGE = [
    click.option("--from", "first", type=int, default=None, help="First step (default: the chain's first)."),
    click.option("--to", "last", type=int, default=None, help="Last step (default: the chain's latest)."),
    click.option("--depth", type=click.IntRange(min=1), default=1, show_default=True,
                 help="Group parameters by the first N components of their names (module prefix)."),
]


def _range_options(fn: Any) -> Any:
    for option in reversed(RANGE):
        fn = option(fn)
    return fn


def _history(chain: str, first: int | None, last: int | None, depth: int) -> list[StepStats]:
    from ldformat import step_history

    return list(step_history(_reader(chain), first=first, last=last, depth=depth))


def rollback_advice(chain: str, history: list[StepStats]) -> dict[str, Any] | None:
    """The first flagged step and the commands that roll back before it (None without flags)."""
    from ldformat import rollback_step

    flagged = next((s for s in history if s.flags), None)
    if flagged is None:
        return None
    to = rollback_step(history)
    advice: dict[str, Any] = {"first_flagged": flagged.step, "flags": list(flagged.flags), "rollback_to": to}
    if to is not None:
        advice["command"] = f"ldtools truncate {shlex.quote(chain)} --after {to} --yes"
        advice["resume"] = (f"then resume training: ldformat.resume({chain!r}, model, optimizer, ...) "
                            f"continues from step {to}")
    return advice


# -- stats -----------------------------------------------------------------------------------
@click.command()
@CHAIN
@_range_options
@click.option("--groups", "show_groups", is_flag=True, help="Also print one line per parameter group and step.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON (every group of every step).")
@errors_to_exit_codes
def stats(chain: str, first: int | None, last: int | None, depth: int, show_groups: bool, as_json: bool) -> None:
    """Replay the chain once and show what every step did to the model.

    Per step: the scalars the training logged (Checkpointer.log; the HF and Lightning
    integrations log loss and lr), the learning rate(s) the step used, the update
    |w_t - w_t-1|, the relative update |dw|/|w|, the weight norm, per parameter group the
    same and Adam's exp_avg_sq, and the bytes the step took. Steps whose loss or relative
    update jumps (robust z-score above 3.5 over the 20 previous steps) are flagged, and the
    command that rolls back before the first flagged step is printed. Steps a compaction
    removed are listed as absent. A sharded chain's rank chains replay side by side: the
    numbers are those of the full tensors, by FQN (scalars and learning rates: rank 0's).

    \b
    Example: ldtools stats runs/chain --from 1000 --to 1200 --depth 2
    """
    history = _history(chain, first, last, depth)
    advice = rollback_advice(chain, history)
    if as_json:
        echo(json.dumps({"chain": chain, "steps": [s.to_dict() for s in history], "rollback": advice}, indent=1))
        return
    names = sorted({k for s in history for k in s.scalars if k not in ("loss", "lr") and not k.startswith("lr/")})
    header = ["STEP", "LOSS", "LR", "REL_UPD", "|DW|", "|W|", "BYTES", *[n.upper() for n in names], "MOVED_MOST", ""]
    rows = [header]
    for s in history:
        if not s.present:
            rows.append([str(s.step), "absent (compacted)"] + [""] * (len(header) - 2))
            continue
        top = max((g for g in s.groups if g.relative_update is not None), key=lambda g: g.relative_update or 0.0,
                  default=None)
        lr = s.lrs[0] if s.lrs else s.scalars.get("lr")
        rows.append([f"{s.step}{'*' if s.anchor else ''}", _num(s.loss), _num(lr, ".3g"), _num(s.relative_update),
                     _num(s.update_norm), _num(s.weight_norm), human_bytes(s.bytes),
                     *[_num(s.scalars.get(n)) for n in names],
                     f"{top.name} {_num(top.relative_update, '.3g')}" if top is not None else "-",
                     " ".join(f"<< {f}" for f in s.flags)])
        if show_groups:
            rows += [[f"  {g.name}", "", "", _num(g.relative_update), _num(g.update_norm), _num(g.weight_norm),
                      "", *[""] * len(names), f"v mean {_num(g.v_mean, '.3g')} max {_num(g.v_max, '.3g')}"
                      if g.v_mean is not None else "", ""] for g in s.groups]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        echo("  ".join(c.ljust(w) if i == 0 or i >= len(r) - 2 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip())
    echo("(* anchor)")
    if advice is None:
        echo("no step flagged (loss and relative update within a robust z-score of 3.5 of the previous 20 steps)")
        return
    echo(f"first flagged step: {advice['first_flagged']} ({', '.join(advice['flags'])})")
    if advice["rollback_to"] is None:
        echo("no earlier step in this range to roll back to; widen it with --from")
    else:
        echo(f"roll back to step {advice['rollback_to']}: {advice['command']}")
        echo(advice["resume"])


# -- diff ------------------------------------------------------------------------------------
@click.command()
@CHAIN
@click.argument("step_a", type=int)
@click.argument("step_b", type=int)
@click.option("--other", default=None, metavar="CHAIN2", help="Take STEP_B from CHAIN2 (a chain of the same schema).")
@click.option("--all", "show_all", is_flag=True, help="Also list tensors that are equal.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON (every tensor).")
@errors_to_exit_codes
def diff(chain: str, step_a: int, step_b: int, other: str | None, show_all: bool, as_json: bool) -> None:
    """Compare the state of STEP_A with that of STEP_B, tensor by tensor.

    For each tensor (model and optimizer, by stored name): max |a - b|, the relative norm
    |a - b| / |a|, the fraction of elements whose bits differ, and the first one that does
    (flat index). With --other, STEP_B is read from CHAIN2 (e.g. a rerun of the same model).
    A sharded chain's tensors are the full ones, by FQN, as a plain chain of the model has them.

    \b
    Example: ldtools diff runs/chain 1200 1201
             ldtools diff runs/chain 1200 1200 --other runs/rerun
    """
    from ldformat import diff_steps

    a = _reader(chain)
    b = _reader(other) if other is not None else None
    diffs = diff_steps(a, step_a, step_b, b)
    if as_json:
        echo(json.dumps({"a": {"chain": chain, "step": step_a}, "b": {"chain": other or chain, "step": step_b},
                          "tensors": [d.to_dict() for d in diffs]}, indent=1))
        return
    _echo_diffs(diffs, show_all)


def _echo_diffs(diffs: list[TensorDiff], show_all: bool) -> None:
    rows = [["TENSOR", "STATUS", "MAX|D|", "REL_NORM", "CHANGED", "FIRST"]]
    for d in diffs:
        if d.status == "same" and not show_all:
            continue
        rows.append([d.name, d.status, _num(d.max_abs), _num(d.relative_norm),
                     "-" if d.changed_fraction is None else f"{100 * d.changed_fraction:.1f}%",
                     "-" if d.first_index is None else str(d.first_index)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        echo("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    counts = {k: sum(d.status == k for d in diffs) for k in ("changed", "same", "only_a", "only_b", "mismatch")}
    echo(f"{len(diffs)} tensors: " + ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in counts.items() if n))


# -- plot ------------------------------------------------------------------------------------
@click.command()
@CHAIN
@click.option("-o", "--output", "out", required=True, type=click.Path(path_type=Path),
              help="history.html (self-contained, no network) or history.png (needs matplotlib).")
@_range_options
@click.option("--force", is_flag=True, help="Replace an existing output file.")
@errors_to_exit_codes
def plot(chain: str, out: Path, first: int | None, last: int | None, depth: int, force: bool) -> None:
    """Draw the chain's history: loss, learning rate, relative update per parameter group
    (a heat map, steps x groups), bytes per step; anchors and flagged steps marked.

    .html is one self-contained file (inline SVG, no script, no network). .png needs
    matplotlib: pip install 'ldformat[plots]'.

    \b
    Example: ldtools plot runs/chain -o history.html
    """
    suffix = out.suffix.lower()
    if suffix not in (".html", ".htm", ".png"):
        raise UsageError(f"{out}: plot writes .html or .png, not {out.suffix or 'a file without a suffix'}")
    if suffix == ".png":
        _pyplot()  # before the replay: a missing matplotlib is known now
    refuse_existing_output(out, force, directory=False)
    check_output(out, "the plot")
    history = _history(chain, first, last, depth)
    if suffix == ".png":
        size = write_output(out, "the plot", lambda f, _tmp: _write_png(f, chain, history))
    else:
        page = history_html(chain, history).encode()

        def write_page(f: IO[bytes], _tmp: str) -> None:
            f.write(page)

        size = write_output(out, "the plot", write_page)
    echo(f"wrote {out} ({human_bytes(size)}, {len(history)} steps)")


class PlotData:
    """The series a plot shows, from a history (absent steps as gaps)."""

    def __init__(self, history: list[StepStats]) -> None:
        present = [s for s in history if s.present]
        self.steps = [s.step for s in present]
        self.loss = [s.loss for s in present]
        self.lr = [s.lrs[0] if s.lrs else s.scalars.get("lr") for s in present]
        self.bytes = [s.bytes for s in present]
        self.anchors = [s.step for s in present if s.anchor]
        self.flagged = [s.step for s in present if s.flags]
        self.groups = list(dict.fromkeys(g.name for s in present for g in s.groups))
        self.heat = [[next((g.relative_update for g in s.groups if g.name == name), None) for s in present]
                     for name in self.groups]


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("ldtools plot -o *.png needs matplotlib: pip install 'ldformat[plots]' "
                         "(or write -o history.html, which needs nothing)") from None
    return plt


def _write_png(f: IO[bytes], chain: str, history: list[StepStats]) -> None:
    plt = _pyplot()
    import numpy as np

    d = PlotData(history)
    fig, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True, gridspec_kw={"height_ratios": [2, 1, 2, 1]})
    x = np.array(d.steps, dtype=float)
    axes[0].plot(x, [np.nan if v is None else v for v in d.loss], color="tab:blue")
    axes[0].set_ylabel("loss")
    axes[0].set_title(f"{chain}: steps {d.steps[0]}-{d.steps[-1]}" if d.steps else chain)
    axes[1].plot(x, [np.nan if v is None else v for v in d.lr], color="tab:green")
    axes[1].set_ylabel("lr")
    if any(v is not None and v > 0 for v in d.lr):
        axes[1].set_yscale("log")
    heat = np.array([[np.nan if v is None or v <= 0 else math.log10(v) for v in row] for row in d.heat])
    if heat.size:
        half = (x[1] - x[0]) / 2 if len(x) > 1 else 0.5
        im = axes[2].imshow(heat, aspect="auto", interpolation="nearest", cmap="magma",
                            extent=(x[0] - half, x[-1] + half, len(d.groups) - 0.5, -0.5))
        axes[2].set_yticks(range(len(d.groups)), d.groups)
        # An inset outside the panel: a colorbar taking the panel's width would misalign its steps.
        fig.colorbar(im, cax=axes[2].inset_axes((1.01, 0.0, 0.015, 1.0)), label="log10 |dw|/|w|")
    axes[2].set_ylabel("group")
    axes[3].bar(x, d.bytes, width=1.0, color="tab:gray")
    axes[3].set_ylabel("bytes")
    axes[3].set_xlabel("step")
    for ax in axes:
        for a in d.anchors:
            ax.axvline(a, color="tab:blue", alpha=0.25, linewidth=0.8)
        for s in d.flagged:
            ax.axvline(s, color="red", alpha=0.6, linewidth=1.0, linestyle="--")
    fig.subplots_adjust(left=0.1, right=0.9, top=0.95, bottom=0.06, hspace=0.12)
    fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


# -- the self-contained HTML page ---------------------------------------------------------------
_W, _LEFT, _RIGHT = 900, 110, 20


def _xs(d: PlotData) -> tuple[float, float]:
    lo = d.steps[0] if d.steps else 0
    hi = d.steps[-1] if d.steps else 1
    return lo - 0.5, hi + 0.5


def _sx(step: float, d: PlotData) -> float:
    lo, hi = _xs(d)
    return _LEFT + (step - lo) / max(hi - lo, 1e-9) * (_W - _LEFT - _RIGHT)


def _marks(d: PlotData, top: float, height: float) -> list[str]:
    out = [f'<line class="anchor" x1="{_sx(a, d):.1f}" x2="{_sx(a, d):.1f}" y1="{top}" y2="{top + height}"/>'
           for a in d.anchors]
    out += [f'<line class="flag" x1="{_sx(s, d):.1f}" x2="{_sx(s, d):.1f}" y1="{top}" y2="{top + height}"/>'
            for s in d.flagged]
    return out


def _line_panel(d: PlotData, values: list[float | None], label: str, top: float, height: float,
                log: bool = False) -> list[str]:
    pts = [(s, v) for s, v in zip(d.steps, values, strict=True) if v is not None and math.isfinite(v)
           and (v > 0 or not log)]
    out = [f'<g class="panel"><rect class="frame" x="{_LEFT}" y="{top}" width="{_W - _LEFT - _RIGHT}" '
           f'height="{height}"/><text class="label" x="{_LEFT}" y="{top - 5}">{html.escape(label)}</text>']
    out += _marks(d, top, height)
    if pts:
        ys = [math.log10(v) if log else v for _, v in pts]
        lo, hi = min(ys), max(ys)
        span = hi - lo or 1.0
        def y(v: float) -> float:
            return top + height - 4 - (v - lo) / span * (height - 8)
        path = " ".join(f"{'M' if i == 0 else 'L'}{_sx(s, d):.1f},{y(v):.1f}" for i, ((s, _), v) in
                        enumerate(zip(pts, ys, strict=True)))
        out.append(f'<path class="series" d="{path}"><title>{html.escape(label)}</title></path>')
        shown = (lambda v: f"{10 ** v:.3g}") if log else (lambda v: f"{v:.4g}")
        out.append(f'<text class="tick" x="{_LEFT - 4}" y="{top + 10}">{shown(hi)}</text>')
        out.append(f'<text class="tick" x="{_LEFT - 4}" y="{top + height - 2}">{shown(lo)}</text>')
    else:
        out.append(f'<text class="tick" x="{_LEFT + 8}" y="{top + height / 2}" text-anchor="start">'
                   'not recorded (Checkpointer.log)</text>')
    out.append("</g>")
    return out


def _color(t: float) -> str:
    """A dark-to-bright ramp (0 = low, 1 = high)."""
    t = min(1.0, max(0.0, t))
    r, g, b = int(20 + 235 * t), int(10 + 200 * t ** 2), int(80 + 60 * (1 - t))
    return f"rgb({r},{g},{b})"


def _heat_panel(d: PlotData, top: float) -> tuple[list[str], float]:
    row_h = 16
    height = max(1, len(d.groups)) * row_h
    out = [f'<g class="panel"><text class="label" x="{_LEFT}" y="{top - 5}">relative update |dw|/|w| per group '
           '(log color scale)</text>']
    logs = [math.log10(v) for row in d.heat for v in row if v is not None and v > 0]
    lo, hi = (min(logs), max(logs)) if logs else (0.0, 1.0)
    width = (_W - _LEFT - _RIGHT) / max(1, len(d.steps))
    for r, (name, row) in enumerate(zip(d.groups, d.heat, strict=True)):
        y = top + r * row_h
        out.append(f'<text class="tick" x="{_LEFT - 4}" y="{y + row_h - 4}">{html.escape(name)}</text>')
        for s, v in zip(d.steps, row, strict=True):
            if v is None:
                continue
            t = (math.log10(v) - lo) / ((hi - lo) or 1.0) if v > 0 else 0.0
            out.append(f'<rect class="cell" x="{_sx(s, d) - width / 2:.1f}" y="{y}" width="{width + 0.3:.1f}" '
                       f'height="{row_h}" fill="{_color(t)}"><title>step {s} {html.escape(name)}: {v:.3g}</title>'
                       "</rect>")
    out += _marks(d, top, height)
    out.append(f'<text class="tick" x="{_W - _RIGHT}" y="{top + height + 12}">color: {10 ** lo:.2g} .. '
               f'{10 ** hi:.2g}</text></g>')
    return out, height


def _bytes_panel(d: PlotData, top: float, height: float) -> list[str]:
    out = [f'<g class="panel"><rect class="frame" x="{_LEFT}" y="{top}" width="{_W - _LEFT - _RIGHT}" '
           f'height="{height}"/><text class="label" x="{_LEFT}" y="{top - 5}">bytes per step</text>']
    peak = max(d.bytes, default=0) or 1
    width = (_W - _LEFT - _RIGHT) / max(1, len(d.steps))
    for s, b, anchor in zip(d.steps, d.bytes, [s in d.anchors for s in d.steps], strict=True):
        h = b / peak * (height - 4)
        out.append(f'<rect class="{"bar anchorbar" if anchor else "bar"}" x="{_sx(s, d) - width / 2:.1f}" '
                   f'y="{top + height - h:.1f}" width="{max(width - 0.5, 0.5):.1f}" height="{h:.1f}">'
                   f"<title>step {s}: {b} bytes</title></rect>")
    out.append(f'<text class="tick" x="{_LEFT - 4}" y="{top + 10}">{html.escape(human_bytes(peak))}</text></g>')
    return out


def history_svg(chain: str, history: list[StepStats]) -> str:
    """The plot as one SVG element."""
    d = PlotData(history)
    parts: list[str] = []
    y = 46.0  # each panel's label sits in the 20 px above it
    parts += _line_panel(d, d.loss, "loss", y, 140)
    y += 140 + 30
    parts += _line_panel(d, d.lr, "learning rate (log)", y, 80, log=True)
    y += 80 + 30
    heat, h = _heat_panel(d, y)
    parts += heat
    y += h + 40  # the colour range is written below the heat map
    parts += _bytes_panel(d, y, 80)
    y += 80 + 24
    for s in (d.steps[0], d.steps[-1]) if d.steps else ():
        parts.append(f'<text class="axis" x="{_sx(s, d):.1f}" y="{y - 6}">step {s}</text>')
    title = f"{chain}: steps {d.steps[0]}-{d.steps[-1]}" if d.steps else chain
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{y:.0f}" viewBox="0 0 {_W} {y:.0f}" '
            f'role="img" aria-label="{html.escape(title)}"><text class="title" x="8" y="18">{html.escape(title)} '
            "(blue lines: anchors; red dashed: flagged steps)</text>" + "".join(parts) + "</svg>")


_STYLE = """body{font-family:sans-serif;margin:16px}svg text{font-size:11px;fill:#222}
.title{font-size:13px;font-weight:bold}.label{font-weight:bold}.tick{text-anchor:end;fill:#555}.axis{text-anchor:middle;fill:#555}
.frame{fill:#fafafa;stroke:#ccc}.series{fill:none;stroke:#1f77b4;stroke-width:1.5}
.anchor{stroke:#1f77b4;stroke-opacity:.3}.flag{stroke:#d62728;stroke-dasharray:4 3}.bar{fill:#888}
.anchorbar{fill:#1f77b4}table{border-collapse:collapse;font-size:12px}td,th{padding:2px 8px;text-align:right}"""


def history_html(chain: str, history: list[StepStats]) -> str:
    """A self-contained page: the SVG plot and the flagged steps with the rollback command."""
    advice = rollback_advice(chain, history)
    note = "<p>No step flagged.</p>"
    if advice is not None:
        note = (f"<p>First flagged step: <b>{advice['first_flagged']}</b> ({html.escape(', '.join(advice['flags']))})"
                + (f". Roll back: <code>{html.escape(advice['command'])}</code>, {html.escape(advice['resume'])}.</p>"
                   if advice.get("command") else ".</p>"))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>ldtools plot: {html.escape(chain)}</title><style>{_STYLE}</style></head><body>"
            f"{history_svg(chain, history)}{note}</body></html>\n")
