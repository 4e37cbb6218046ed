"""``validate`` reporting no problem means every step materializes (spec §18).

Each example crafts a record that passes its checksum (recomputed with ``with_checksum``, and
the ``prev`` links after it re-linked) but holds something replay cannot use, and requires
that ``validate`` reports it and that ``materialize`` raises an ldformat error naming the
step instead of a raw exception. A hypothesis property then mutates valid records of real
chains of every kind at random and requires, for every mutation, that either ``validate``
reports a problem or every committed step materializes, and that no exception other than an
:class:`LdformatError` ever escapes either call.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import crash_writer as cw
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import TinyNet, train_step
from record_edit import edit_records, record_paths

import ldformat
from ldformat import ChainReader, ChainWriter, CorruptChainError, LdformatError
from ldformat.format.anchor import decode_anchor, encode_anchor
from ldformat.format.checksum import object_checksum, with_checksum

STEPS = 6
ANCHOR_EVERY = 3  # anchors 0, 3, 6
BATCH_STEPS = 2  # batches 1-2, 3, 4-5, 6
PROPERTY_CHAINS = (*cw.KINDS, "state.xor-compacted")


# -- chains ---------------------------------------------------------------------------------
_BUILT: dict[str, Path] = {}


def _build(name: str, root: Path) -> Path:
    """The chain of a kind; ``<kind>-compacted``: compacted after (a snapshot record, merged
    xor deltas, an anchor written by compaction)."""
    kind, _, compacted = name.partition("-")
    path = root / name
    model, optimizer, topk = cw.make_training(kind)
    with ChainWriter.create(path, model, optimizer, kind=kind, compressor=topk, batch_steps=BATCH_STEPS,
                            anchor_every=ANCHOR_EVERY) as writer:
        for step in range(1, STEPS + 1):
            cw.train(model, optimizer, topk, step)
            writer.record_step(step)
    if compacted:
        ldformat.compact(path, keep_every=2, max_replay=1)
    return path


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The valid chain of a kind, built once per module; never modified."""
    root = tmp_path_factory.mktemp("pristine")

    def get(kind: str) -> Path:
        if kind not in _BUILT:
            _BUILT[kind] = _build(kind, root)
        return _BUILT[kind]

    return get


def copy_of(pristine: Callable[[str], Path], kind: str, dst: Path) -> Path:
    target = dst / f"chain-{kind}"
    shutil.copytree(pristine(kind), target)
    return target


# -- crafting records -----------------------------------------------------------------------
def step_entry(docs: list[dict[str, Any]], step: int) -> dict[str, Any]:
    """The (newest) step entry of ``step``."""
    for doc in reversed(docs):
        for d in doc["deltas"]:
            for s in d["steps"]:
                if s["step"] == step:
                    return s
    raise KeyError(step)


def delta_entry(docs: list[dict[str, Any]], step: int) -> dict[str, Any]:
    for doc in reversed(docs):
        for d in doc["deltas"]:
            if any(s["step"] == step for s in d["steps"]):
                return d
    raise KeyError(step)


def anchor_entry(docs: list[dict[str, Any]], step: int) -> dict[str, Any]:
    for doc in reversed(docs):
        for a in doc["anchors"]:
            if a["step"] == step:
                return a
    raise KeyError(step)


def slot(docs: list[dict[str, Any]], step: int, name: str) -> dict[str, Any]:
    """The slot ``name`` of the batch holding ``step``."""
    return next(s for s in delta_entry(docs, step)["slots"] if s["name"] == name)


def edit_step(chain: Path, step: int, change: Callable[[dict[str, Any]], None]) -> None:
    edit_records(chain, lambda docs: change(step_entry(docs, step)))


def rewrite_anchor(chain: Path, step: int, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Rewrite the anchor object of ``step`` (``change`` edits its tensors) and its reference."""

    def edit(docs: list[dict[str, Any]]) -> None:
        ref = anchor_entry(docs, step)["object"]
        path = chain / ref["path"]
        tensors = {n: t.clone() for n, t in decode_anchor(path.read_bytes(), step, str(path)).items()}
        change(tensors)
        data = encode_anchor(tensors, step)
        path.write_bytes(data)
        ref["size"], ref["crc32c"] = len(data), object_checksum(ref["path"], data)

    edit_records(chain, edit)


def rewrite_root(chain: Path, change: Callable[[dict[str, Any]], None]) -> None:
    path = chain / "ldformat.json"
    doc = json.loads(path.read_bytes())
    change(doc)
    path.write_bytes(json.dumps(with_checksum(doc), sort_keys=True, indent=1).encode() + b"\n")


# -- what every example requires -------------------------------------------------------------
def materialize_all(chain: Path) -> dict[int, str]:
    """Materialize every committed step; {step: error message} of those that fail. Only
    ldformat errors may come out: anything else propagates and fails the test."""
    try:
        reader = ChainReader(chain)
    except LdformatError as e:
        return {-1: str(e)}
    failures = {}
    for step in reader.steps:
        try:
            reader.materialize(step)
        except LdformatError as e:
            failures[step] = str(e)
    return failures


def assert_reported(chain: Path, *names: str, failing: tuple[int, ...] = ()) -> ldformat.ValidationReport:
    """``validate`` reports a problem naming ``names``; materializing each step of ``failing``
    raises an ldformat error naming the step (and no step raises anything else)."""
    report = ldformat.validate(chain)
    assert not report.ok, "validate reported a chain that replay cannot use as valid"
    text = "\n".join(str(p) for p in report.problems)
    for name in names:
        assert name in text, (name, text)
    failures = materialize_all(chain)
    if -1 in failures:  # the log itself is refused: no step can be read, and the error names the record
        assert "log/" in failures[-1], failures[-1]
        return report
    for step in failing:
        assert step in failures, (step, failures)
        # The error names the step that fails: this one, or one its replay goes through.
        named = [int(n) for n in re.findall(r"step (\d+)", failures[step])]
        assert any(n <= step for n in named), failures[step]
    return report


def assert_readable(chain: Path) -> None:
    report = ldformat.validate(chain)
    assert report.ok, [str(p) for p in report.problems]
    assert materialize_all(chain) == {}


# -- the defects, one by one ------------------------------------------------------------------
@pytest.mark.parametrize("kind", PROPERTY_CHAINS)
def test_pristine_chains_validate_and_materialize(pristine: Callable[[str], Path], kind: str) -> None:
    assert_readable(pristine(kind))


def test_grad_slot_of_another_shape(pristine: Callable[[str], Path], tmp_path: Path) -> None:
    chain = copy_of(pristine, "grad.dense", tmp_path)  # embed.weight is [32, 16]: same count as [16, 32]
    edit_records(chain, lambda docs: slot(docs, 1, "grad/1").update(shape=[16, 32]))
    assert_reported(chain, "grad/1", failing=(1, 2))


def test_grad_slot_of_another_dtype(pristine: Callable[[str], Path], tmp_path: Path) -> None:
    chain = copy_of(pristine, "grad.topk", tmp_path)
    edit_records(chain, lambda docs: slot(docs, 4, "grad/2").update(dtype="int32"))
    assert_reported(chain, "grad/2", failing=(4, 5))


def test_hyperparameter_of_the_wrong_type(pristine: Callable[[str], Path], tmp_path: Path) -> None:
    chain = copy_of(pristine, "grad.dense", tmp_path)
    edit_step(chain, 4, lambda e: e["hyper"][0].update(lr="0.01"))
    assert_reported(chain, "'lr'", "step 4", failing=(4, 5))


def test_hyperparameter_missing(pristine: Callable[[str], Path], tmp_path: Path) -> None:
    chain = copy_of(pristine, "grad.dense", tmp_path)
    edit_step(chain, 5, lambda e: e["hyper"][0].pop("betas"))
    assert_reported(chain, "'betas'", failing=(5,))


def test_hyperparameter_out_of_the_optimizers_range(pristine: Callable[[str], Path], tmp_path: Path) -> None:
    # beta1 = 1 divides by 1 - beta1**step = 0 inside Adam's step (ZeroDivisionError).
    chain = copy_of(pristine, "grad.dense", tmp_path)
    edit_step(chain, 4, lambda e: e["hyper"][0].update(betas={"$tuple": [1.0, 0.999]}))
    assert_reported(chain, "ZeroDivisionError", failing=(4, 5))


def test_flag_that_needs_state_the_optimizer_lacks(pristine: Callable[[str], Path], tmp_path: Path) -> None:
    # amsgrad switched on after Adam's state was created without max_exp_avg_sq (KeyError in step).
    chain = copy_of(pristine, "grad.topk", tmp_path)
    edit_step(chain, 5, lambda e: e["hyper"][0].update(amsgrad=True))
    assert_reported(chain, "max_exp_avg_sq", failing=(5,))


def test_flag_the_replay_device_cannot_step(pristine: Callable[[str], Path], tmp_path: Path) -> None:
    chain = copy_of(pristine, "grad.dense", tmp_path)
    edit_step(chain, 1, lambda e: e["hyper"][0].update(capturable=True))
    assert_reported(chain, "capturable", failing=(1, 2))


def test_hyperparameters_holding_params(pristine: Callable[[str], Path], tmp_path: Path) -> None:
    chain = copy_of(pristine, "grad.dense", tmp_path)
    edit_step(chain, 2, lambda e: e["hyper"][0].update(params=[0, 1, 2, 3, 4, 5]))
    assert_reported(chain, "'params'", failing=(2,))


@pytest.mark.parametrize("kind", ["grad.dense", "state.xor"])
def test_hyperparameters_on_a_step_without_an_optimizer_step(pristine: Callable[[str], Path], tmp_path: Path,
                                                             kind: str) -> None:
    chain = copy_of(pristine, kind, tmp_path)
    hyper = [{"lr": 0.5}]

    def change(e: dict[str, Any]) -> None:
        e["stepped"] = False if kind == "grad.dense" else e["stepped"]
        e["hyper"] = e["hyper"] if kind == "grad.dense" else hyper

    edit_step(chain, 4, change)
    assert_reported(chain, "hyper", failing=(4, 5))


@pytest.mark.parametrize("where", ["param_groups", "hyper-less anchor"])
def test_param_index_out_of_range(pristine: Callable[[str], Path], tmp_path: Path, where: str) -> None:
    chain = copy_of(pristine, "grad.dense", tmp_path)
    if where == "param_groups":
        edit_step(chain, 2, lambda e: e["param_groups"][0].update(params=[0, 1, 2, 3, 4, 99]))
        assert_reported(chain, "params", failing=(2,))
    else:  # the anchor's groups build the optimizer of the replay from it
        edit_records(chain, lambda docs: anchor_entry(docs, 3)["param_groups"][0].update(params=[0, 1, 2, 3, 4, 99]))
        assert_reported(chain, "params", failing=(3, 4, 5))


def test_grad_slot_of_no_parameter(pristine: Callable[[str], Path], tmp_path: Path) -> None:
    chain = copy_of(pristine, "grad.dense", tmp_path)
    edit_records(chain, lambda docs: slot(docs, 1, "grad/5").update(name="grad/99"))
    assert_reported(chain, "grad/99", failing=(1, 2))


@pytest.mark.parametrize("name", ["torch.optim.Adamm", "torch.optim.LBFGS", "torch.optim.SparseAdam",
                                  "torch.optim.Optimizer", "torch.optim.lr_scheduler", "mypackage.Lion"])
def test_optimizer_class_that_replay_cannot_rebuild(pristine: Callable[[str], Path], tmp_path: Path,
                                                     name: str) -> None:
    chain = copy_of(pristine, "grad.dense", tmp_path)
    rewrite_root(chain, lambda d: d["schema"]["optimizer"].update({"class": name}))
    report = assert_reported(chain, "ldformat.json", name)
    failures = materialize_all(chain)
    assert 0 not in failures and 3 not in failures  # anchors need no replay
    assert 1 in failures and name in failures[1]
    assert report.problems[0].path.endswith("ldformat.json")


@pytest.mark.parametrize("place", ["hyper", "extra"])
def test_bad_float_tag(pristine: Callable[[str], Path], tmp_path: Path, place: str) -> None:
    chain = copy_of(pristine, "grad.dense", tmp_path)
    if place == "hyper":
        edit_step(chain, 4, lambda e: e["hyper"][0].update(lr={"$float": "fast"}))
        assert_reported(chain, "$float", failing=(4, 5))
    else:
        edit_step(chain, 5, lambda e: e["extra"].update(lr={"$float": "1.5"}))
        assert_reported(chain, "$float", failing=(5,))


def test_extra_that_is_not_a_dict(pristine: Callable[[str], Path], tmp_path: Path) -> None:
    chain = copy_of(pristine, "state.xor", tmp_path)
    edit_step(chain, 2, lambda e: e.update(extra={"$tuple": [1, 2]}))
    assert_reported(chain, "extra", failing=(2,))


def test_residual_of_the_wrong_rank(pristine: Callable[[str], Path], tmp_path: Path) -> None:
    # A residual is the flattened gradient (spec §14): a 2-D one would break TopK on resume.
    chain = copy_of(pristine, "grad.topk", tmp_path)
    name = "compressor/hidden.weight"
    rewrite_anchor(chain, 3, lambda t: t.update({name: t[name].reshape(16, 16)}))
    assert_reported(chain, "compressor/hidden.weight", failing=(3,))


def test_residual_of_another_dtype_or_parameter(pristine: Callable[[str], Path], tmp_path: Path) -> None:
    chain = copy_of(pristine, "grad.topk", tmp_path)

    def change(t: dict[str, torch.Tensor]) -> None:
        t["compressor/no.such.parameter"] = t.pop("compressor/hidden.bias")

    rewrite_anchor(chain, 6, change)
    assert_reported(chain, "no.such.parameter", failing=(6,))


@pytest.mark.parametrize("name", ["compressor@01/hidden.bias", "compressor@0/hidden.bias",
                                  "compressor@one/hidden.bias", "compressor@1", "optimizer/1", "optimizer/99/step",
                                  "extra/x"])
def test_malformed_stored_names(pristine: Callable[[str], Path], tmp_path: Path, name: str) -> None:
    chain = copy_of(pristine, "grad.topk", tmp_path)
    rewrite_anchor(chain, 3, lambda t: t.update({name: torch.zeros(16)}))
    assert_reported(chain, name, failing=(3,))


def test_residuals_of_a_single_rank_above_zero_are_returned(pristine: Callable[[str], Path],
                                                            tmp_path: Path) -> None:
    # Spec §11.7 / §14.1: compressor_ranks is returned whenever a rank >= 1 has residuals,
    # even if rank 0 has none (it used to need two ranks, and dropped rank 1's silently).
    chain = copy_of(pristine, "grad.topk", tmp_path)

    def to_rank_1(t: dict[str, torch.Tensor]) -> None:
        for name in [n for n in t if n.startswith("compressor/")]:
            t["compressor@1/" + name[len("compressor/"):]] = t.pop(name)

    rewrite_anchor(chain, 3, to_rank_1)
    assert_readable(chain)
    state = ChainReader(chain).materialize(3)
    assert state["compressor"] == {}
    assert sorted(state["compressor_ranks"]) == [0, 1]
    assert state["compressor_ranks"][0] == {}
    assert "hidden.weight" in state["compressor_ranks"][1]
    assert "compressor_ranks" not in ChainReader(chain).materialize(6)  # rank 0 only


@pytest.mark.parametrize("depth", [30, 200])
def test_deep_nesting(pristine: Callable[[str], Path], tmp_path: Path, depth: int) -> None:
    chain = copy_of(pristine, "state.xor", tmp_path)
    nested: Any = 1
    for _ in range(depth):
        nested = [nested]
    edit_step(chain, 5, lambda e: e["extra"].update(deep=nested))
    if depth < 50:  # within the nesting limit of records (spec §6.4): valid, and read back
        assert_readable(chain)
        value = ChainReader(chain).materialize(5)["extra"]["deep"]
        for _ in range(depth):
            value = value[0]
        assert value == 1
    else:
        assert_reported(chain, "nested", failing=(5,))


def test_unexpected_failure_inside_replay_names_the_step(pristine: Callable[[str], Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The last line of defence: what the checks did not foresee still comes out as
    CorruptChainError naming the step, never as a raw exception."""
    import ldformat.format.replay as replay

    def broken(*args: Any, **kwargs: Any) -> None:
        raise IndexError("boom")

    monkeypatch.setattr(replay, "apply_state_delta", broken)
    with pytest.raises(CorruptChainError, match=r"deltas/1-2-[0-9a-f]+ \(step 1\).*IndexError: boom"):
        ChainReader(pristine("state.xor")).materialize(2)
    monkeypatch.setattr(replay.Replayer, "result", broken)
    with pytest.raises(CorruptChainError, match=r"step 3\).*IndexError: boom"):
        ChainReader(pristine("state.xor")).materialize(3)


# -- valid chains stay valid -------------------------------------------------------------------
def _optimizers() -> Iterator[tuple[str, Callable[[list[Any]], torch.optim.Optimizer]]]:
    yield "sgd-nesterov", lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
    yield "adamw-amsgrad", lambda g: torch.optim.AdamW(g, lr=1e-2, amsgrad=True)
    yield "rmsprop-centered", lambda g: torch.optim.RMSprop(g, lr=1e-3, centered=True, momentum=0.5)
    yield "adagrad", lambda g: torch.optim.Adagrad(g, lr=1e-2)
    yield "nadam", lambda g: torch.optim.NAdam(g, lr=1e-2)
    yield "adam-foreach", lambda g: torch.optim.Adam(g, lr=1e-2, foreach=True)
    yield "adafactor", lambda g: torch.optim.Adafactor(g, lr=1e-2)
    yield "asgd", lambda g: torch.optim.ASGD(g, lr=1e-2, t0=3)
    yield "rprop", lambda g: torch.optim.Rprop(g, lr=1e-2)
    yield "radam-decoupled", lambda g: torch.optim.RAdam(g, lr=1e-2, decoupled_weight_decay=True)
    yield "adamax", lambda g: torch.optim.Adamax(g, lr=1e-2)
    yield "adadelta", lambda g: torch.optim.Adadelta(g)


@pytest.mark.parametrize("name,make", list(_optimizers()), ids=[n for n, _ in _optimizers()])
def test_valid_chains_of_other_optimizers_groups_and_schedulers(tmp_path: Path, name: str,
                                                                make: Callable[[list[Any]], Any]) -> None:
    """No false report: two param groups, a scheduler (which adds initial_lr to the groups),
    steps the optimizer skipped, compaction (new anchors, dropped steps)."""
    torch.manual_seed(0)
    model = TinyNet()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    optimizer = make([{"params": decay}, {"params": rest, "weight_decay": 0.0}])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    path = tmp_path / "chain"
    with ChainWriter.create(path, model, optimizer, kind="grad.dense", batch_steps=2, anchor_every=4) as writer:
        for step in range(1, 8):
            if step == 5:  # a step without an optimizer step (e.g. GradScaler found inf)
                writer.record_step(step)
                continue
            train_step(model, optimizer, step, scheduler=scheduler)
            writer.record_step(step)
    assert_readable(path)
    ldformat.compact(path, keep_every=2, max_replay=1)
    assert_readable(path)


def test_compacted_xor_chain_stays_valid(pristine: Callable[[str], Path], tmp_path: Path) -> None:
    chain = copy_of(pristine, "state.xor", tmp_path)
    ldformat.compact(chain, keep_last=3, max_replay=2)  # merged xor deltas
    assert_readable(chain)


# -- the property ------------------------------------------------------------------------------
def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every place in a JSON document (keys and indices from the top)."""
    yield prefix
    if isinstance(doc, dict):
        for k in sorted(doc):
            yield from _paths(doc[k], (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*prefix, i))


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        doc = doc[k]
    return doc


_DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64", "complex64"]
_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70), st.sampled_from([2**31, 2**63 - 1, -(2**63)]),
    st.floats(allow_nan=False, allow_infinity=False, width=64), st.sampled_from([0.0, 1.0, -1.0, 0.5, 1e308]),
    st.sampled_from(["", "x", "lr", "params", "grad/0", "grad/99", "model/hidden.weight", "optimizer/0/step",
                     "optimizer/x/exp_avg", "sparse", "dense", "xor", *_DTYPES]),
)
_TAGGED = st.one_of(
    st.builds(lambda v: {"$float": v}, st.sampled_from(["nan", "inf", "-inf", "fast", "1.5", "+inf"])),
    st.builds(lambda v: {"$tuple": v}, st.lists(_SCALARS, max_size=3) | _SCALARS),
    st.builds(lambda v: {"$items": v}, st.lists(st.lists(_SCALARS, min_size=1, max_size=3), max_size=2)),
    st.builds(lambda v: {"$bytes": v}, st.sampled_from(["", "AAAA", "A", "!!"])),
    st.builds(lambda d, s, x: {"$tensor": {"dtype": d, "shape": s, "data": x}}, st.sampled_from(_DTYPES),
              st.lists(st.integers(0, 3), max_size=2), st.sampled_from(["", "AAAA", "AAAAAAAAAAA="])),
    st.builds(lambda k: {k: 1}, st.sampled_from(["$x", "$float", "must_understand"])),
)
_VALUES = st.recursive(_SCALARS | _TAGGED, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.sampled_from(["lr", "params", "x", "$y", "step"]), inner, max_size=3),
                       max_leaves=6)


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


@st.composite
def mutations(draw: st.DrawFn, doc: dict[str, Any]) -> tuple[tuple[Any, ...], str, Any]:
    """A place in a record (not its checksum, which is recomputed) and what to do there."""
    places = [p for p in _paths(doc) if p and p[0] not in ("checksum", "prev", "seq")]
    # Mostly the parts replay interprets beyond their JSON types: hyperparameters, param
    # groups, extra state and slots.
    semantic = [p for p in places if any(k in p for k in ("hyper", "param_groups", "extra", "slots"))]
    place = draw(st.sampled_from(semantic if semantic and draw(st.integers(0, 9)) < 7 else places))
    current = _get(doc, place)
    ops = ["replace", "delete", "nest"]
    if isinstance(current, dict):
        ops.append("add")
    if isinstance(current, bool):
        ops += ["flip", "flip"]
    elif isinstance(current, int):
        ops.append("shift")
    elif isinstance(current, float):
        ops += ["scale", "scale"]
    if isinstance(current, str) and current in _DTYPES:
        ops.append("dtype")
    if isinstance(current, list) and all(isinstance(x, int) for x in current):
        ops.append("shape")
    if isinstance(current, str) and "/" in current:
        ops.append("rename")
    op = draw(st.sampled_from(ops))
    if op == "replace":
        arg: Any = draw(_VALUES)
    elif op == "add":
        arg = (draw(st.sampled_from(["params", "lr", "amsgrad", "foo", "$x", "initial_lr"])), draw(_VALUES))
    elif op == "nest":
        arg = draw(st.integers(1, 80))
    elif op == "shift":
        arg = draw(st.sampled_from([-1, 1, 2, 7, 100, -current - 1]))
    elif op == "scale":
        arg = draw(st.sampled_from([0.0, -1.0, 1.1, 2.0, 1e300, 1e-300]))
    elif op == "dtype":
        arg = draw(st.sampled_from(_DTYPES))
    elif op == "shape":
        arg = draw(st.sampled_from(["reverse", "append", "drop", "double"]))
    elif op == "rename":
        arg = draw(st.sampled_from(["grad/0", "grad/5", "grad/6", "grad/01", "model/hidden.weight", "model/nope",
                                    "optimizer/0/exp_avg", "optimizer/9/exp_avg", "compressor/hidden.weight"]))
    else:
        arg = None
    return place, op, arg


def _mutate(doc: dict[str, Any], place: tuple[Any, ...], op: str, arg: Any) -> None:
    parent = _get(doc, place[:-1])
    key = place[-1]
    current = parent[key]
    if op == "replace":
        parent[key] = arg
    elif op == "delete":
        del parent[key]
    elif op == "nest":
        parent[key] = _nested(arg) if arg > 40 else [current] if arg % 2 else {"x": current}
    elif op == "add":
        current[arg[0]] = arg[1]
    elif op == "flip":
        parent[key] = not current
    elif op == "shift":
        parent[key] = current + arg
    elif op == "scale":
        parent[key] = current * arg
    elif op == "dtype":
        parent[key] = arg
    elif op == "shape":
        parent[key] = {"reverse": current[::-1], "append": [*current, 1], "drop": current[:-1],
                       "double": [d * 2 for d in current]}[arg]
    elif op == "rename":
        parent[key] = arg


def check_mutation(pristine: Callable[[str], Path], kind: str, data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        chain = copy_of(pristine, kind, Path(tmp))
        paths = record_paths(chain)
        seq = data.draw(st.integers(0, len(paths) - 1), label="record")
        doc = json.loads(paths[seq].read_bytes())
        place, op, arg = data.draw(mutations(doc), label="mutation")

        def change(docs: list[dict[str, Any]]) -> None:
            _mutate(docs[seq], place, op, arg)

        edit_records(chain, change)
        report = ldformat.validate(chain)  # only LdformatError may escape (NotAChainError cannot here)
        failures = materialize_all(chain)
        if report.ok:
            assert failures == {}, f"validate reported no problem, yet these steps fail: {failures}"


SETTINGS = dict(derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.filter_too_much, HealthCheck.data_too_large])


@pytest.mark.parametrize("kind", PROPERTY_CHAINS)
@settings(max_examples=40, **SETTINGS)  # type: ignore[arg-type]
@given(data=st.data())
def test_mutated_records_are_reported_or_materialize(pristine: Callable[[str], Path], kind: str,
                                                     data: st.DataObject) -> None:
    check_mutation(pristine, kind, data)


@pytest.mark.slow
@pytest.mark.parametrize("kind", PROPERTY_CHAINS)
@settings(max_examples=1500, **SETTINGS)  # type: ignore[arg-type]
@given(data=st.data())
def test_mutated_records_are_reported_or_materialize_long(pristine: Callable[[str], Path], kind: str,
                                                          data: st.DataObject) -> None:
    check_mutation(pristine, kind, data)
