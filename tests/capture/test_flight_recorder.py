"""The flight recorder: Checkpointer.log, ldformat.export.history, ldtools stats/diff/plot.

Every number stats prints is checked against the same formula applied to live states saved
during training: the replayed states are bit-identical, so the numbers are equal, not close.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import ldformat
import ldformat.export.history
from ldformat.errors import UsageError
from ldformat.export.history import SPIKE_THRESHOLD, SpikeDetector, diff_steps, group_of, rollback_step, step_history
from ldtools.cli import cli

# The live-state formulas run on one thread, as ldformat.export.history measures (reductions are
# then the same whatever the machine's thread count).
pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 30
SPIKE = (22, 23)


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train(chain: Path, mode: str, spike: tuple[int, ...] = SPIKE, steps: int = STEPS
           ) -> tuple[list[dict[str, torch.Tensor]], list[dict[int, torch.Tensor]], list[float]]:
    """Train and record; returns the live weights and exp_avg_sq after every step (0 = initial),
    and the logged losses (index = step)."""
    model, opt = _model()
    weights = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    moments: list[dict[int, torch.Tensor]] = [{}]
    losses = [math.nan]
    with ldformat.Checkpointer(chain, model, opt, mode=mode, anchor_every=10, batch_steps=4) as ck:
        for step in range(1, steps + 1):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(32, 6, generator=g)
            loss = nn.functional.mse_loss(model(x), x[:, :2].sum(1, keepdim=True))
            opt.zero_grad()
            loss.backward()
            ck.log(loss=loss, grad_norm=7.5)
            for group in opt.param_groups:
                group["lr"] = 1e-3 * (100.0 if step in spike else 1.0)
            opt.step()
            losses.append(float(loss.detach()))
            weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
            moments.append({i: opt.state[p]["exp_avg_sq"].clone() for i, p in enumerate(model.parameters())})
    return weights, moments, losses


@pytest.fixture(scope="module", params=["xor", "lowdiff+"])
def recorded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    chain = tmp_path_factory.mktemp(f"fr-{request.param}") / "chain"
    weights, moments, losses = _train(chain, request.param)
    return {"chain": chain, "weights": weights, "moments": moments, "losses": losses}


def _sq(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t)) ** 2  # the formula of ldformat.export.history


# -- Checkpointer.log -------------------------------------------------------------------------
def test_logged_scalars_are_in_each_steps_extra(recorded: dict[str, Any]) -> None:
    reader = ldformat.ChainReader(recorded["chain"])
    for step in (1, 10, STEPS):
        scalars = reader.extra(step)["scalars"]
        lr = 0.1 if step in SPIKE else 1e-3  # the lr the step used, recorded by the runtime
        assert scalars == {"loss": recorded["losses"][step], "grad_norm": 7.5, "lr": lr}, step
    assert "scalars" not in reader.extra(0)


def test_nonfinite_scalars_are_recorded_and_bad_ones_refused(tmp_path: Path) -> None:
    model, opt = _model()
    with ldformat.Checkpointer(tmp_path / "c", model, opt) as ck:
        with pytest.raises(UsageError, match="scalar name 'a b'"):
            ck.log(**{"a b": 1.0})
        with pytest.raises(UsageError, match="not a real number"):
            ck.log(loss="high")
        with pytest.raises(UsageError, match="more than 64 scalars"):
            ck.log(**{f"s{i}": float(i) for i in range(65)})
        ck.log(loss=float("nan"), grad_norm=torch.tensor(float("inf")), lr=-math.inf)
        ck.log(loss=2.0)  # a later value replaces an earlier one
        ck.log(loss=math.nan)
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
    scalars = ldformat.ChainReader(tmp_path / "c").extra(1)["scalars"]
    assert math.isnan(scalars["loss"]) and scalars["grad_norm"] == math.inf and scalars["lr"] == -math.inf
    history = list(step_history(str(tmp_path / "c")))
    assert history[1].flags == ("nonfinite_loss",)
    assert history[1].to_dict()["scalars"] == {"loss": "nan", "grad_norm": "inf", "lr": "-inf"}


def test_lrs_are_those_the_step_used_with_a_scheduler(tmp_path: Path) -> None:
    model, opt = _model()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    used = [math.nan]
    with ldformat.Checkpointer(tmp_path / "c", model, opt, scheduler=scheduler) as ck:
        for _ in range(6):
            model(torch.randn(4, 6)).sum().backward()
            used.append(opt.param_groups[0]["lr"])
            opt.step()
            scheduler.step()
    history = list(step_history(str(tmp_path / "c")))
    assert [s.lrs for s in history[1:]] == [(lr,) for lr in used[1:]] == [(1e-3,), (1e-3,), (5e-4,), (5e-4,),
                                                                           (2.5e-4,), (2.5e-4,)]
    ck.log(loss=1.0)  # after close: kept for a step that never comes, harmlessly


# -- stats: exact numbers -----------------------------------------------------------------------
def test_stats_equal_norms_of_live_states(recorded: dict[str, Any]) -> None:
    weights, moments = recorded["weights"], recorded["moments"]
    history = list(step_history(str(recorded["chain"]), depth=1))
    assert [s.step for s in history] == list(range(STEPS + 1))
    assert history[0].update_norm is None and history[0].anchor
    names = list(weights[0])
    for s in history[1:]:
        w, prev = weights[s.step], weights[s.step - 1]
        groups: dict[str, list[float]] = {}
        for i, n in enumerate(names):
            a = groups.setdefault(group_of(n, 1), [0.0, 0.0, 0.0])
            a[0] += _sq(w[n])
            a[1] += _sq(torch.sub(w[n], prev[n]))
            a[2] += float(moments[s.step][i].sum())
        assert [g.name for g in s.groups] == list(groups) == ["0", "2"]
        for g in s.groups:
            want = groups[g.name]
            assert g.weight_norm == math.sqrt(want[0]), (s.step, g.name)
            assert g.update_norm == math.sqrt(want[1]), (s.step, g.name)
            assert g.relative_update == math.sqrt(want[1]) / math.sqrt(want[0])
            assert g.v_mean == want[2] / g.numel
        assert s.weight_norm == math.sqrt(sum(a[0] for a in groups.values()))
        assert s.update_norm == math.sqrt(sum(a[1] for a in groups.values()))
        assert s.lrs == ((0.1,) if s.step in SPIKE else (1e-3,)), s.step
        assert s.loss == recorded["losses"][s.step]
        assert s.since == s.step - 1 and s.anchor == (s.step % 10 == 0)


def test_a_pool_of_threads_measures_the_same_numbers(recorded: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Parameters measured on a pool of threads (each reduction on one torch thread, the sums
    added in parameter order) give the numbers of the calling thread, bit for bit."""
    inline = [s.to_dict() for s in step_history(str(recorded["chain"]), depth=2)]
    jobs: list[int] = []
    with ThreadPoolExecutor(2) as pool:
        submit = pool.submit
        monkeypatch.setattr(pool, "submit", lambda *a, **k: jobs.append(1) or submit(*a, **k))
        monkeypatch.setattr(ldformat.export.history, "POOL_MIN_NUMEL", 1)  # every parameter goes to the pool
        monkeypatch.setattr(ldformat.export.history, "_measure_pool", lambda: pool)
        assert [s.to_dict() for s in step_history(str(recorded["chain"]), depth=2)] == inline
    assert len(jobs) == 4 * (STEPS + 1)  # four parameters a step


def test_bytes_per_step_add_up_to_the_stored_objects(recorded: dict[str, Any]) -> None:
    reader = ldformat.ChainReader(recorded["chain"])
    history = list(step_history(reader))
    stored = sum(a.object.size for a in reader.state.anchors.values())
    stored += sum(o.size for d in reader.state.delta_entries() for o in d.objects)
    total = sum(s.bytes for s in history)
    rows = sum(d.rows for d in reader.state.delta_entries())
    assert stored - rows < total <= stored  # each step's share of its batch, rounded down
    assert all(s.bytes >= reader.state.anchors[s.step].object.size for s in history if s.anchor)


def test_a_range_replays_to_the_same_numbers(recorded: dict[str, Any]) -> None:
    full = list(step_history(str(recorded["chain"]), depth=2))
    part = list(step_history(str(recorded["chain"]), first=13, last=17, depth=2))
    assert [s.step for s in part] == [13, 14, 15, 16, 17]
    assert [s.to_dict() for s in part] == [s.to_dict() for s in full[13:18]]


def test_a_chain_at_a_url_gives_the_same_history(recorded: dict[str, Any]) -> None:
    url = f"memory://flight-{recorded['chain'].parent.name}"
    ldformat.sync(recorded["chain"], url)
    assert [s.to_dict() for s in step_history(url, first=18)] == \
        [s.to_dict() for s in step_history(str(recorded["chain"]), first=18)]


# -- spikes and rollback ------------------------------------------------------------------------
def test_injected_spike_is_flagged_with_the_rollback_command(recorded: dict[str, Any]) -> None:
    chain = str(recorded["chain"])
    history = list(step_history(chain))
    flagged = [s.step for s in history if s.flags]
    assert flagged[0] == SPIKE[0] and "relative_update" in history[SPIKE[0]].flags
    assert all(s >= SPIKE[0] for s in flagged)
    assert rollback_step(history) == SPIKE[0] - 1
    result = CliRunner().invoke(cli, ["stats", chain])
    assert result.exit_code == 0, result.output
    assert f"first flagged step: {SPIKE[0]}" in result.output
    assert f"ldtools truncate {chain} --after {SPIKE[0] - 1} --yes" in result.output
    data = json.loads(CliRunner().invoke(cli, ["stats", chain, "--json", "--depth", "2"]).output)
    assert data["rollback"]["rollback_to"] == SPIKE[0] - 1 and len(data["steps"]) == STEPS + 1
    assert data["steps"][5]["groups"][0]["name"] == "0"


def test_no_spike_no_flag(tmp_path: Path) -> None:
    _train(tmp_path / "c", "xor", spike=(), steps=20)
    result = CliRunner().invoke(cli, ["stats", str(tmp_path / "c"), "--groups"])
    assert result.exit_code == 0, result.output
    assert "no step flagged" in result.output and "v mean" in result.output


def test_spike_detector_rule() -> None:
    d = SpikeDetector(window=5, min_history=3)
    assert not any(d.add(x) for x in (1.0, 1.1, 0.9))  # too little history for the first three
    assert not d.add(1.05)
    mad = 0.05  # median 1.025 of (1.0, 1.1, 0.9, 1.05); MAD of |x - 1.025|: 0.05
    assert d.score(1.025 + SPIKE_THRESHOLD * mad / 0.6745 * 1.01) > SPIKE_THRESHOLD  # type: ignore[operator]
    assert not d.add(0.1)  # a drop is not a spike
    assert d.add(math.inf)


# -- compacted chains ---------------------------------------------------------------------------
def test_compacted_steps_are_absent_not_interpolated(tmp_path: Path, recorded: dict[str, Any]) -> None:
    chain = tmp_path / "c"
    shutil.copytree(recorded["chain"], chain)
    ldformat.compact(chain, keep_last=5, keep_every=10)
    reader = ldformat.ChainReader(chain)
    kept = set(reader.steps)
    assert 5 not in kept and 10 in kept
    history = list(step_history(reader))
    assert [s.step for s in history] == list(range(min(kept), STEPS + 1))
    for s in history:
        assert s.present == (s.step in kept)
        if not s.present:
            assert s.update_norm is None and s.groups == ()
    w = recorded["weights"]
    at20 = next(s for s in history if s.step == 20)
    assert at20.since == 10  # the update of 20 spans the removed steps 11-19
    assert at20.update_norm == math.sqrt(sum(_sq(torch.sub(w[20][n], w[10][n])) for n in w[0]))
    result = CliRunner().invoke(cli, ["stats", str(chain)])
    assert result.exit_code == 0 and "absent (compacted)" in result.output


# -- diff ---------------------------------------------------------------------------------------
def test_diff_steps_and_chains(tmp_path: Path, recorded: dict[str, Any]) -> None:
    chain = str(recorded["chain"])
    w = recorded["weights"]
    diffs = {d.name: d for d in diff_steps(chain, 3, 4)}
    d = diffs["model/0.weight"]
    delta = (w[3]["0.weight"].double() - w[4]["0.weight"].double())
    assert d.status == "changed" and d.max_abs == float(delta.abs().max())
    assert d.relative_norm == float(delta.norm()) / float(w[3]["0.weight"].double().norm())
    assert d.changed_fraction == float((w[3]["0.weight"] != w[4]["0.weight"]).double().mean())
    assert all(x.status == "same" for x in diff_steps(chain, 4, 4))
    other = tmp_path / "other"  # a second chain of the same schema (a copy: every tensor equal)
    shutil.copytree(recorded["chain"], other)
    same = CliRunner().invoke(cli, ["diff", chain, "7", "7", "--other", str(other), "--json"])
    assert same.exit_code == 0, same.output
    assert {t["status"] for t in json.loads(same.output)["tensors"]} == {"same"}
    reader = ldformat.ChainReader(other)
    a = {n: t.detach().clone() for n, t in reader.stored_tensors(7).items()}
    b = {n: t.clone() for n, t in a.items()}
    b["model/2.bias"].view(-1)[0] += 1.0
    b["model/0.weight"].view(-1)[29] = -b["model/0.weight"].view(-1)[29]
    found = {x.name: x for x in ldformat.export.history.diff_states(a, b)}
    want = abs(float(b["model/2.bias"][0]) - float(a["model/2.bias"][0]))  # +1 rounded to float32
    assert found["model/2.bias"].first_index == 0 and found["model/2.bias"].max_abs == want
    assert found["model/0.weight"].first_index == 29 and found["model/0.weight"].changed_fraction == 1 / 72
    text = CliRunner().invoke(cli, ["diff", chain, "3", "4"])
    assert text.exit_code == 0 and "model/0.weight" in text.output and "changed" in text.output


# -- plot ---------------------------------------------------------------------------------------
class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def test_plot_html_is_self_contained(tmp_path: Path, recorded: dict[str, Any]) -> None:
    out = tmp_path / "history.html"
    result = CliRunner().invoke(cli, ["plot", str(recorded["chain"]), "-o", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    page = _Page()
    page.feed(text)
    tags = [t for t, _ in page.tags]
    assert tags.count("svg") == 1 and "script" not in tags and "img" not in tags and "link" not in tags
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in text
    cells = [a for t, a in page.tags if t == "rect" and a.get("class") == "cell"]
    assert len(cells) == 2 * STEPS  # steps x groups; step 0 has no update
    anchors = [a for t, a in page.tags if t == "line" and a.get("class") == "anchor"]
    assert len(anchors) == 3 * 4  # anchors 0, 10, 20, 30 in the loss, lr and heat map panels
    assert sum(1 for t, a in page.tags if t == "rect" and a.get("class") == "bar anchorbar") == 4
    assert any(a.get("class") == "flag" for t, a in page.tags if t == "line")
    assert "ldtools truncate" in text and f"--after {SPIKE[0] - 1}" in text
    again = CliRunner().invoke(cli, ["plot", str(recorded["chain"]), "-o", str(out)])
    assert again.exit_code == 2 and "--force" in again.output


def _png_size_and_pixels(data: bytes) -> tuple[int, int, bytes]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height = 8, b"", 0, 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    return width, height, zlib.decompress(idat)


def test_plot_png(tmp_path: Path, recorded: dict[str, Any]) -> None:
    pytest.importorskip("matplotlib")  # an optional extra (ldformat[plots]): skipped without it
    import numpy as np
    from matplotlib.image import imread

    out = tmp_path / "history.png"
    result = CliRunner().invoke(cli, ["plot", str(recorded["chain"]), "-o", str(out)])
    assert result.exit_code == 0, result.output
    width, height, raw = _png_size_and_pixels(out.read_bytes())
    assert (width, height) == (1000, 1000)  # figsize (10, 10) at 100 dpi
    assert len(set(raw)) > 20
    pixels = imread(out)[..., :3]  # RGB in [0, 1], decoded by Pillow
    assert pixels.shape == (1000, 1000, 3)
    # Not blank: the pixels vary, a good share of them is drawn (not white), and the heat map
    # and the lines bring many colours.
    assert pixels.std() > 0.1
    assert 0.05 < (pixels.min(axis=2) < 0.9).mean() < 0.9
    rgb = (pixels * 255).astype(np.uint32)
    assert len(np.unique((rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2])) > 100


def test_plot_png_without_matplotlib_says_how_to_get_it(tmp_path: Path, recorded: dict[str, Any],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    result = CliRunner().invoke(cli, ["plot", str(recorded["chain"]), "-o", str(tmp_path / "h.png")])
    assert result.exit_code == 2 and "pip install 'ldformat[plots]'" in result.output
    assert not (tmp_path / "h.png").exists()


# -- errors -------------------------------------------------------------------------------------
def test_errors_name_the_problem_with_usage_exit_codes(tmp_path: Path, recorded: dict[str, Any]) -> None:
    chain = str(recorded["chain"])
    runner = CliRunner()
    missing = runner.invoke(cli, ["stats", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "no such directory" in missing.output
    empty = runner.invoke(cli, ["stats", chain, "--from", "500"])
    assert empty.exit_code == 2 and "no committed step in 500.." in empty.output
    suffix = runner.invoke(cli, ["plot", chain, "-o", str(tmp_path / "h.txt")])
    assert suffix.exit_code == 2 and "writes .html or .png" in suffix.output
    step = runner.invoke(cli, ["diff", chain, "3", "999"])
    assert step.exit_code == 1 and "step 999 is not in the chain" in step.output
