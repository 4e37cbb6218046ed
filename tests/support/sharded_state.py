"""Comparing gathered full states of sharded runs bit for bit (the sharded tests' common checks)."""

from __future__ import annotations

from typing import Any

import torch
from bitwise import bits


def index_layout(gathered: dict[str, Any]) -> dict[str, Any]:
    """A gathered state (optimizer keyed by FQN, get_optimizer_state_dict layout) in the layout of
    ``optimizer.state_dict()``: parameters numbered in optimizer order across the groups."""
    osd = gathered["optimizer"]
    order = [n for g in osd["param_groups"] for n in g["params"]]
    groups, i = [], 0
    for g in osd["param_groups"]:
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(i, i + len(g["params"])))})
        i += len(g["params"])
    state = {order.index(n): s for n, s in osd["state"].items()}
    return {"model": gathered["model"], "optimizer": {"state": state, "param_groups": groups}}


def _tensor_diff(where: str, got: Any, want: Any) -> str | None:
    if not isinstance(want, torch.Tensor):
        if isinstance(got, torch.Tensor) or got != want:
            return f"{where}: {got!r} != {want!r}"
        return None
    if not isinstance(got, torch.Tensor):
        return f"{where}: got {type(got).__name__}, want a tensor"
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{where}: got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}"
    if torch.equal(bits(got), bits(want)):
        return None
    differ = bits(got) != bits(want)
    delta = (got.double() - want.double()).abs().max().item() if got.is_floating_point() else float("nan")
    return f"{where}: {int(differ.sum())} of {want.numel()} elements differ in bits (max |diff| {delta:.3g})"


def _plain_groups(groups: Any) -> Any:
    """param_groups with tuples as lists: torch's own set_optimizer_state_dict turns Adam's betas
    into a list, and the optimizers take either."""
    if isinstance(groups, (list, tuple)):
        return [_plain_groups(g) for g in groups]
    if isinstance(groups, dict):
        return {k: _plain_groups(v) for k, v in groups.items()}
    return groups


def state_diffs(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Every difference between two states in optimizer.state_dict() layout (bits, not values)."""
    out = []
    gm, wm = got["model"], want["model"]
    if set(gm) != set(wm):
        out.append(f"model keys: missing {sorted(set(wm) - set(gm))}, extra {sorted(set(gm) - set(wm))}")
    out += [d for k in wm if k in gm if (d := _tensor_diff(f"model[{k!r}]", gm[k], wm[k])) is not None]
    gs, ws = got["optimizer"]["state"], want["optimizer"]["state"]
    if set(gs) != set(ws):
        out.append(f"optimizer state params: got {sorted(gs)}, want {sorted(ws)}")
    for i in ws:
        if i not in gs:
            continue
        if set(gs[i]) != set(ws[i]):
            out.append(f"optimizer state[{i}] keys: got {sorted(gs[i])}, want {sorted(ws[i])}")
        out += [d for k in ws[i] if k in gs[i]
                if (d := _tensor_diff(f"optimizer state[{i}][{k!r}]", gs[i][k], ws[i][k])) is not None]
    if _plain_groups(got["optimizer"]["param_groups"]) != _plain_groups(want["optimizer"]["param_groups"]):
        out.append(f"param_groups: got {got['optimizer']['param_groups']}, want {want['optimizer']['param_groups']}")
    return out


def assert_same(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    diffs = state_diffs(got, want)
    assert not diffs, f"{where}:\n  " + "\n  ".join(diffs[:20])
