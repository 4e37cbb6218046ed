"""The optimizers of tests/capture/test_optimizer_matrix.py: every ``torch.optim`` class, every
``pytorch_optimizer`` optimizer and every ``timm.optim`` class that runs plainly on a small
model, and a few probe
optimizers whose state holds each kind of value a ``state_dict`` can hold.

Each :class:`Entry` builds its optimizer for a :class:`MatrixNet` and says how it is
stepped (with a closure, with a second-order backward). :func:`plain_failure` runs an
entry for a few steps without ldformat: an optimizer that fails there is no test of ldformat.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn


class MatrixNet(nn.Module):
    """A tiny MLP: 2-D weights (for Shampoo/SOAP/Muon-type optimizers), biases, a BatchNorm
    (buffers: running mean/var and an int64 counter) and a parameter without a gradient.

    ``hidden``: the width of the hidden layer. At 16 the model has 215 parameter elements and a
    16 x 16 preconditioner (a Kronecker factor of ``fc1.weight``) has 256: more than all
    parameters together, the slot bound of readers up to 1.6's (spec §10.3)."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, hidden)
        self.norm = nn.BatchNorm1d(hidden)
        self.fc2 = nn.Linear(hidden, 4)
        self.unused = nn.Parameter(torch.linspace(-1.0, 1.0, 3))  # optimized, never has a gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))

    def matrices(self) -> list[torch.Tensor]:
        return [self.fc1.weight, self.fc2.weight]

    def vectors(self) -> list[torch.Tensor]:
        return [self.fc1.bias, self.norm.weight, self.norm.bias, self.fc2.bias, self.unused]


MakeOptimizer = Callable[[MatrixNet], torch.optim.Optimizer]


def new_model(hidden: int = 8) -> MatrixNet:
    torch.manual_seed(0)
    return MatrixNet(hidden)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 6, generator=g), torch.randint(0, 4, (16,), generator=g)


@dataclass(frozen=True)
class Entry:
    """One optimizer of the matrix."""

    name: str
    family: str  # "torch.optim", "pytorch_optimizer", "timm" or "probe"
    make: MakeOptimizer
    closure: bool = False  # step(closure) runs forward and backward (LBFGS, SAM-type)
    loss_closure: bool = False  # backward first, then step(closure) where the closure returns the loss (AliG)
    create_graph: bool = False  # backward(create_graph=True) (Hessian-based optimizers)
    excluded: str | None = None  # why it is not run at all
    hidden: int = 8  # MatrixNet's hidden width

    def model(self) -> MatrixNet:
        return new_model(self.hidden)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, entry: Entry) -> None:
    """One training step as the optimizer's documentation asks for it."""
    model.train()
    x, y = batch(step)

    def closure() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward(create_graph=entry.create_graph)
        return loss

    if entry.closure:
        optimizer.step(closure)  # type: ignore[arg-type]  # torch types closures as returning float
    elif entry.loss_closure:
        loss = closure()
        optimizer.step(lambda: float(loss))
    else:
        closure()
        optimizer.step()
    if entry.create_graph:  # second-order gradients hold the graph: drop it
        optimizer.zero_grad(set_to_none=True)


def plain_failure(entry: Entry, steps: int = 3) -> str | None:
    """Why ``entry`` cannot train :class:`MatrixNet` plainly (no ldformat), or None if it can."""
    if entry.excluded is not None:
        return entry.excluded
    try:
        model = entry.model()
        opt = entry.make(model)
        if not isinstance(opt, torch.optim.Optimizer):
            return f"not a torch.optim.Optimizer ({type(opt).__name__})"
        for step in range(1, steps + 1):
            train_step(model, opt, step, entry)
        copy.deepcopy(opt.state_dict())
    except Exception as e:  # any failure excludes it: it is the optimizer's, not ldformat's
        return f"fails plainly: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    return None


# -- torch.optim ----------------------------------------------------------------------------
def _groups(model: MatrixNet, **matrix_options: Any) -> list[dict[str, Any]]:
    return [{"params": model.matrices(), **matrix_options}, {"params": model.vectors()}]


TORCH_OPTIM: list[Entry] = [
    Entry("SGD", "torch.optim", lambda m: torch.optim.SGD(m.parameters(), lr=0.05)),
    Entry("SGD-momentum-nesterov", "torch.optim",
          lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    Entry("SGD-dampening-maximize", "torch.optim",
          lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.5, dampening=0.1, maximize=True)),
    Entry("Adam", "torch.optim", lambda m: torch.optim.Adam(m.parameters(), lr=0.01)),
    Entry("Adam-amsgrad", "torch.optim",
          lambda m: torch.optim.Adam(m.parameters(), lr=0.01, amsgrad=True, weight_decay=0.01)),
    Entry("Adam-foreach", "torch.optim", lambda m: torch.optim.Adam(m.parameters(), lr=0.01, foreach=True)),
    Entry("Adam-tensor-lr", "torch.optim", lambda m: torch.optim.Adam(m.parameters(), lr=torch.tensor(0.01))),
    Entry("AdamW", "torch.optim", lambda m: torch.optim.AdamW(m.parameters(), lr=0.01)),
    Entry("AdamW-amsgrad-fused", "torch.optim",
          lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, amsgrad=True, fused=True)),
    Entry("Adamax", "torch.optim", lambda m: torch.optim.Adamax(m.parameters(), lr=0.01)),
    Entry("Adadelta", "torch.optim", lambda m: torch.optim.Adadelta(m.parameters())),
    Entry("Adagrad", "torch.optim",
          lambda m: torch.optim.Adagrad(m.parameters(), lr=0.01, lr_decay=0.01, initial_accumulator_value=0.1)),
    Entry("ASGD", "torch.optim", lambda m: torch.optim.ASGD(m.parameters(), lr=0.01, t0=2)),
    Entry("NAdam", "torch.optim", lambda m: torch.optim.NAdam(m.parameters(), lr=0.01)),
    Entry("NAdam-decoupled", "torch.optim",
          lambda m: torch.optim.NAdam(m.parameters(), lr=0.01, weight_decay=0.01, decoupled_weight_decay=True)),
    Entry("RAdam", "torch.optim", lambda m: torch.optim.RAdam(m.parameters(), lr=0.01)),
    Entry("RAdam-decoupled", "torch.optim",
          lambda m: torch.optim.RAdam(m.parameters(), lr=0.01, weight_decay=0.01, decoupled_weight_decay=True)),
    Entry("RMSprop", "torch.optim", lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01)),
    Entry("RMSprop-centered-momentum", "torch.optim",
          lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, centered=True, momentum=0.9)),
    Entry("Rprop", "torch.optim", lambda m: torch.optim.Rprop(m.parameters(), lr=0.01)),
    Entry("LBFGS", "torch.optim", lambda m: torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=3, history_size=4),
          closure=True),
    Entry("LBFGS-strong-wolfe", "torch.optim",
          lambda m: torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=3, line_search_fn="strong_wolfe"),
          closure=True),
    Entry("SparseAdam", "torch.optim", lambda m: torch.optim.SparseAdam(m.parameters()),
          excluded="sparse gradients only (nn.Embedding(sparse=True)); MatrixNet has dense gradients"),
]
if hasattr(torch.optim, "Muon"):  # Muon takes 2-D parameters only
    TORCH_OPTIM.append(Entry("Muon", "torch.optim", lambda m: torch.optim.Muon(m.matrices(), lr=0.02)))
if hasattr(torch.optim, "Adafactor"):
    TORCH_OPTIM.append(Entry("Adafactor", "torch.optim", lambda m: torch.optim.Adafactor(m.parameters(), lr=0.01)))


# -- pytorch_optimizer ----------------------------------------------------------------------
def _po_class(name: str) -> Any:
    import pytorch_optimizer

    return pytorch_optimizer.load_optimizer(name)


def _muon_groups(name: str, m: MatrixNet, **kwargs: Any) -> torch.optim.Optimizer:
    """The documented use of the Muon family: ``use_muon`` groups, AdamW for the vectors."""
    groups = [{"params": m.matrices(), "use_muon": True}, {"params": m.vectors(), "use_muon": False}]
    return _po_class(name)(groups, **kwargs)


# Documented required arguments or usage (pytorch_optimizer's docstrings).
_PO_SPECIAL: dict[str, dict[str, Any]] = {
    "ranger21": {"make": lambda m: _po_class("ranger21")(m.parameters(), num_iterations=100)},
    "magma": {"make": lambda m: _po_class("magma")(torch.optim.AdamW(m.parameters(), lr=0.01))},
    "muon": {"make": functools.partial(_muon_groups, "muon")},
    "adamuon": {"make": functools.partial(_muon_groups, "adamuon")},
    "normuon": {"make": functools.partial(_muon_groups, "normuon")},
    "adago": {"make": functools.partial(_muon_groups, "adago")},
    "muonclip": {"make": functools.partial(_muon_groups, "muonclip")},
    "spectralsphere": {"make": lambda m: _po_class("spectralsphere")(m.matrices())},
    "bsam": {"make": lambda m: _po_class("bsam")(m.parameters(), num_data=16), "closure": True},
    "alig": {"loss_closure": True},
    "adammini": {"make": lambda m: _po_class("adammini")(m)},
    "lbfgs": {"closure": True},
    "adahessian": {"create_graph": True},
    "sophiah": {"create_graph": True},
}

# Optimizers that cannot take part, whatever the model.
_PO_EXCLUDED: dict[str, str] = {
    "lomo": "takes the model and fuses the update into backward (no optimizer.step)",
    "adalomo": "takes the model and fuses the update into backward (no optimizer.step)",
    "distributedmuon": "needs an initialized torch.distributed process group",
    "demo": "exchanges momentum through torch.distributed",
}

def _po_entry(name: str) -> Entry:
    special = _PO_SPECIAL.get(name, {})
    if name in _PO_EXCLUDED:
        return Entry(name, "pytorch_optimizer", lambda m: _po_class(name)(m.parameters()),
                     excluded=_PO_EXCLUDED[name])
    make = special.get("make") or (lambda m: _po_class(name)(m.parameters()))
    return Entry(name, "pytorch_optimizer", make, closure=special.get("closure", False),
                 loss_closure=special.get("loss_closure", False), create_graph=special.get("create_graph", False))


def _not_built(model: MatrixNet) -> torch.optim.Optimizer:
    raise AssertionError("an excluded entry is never built")


@functools.cache
def pytorch_optimizer_entries() -> dict[str, Entry]:
    """Every optimizer ``pytorch_optimizer.get_supported_optimizers()`` lists, by its name there.

    A name that loads a ``torch.optim`` class (``adam``, ``sgd``, ...) is excluded: the
    torch.optim entries cover it.
    """
    try:
        import pytorch_optimizer
    except ImportError:
        return {}
    out = {}
    for name in pytorch_optimizer.get_supported_optimizers():
        try:
            cls = pytorch_optimizer.load_optimizer(name)
        except Exception as e:
            out[name] = Entry(name, "pytorch_optimizer", _not_built, excluded=f"does not load: {e}")
            continue
        if getattr(torch.optim, cls.__name__, None) is cls:
            out[name] = Entry(name, "pytorch_optimizer", _not_built,
                              excluded=f"is torch.optim.{cls.__name__} (covered by the torch.optim entries)")
            continue
        out[name] = _po_entry(name)
    return out


# -- timm ---------------------------------------------------------------------------------------
# timm's package __init__ imports torchvision (and PIL) for its models and data transforms; the
# torchvision wheels next to a CPU torch are CUDA builds that do not load. Its optimizers import
# only torch and each other, so their modules are loaded from timm/optim as a package of their
# own: the optimizer code is timm's, unchanged.
_TIMM_PACKAGE = "_timm_optim"

# Documented usage that differs from ``Class(model.parameters())``.
_TIMM_SPECIAL: dict[str, dict[str, Any]] = {
    "Lars": {"make": lambda cls, m: cls(m.parameters(), lr=0.05)},
    "SGDP": {"make": lambda cls, m: cls(m.parameters(), lr=0.05, momentum=0.9)},
    "SGDW": {"make": lambda cls, m: cls(m.parameters(), lr=0.05, momentum=0.9)},
    "Adahessian": {"create_graph": True},
    "Lookahead": {"make": lambda cls, m: cls(torch.optim.AdamW(m.parameters(), lr=0.01), k=2)},
}


def _timm_optim_modules() -> list[Any]:
    import importlib
    import importlib.util
    import os
    import sys
    import types

    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        return []
    where = os.path.join(list(spec.submodule_search_locations)[0], "optim")
    if _TIMM_PACKAGE not in sys.modules:
        package = types.ModuleType(_TIMM_PACKAGE)
        package.__path__ = [where]
        sys.modules[_TIMM_PACKAGE] = package
    names = sorted(f[:-3] for f in os.listdir(where)
                   if f.endswith(".py") and not f.startswith("_") and "factory" not in f)
    return [importlib.import_module(f"{_TIMM_PACKAGE}.{n}") for n in names]


@functools.cache
def timm_entries() -> dict[str, Entry]:
    """Every optimizer class of ``timm.optim``, by ``timm.<Class>``; empty without timm."""
    out = {}
    for module in _timm_optim_modules():
        for cls in vars(module).values():
            if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
                    and cls.__module__ == module.__name__):
                continue
            special = _TIMM_SPECIAL.get(cls.__name__, {})
            make = special.get("make", lambda c, m: c(m.parameters()))
            name = f"timm.{cls.__name__}"
            out[name] = Entry(name, "timm", functools.partial(make, cls),
                              create_graph=special.get("create_graph", False))
    return out


# -- preconditioners larger than the model ------------------------------------------------------
# Optimizers that keep matrices over a parameter's rows or columns: on MatrixNet(16) each holds
# more elements than all parameters together. One per way of storing them: blocks in lists of
# dicts (optimizer/ref/…, DASH), per-parameter tensors (optimizer/<i>/<key>, Shampoo), lists
# (SOAP). Kron, SPlus, Alice and timm's Kron keep them too (about 1 s each, timm's Kron 14 s).
_PRECONDITIONERS = ["dash", "shampoo", "soap"]
WIDE_HIDDEN = 16


@functools.cache
def preconditioner_entries() -> dict[str, Entry]:
    """The preconditioner optimizers of the zoo that are installed, on ``MatrixNet(16)``, as
    ``<name>@16``."""
    known = {**pytorch_optimizer_entries(), **timm_entries()}
    return {f"{n}@{WIDE_HIDDEN}": dataclasses.replace(known[n], name=f"{n}@{WIDE_HIDDEN}", hidden=WIDE_HIDDEN)
            for n in _PRECONDITIONERS if n in known}


# -- probes: one kind of state value each -------------------------------------------------------
class ProbeOptimizer(torch.optim.Optimizer):
    """SGD with momentum whose state holds more: per parameter (``per_param(index, step)``),
    at the top level of ``state`` (``top_level(step)``), as extra ``state_dict`` entries
    (``sd_extra(step)``) and in the param groups (``group_extra``). Its ``step`` is its own
    (no ``super().step()``), so the step hooks run once per step."""

    def __init__(self, params: Any, *, per_param: Callable[[int, int], dict[Any, Any]] | None = None,
                 top_level: Callable[[int], dict[Any, Any]] | None = None,
                 sd_extra: Callable[[int], dict[str, Any]] | None = None,
                 group_extra: dict[str, Any] | None = None, lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr, "momentum": 0.9, **copy.deepcopy(group_extra or {})})
        self._per_param, self._top_level, self._sd_extra = per_param, top_level, sd_extra
        self._steps = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._steps += 1
        params = [p for g in self.param_groups for p in g["params"]]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].get("momentum_buffer")
                if buf is None:
                    buf = self.state[p]["momentum_buffer"] = p.grad.detach().clone()
                else:
                    buf.mul_(group["momentum"]).add_(p.grad)
                p.add_(buf, alpha=-group["lr"])
        if self._per_param is not None:
            for i, p in enumerate(params):
                self.state[p].update(self._per_param(i, self._steps))  # {} leaves an empty state dict
        if self._top_level is not None:
            self.state.update(self._top_level(self._steps))
        return loss

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        if self._sd_extra is not None:
            sd.update(self._sd_extra(self._steps))
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        extra = set(self._sd_extra(0)) if self._sd_extra is not None else set()
        super().load_state_dict({k: v for k, v in state_dict.items() if k not in extra})


class SGDWithEMA(torch.optim.SGD):
    """The common subclassing pattern: ``step`` calls ``super().step()``, then updates more
    (tensor) state. Once any ``torch.optim.SGD`` has been constructed in the process, torch has
    wrapped ``SGD.step`` with the step hooks too, so they run twice per step: around
    ``super().step()`` and around the whole ``step``; only the outer pair sees the final state."""

    def __init__(self, params: Any) -> None:
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # as any other SGD in the process would
        super().__init__(params, lr=0.05, momentum=0.9)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    ema = self.state[p].setdefault("ema", torch.zeros_like(p))
                    ema.mul_(0.5).add_(p.detach(), alpha=0.5)
        return loss


class NoisySGD(torch.optim.Optimizer):
    """SGD whose update draws noise from generators of its own, kept as attributes outside
    ``state_dict()``: a ``torch.Generator`` (as timm's Adahessian does), a ``random.Random`` and
    a ``numpy.random.RandomState``. A resumed run continues exactly only if their states are
    recorded and restored (spec §19.2 ``optimizer_rng``)."""

    def __init__(self, params: Any, lr: float = 0.05, noise: float = 0.01) -> None:
        super().__init__(params, {"lr": lr, "noise": noise})
        self.generator = torch.Generator().manual_seed(7)
        self.coin = random.Random(11)
        self.legacy = np.random.RandomState(13)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                scale = self.coin.random() + float(self.legacy.random_sample())
                z = torch.randn(p.shape, generator=self.generator, dtype=p.dtype)
                drawn = self.state[p].setdefault("drawn", torch.zeros_like(p))
                drawn.add_(z)
                p.add_(p.grad + group["noise"] * scale * z, alpha=-group["lr"])
        return loss


def _dtypes_common(i: int, s: int) -> dict[str, Any]:
    base = torch.arange(4, dtype=torch.float64) * (i + 1) + s
    return {
        "f64": base.clone(), "f32": base.float(), "f16": base.half(), "bf16": base.bfloat16(),
        "i64": base.long(), "i32": base.int(), "i16": base.short(), "i8": base.to(torch.int8) - 3,
        "u8": base.to(torch.uint8), "bool": base.long() % 2 == 0,
        "neg_zero_nan": torch.tensor([-0.0, float("nan"), float("inf"), 0.0]) * (1 if s % 2 else -1),
        "scalar": torch.tensor(float(s)), "empty": torch.empty(0, 3),
        "noncontig": torch.arange(12.0).reshape(3, 4).t() + s,
    }


def _dtypes_complex(i: int, s: int) -> dict[str, Any]:
    base = torch.arange(4, dtype=torch.float64) * (i + 1) + s
    return {"c64": torch.complex(base.float(), -base.float())}


def _complex128(i: int, s: int) -> dict[str, Any]:
    # No safetensors code: the format refuses complex128 (spec §5.6.4).
    base = torch.arange(4, dtype=torch.float64) * (i + 1) + s
    return {"c128": torch.complex(base, base * 2)}


def _dtypes_exotic(i: int, s: int) -> dict[str, Any]:
    base = torch.arange(4, dtype=torch.float32) * (i + 1) + s
    return {"f8e4m3": base.to(torch.float8_e4m3fn), "f8e5m2": base.to(torch.float8_e5m2),
            "u16": base.to(torch.uint16), "u32": base.to(torch.uint32), "u64": base.to(torch.uint64)}


def _lazy_type_changes(i: int, s: int) -> dict[str, Any]:
    # LBFGS's 't' is an int at the first step and a float afterwards: types change over time.
    return {"t": 1 if s == 1 else 0.5 * s, "maybe": None if s % 2 else torch.tensor([float(s)]),
            "grows": [torch.full((2,), float(k)) for k in range(s)]}


def _only_some(i: int, s: int) -> dict[str, Any]:
    # Parameter 0 is MatrixNet.unused (the root module's own parameter comes first): no
    # gradient, so no momentum buffer, and an empty state dict.
    return {"x": torch.tensor([float(s)])} if i == 1 else {}


class _Opaque:
    """A value no format can store faithfully (an arbitrary object)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Opaque)

    __hash__ = object.__hash__


# One kind of value each, per parameter (``per_param(index, step)``).
_PER_PARAM: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "int": lambda i, s: {"n": s * 10 + i, "zero": 0, "neg": -s, "int64_max": 2**63 - 1},
    "float": lambda i, s: {"x": s / 3.0, "whole": float(s)},
    "float-special": lambda i, s: {"neg_zero": -0.0, "nan": float("nan"), "inf": float("inf") * (-1) ** s},
    "bool": lambda i, s: {"flag": s % 2 == 0},
    "none": lambda i, s: {"nothing": None},
    "str": lambda i, s: {"phase": f"phase-{s % 2}", "empty": "", "unicode": "\u00e9\u4e2d"},
    "dtype": lambda i, s: {"dtype": torch.float16 if s % 2 else torch.bfloat16},
    "tuple": lambda i, s: {"pair": (s, float(s)), "mixed": (None, "x", True), "empty": ()},
    "list": lambda i, s: {"nested": [[torch.full((2,), float(s))], [s, (i, s)], []], "empty": []},
    "dict": lambda i, s: {"d": {"a": s, "b": [None, True], 3: "int key"}},
    "types-change": _lazy_type_changes,
    "tensor-dtypes": _dtypes_common,
    "tensor-complex": _dtypes_complex,
    "tensor-float8-uint": _dtypes_exotic,
    "empty-param-state": _only_some,
}

PROBES: list[Entry] = [
    *(Entry(f"probe-{kind}", "probe", functools.partial(
        lambda m, f: ProbeOptimizer(m.parameters(), per_param=f), f=f)) for kind, f in _PER_PARAM.items()),
    Entry("probe-top-level-state", "probe", lambda m: ProbeOptimizer(
        m.parameters(), top_level=lambda s: {"global_step": s, "ema": torch.tensor([s / 7.0]), 42: (s, None)})),
    Entry("probe-state-dict-extra", "probe", lambda m: ProbeOptimizer(
        m.parameters(), sd_extra=lambda s: {"schedule": {"t": s, "warm": s < 3}, "version": "2"})),
    Entry("probe-subclass-calls-super-step", "probe", lambda m: SGDWithEMA(m.parameters())),
    Entry("probe-group-values", "probe", lambda m: ProbeOptimizer(
        m.parameters(), group_extra={"name": "all", "betas": (0.9, 0.99), "eps": (None, 1e-3), "flag": True,
                                     "count": 3, "nested": [[1, 2.0], (None,)]})),
    Entry("probe-group-dtype", "probe", lambda m: ProbeOptimizer(
        m.parameters(), group_extra={"compute_dtype": torch.bfloat16})),
    Entry("probe-private-generators", "probe", lambda m: NoisySGD(m.parameters())),
    # probe-group-int-enum is in UNSUPPORTABLE: an enum cannot come back as its class.
]


class _Norm(enum.IntEnum):
    """An int subclass as a hyperparameter (pytorch_optimizer's SCION ``norm_type``)."""

    AUTO = 1
    SPECTRAL = 2


# Not in the contract's list of supported values: refusal at construction is the right answer.
UNSUPPORTABLE: list[Entry] = [
    Entry("probe-group-int-enum", "probe", lambda m: ProbeOptimizer(
        m.parameters(), group_extra={"norm": _Norm.SPECTRAL})),
    Entry("probe-opaque-group-value", "probe",
          lambda m: ProbeOptimizer(m.parameters(), group_extra={"obj": _Opaque()})),
    Entry("probe-opaque-initial-state", "probe", lambda m: _with_state(ProbeOptimizer(m.parameters()), _Opaque())),
    Entry("probe-sparse-initial-state", "probe",
          lambda m: _with_state(ProbeOptimizer(m.parameters()), torch.eye(3).to_sparse())),
]


# Unsupportable state the constructor cannot see: it appears at step 2. Training may then fail,
# but loudly (an LdformatError from step() or close()), never silently.
UNSUPPORTABLE_LATER: list[Entry] = [
    Entry("probe-tensor-complex128", "probe", lambda m: ProbeOptimizer(m.parameters(), per_param=_complex128)),
    Entry("probe-opaque-later", "probe", lambda m: ProbeOptimizer(
        m.parameters(), per_param=lambda i, s: {"obj": _Opaque() if s >= 2 else None})),
]


def _with_state(opt: torch.optim.Optimizer, value: object) -> torch.optim.Optimizer:
    p = opt.param_groups[0]["params"][0]
    opt.state[p]["custom"] = value
    return opt


def generator_entries() -> dict[str, Entry]:
    """Optimizers that draw from generators of their own outside ``state_dict()``: the probe
    and, when timm is installed, its Adahessian (a ``torch.Generator``, Hutchinson probes)."""
    out = {"probe-private-generators": next(e for e in PROBES if e.name == "probe-private-generators")}
    timm = timm_entries()
    if "timm.Adahessian" in timm:
        out["timm.Adahessian"] = timm["timm.Adahessian"]
    return out
