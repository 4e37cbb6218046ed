"""The library behind ``ldtools info`` and ``materialize``: :func:`ldformat.chain_info` and the
one atomic write (:mod:`ldformat.export.files`).

``ChainInfo.to_dict()`` is ``ldtools info --json``, byte for byte, for an ordinary chain, a
sharded one (a golden chain, spec §20 "Sharded chains") and with a mirror; a write that fails
half-way leaves the old file as it was and no temporary behind.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
from pathlib import Path
from typing import IO

import pytest
import torch
from clirun import invoke

import ldformat
from ldformat import ChainInfo, OutputWriteError, chain_info, save_step, write_output
from ldformat.export.files import WriteFailure, write_atomically

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
STEPS, ANCHOR_EVERY = 6, 4


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 6-step grad.dense chain, anchors at 0 and 4."""
    from models import build_grad_chain

    return Path(build_grad_chain(tmp_path_factory.mktemp("info") / "chain", steps=STEPS, anchor_every=ANCHOR_EVERY))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of a golden world-2 sharded chain."""
    source = GOLDEN / "1.3" / "sharded.grad.dense" / "chain"
    return Path(shutil.copytree(source, tmp_path_factory.mktemp("sharded") / "chain"))


def cli_json(*args: object) -> str:
    return invoke("info", *args, "--json").stdout


# -- chain_info ----------------------------------------------------------------------------------
def test_chain_info_of_an_ordinary_chain(chain: Path) -> None:
    info = chain_info(chain)
    assert isinstance(info, ChainInfo) and info.sharded is None and info.ordinary is not None
    assert (info.steps, info.first_step, info.latest_step) == (STEPS + 1, 0, STEPS)
    assert info.anchors == (0, ANCHOR_EVERY) and info.kind == "grad.dense" and info.optimizer == "torch.optim.AdamW"
    assert info.bytes_on_disk == info.ordinary.anchor_bytes + info.ordinary.delta_bytes + info.ordinary.log_bytes
    full = info.full_checkpoint
    # The latest step is not an anchor: it was replayed, and holds Adam's state.
    assert full.step == STEPS and full.error is None and full.optimizer_bytes and full.model_bytes
    assert full.bytes is not None and full.bytes > full.model_bytes + full.optimizer_bytes  # the header
    assert info.compression_vs_full_checkpoints == pytest.approx((STEPS + 1) * full.bytes / info.bytes_on_disk)
    assert info.mirror is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.steps = 0  # type: ignore[misc]


def test_to_dict_is_the_cli_json(chain: Path) -> None:
    info = chain_info(chain)
    assert json.dumps(info.to_dict(), indent=2) + "\n" == cli_json(chain)
    assert chain_info(ldformat.ChainReader(chain)).to_dict() == info.to_dict()  # a reader, or a path


def test_chain_info_with_a_mirror(chain: Path, tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    ldformat.sync(chain, mirror)
    info = chain_info(chain, mirror=str(mirror))
    assert info.mirror is not None
    assert (info.mirror.lag_records, info.mirror.lag_steps, info.mirror.ahead_records) == (0, 0, 0)
    assert info.mirror.lag_seconds == 0.0 and info.mirror.mirror_latest_step == STEPS
    assert json.dumps(info.to_dict(), indent=2) + "\n" == cli_json(chain, "--mirror", mirror)
    assert list(info.to_dict())[-1] == "mirror"


def test_chain_info_of_a_new_chain(tmp_path: Path) -> None:
    """Only the anchor the chain was created with: measured from it, without a replay."""
    from models import TinyNet

    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ldformat.ChainWriter.create(tmp_path / "chain", model, opt, kind="state.xor").close()
    info = chain_info(tmp_path / "chain")
    assert info.anchors == (0,) and info.latest_step == 0 and info.full_checkpoint.step == 0
    assert info.full_checkpoint.optimizer_bytes == 0  # written before the first optimizer step
    assert json.dumps(info.to_dict(), indent=2) + "\n" == cli_json(tmp_path / "chain")


def test_chain_info_of_a_sharded_chain(sharded: Path) -> None:
    info = chain_info(sharded)
    assert info.ordinary is None and info.sharded is not None
    parts = info.sharded
    assert parts.world_size == 2 and len(parts.bytes_per_rank) == 2
    assert info.bytes_on_disk == sum(parts.bytes_per_rank)
    assert info.steps == len(ldformat.open_reader(sharded).steps) > 0
    assert info.full_checkpoint.bytes and info.full_checkpoint.error is None
    assert json.dumps(info.to_dict(), indent=2) + "\n" == cli_json(sharded)
    rank0 = sharded / "ranks" / "00000"
    assert ldformat.sharded_parent(str(rank0)) == (str(sharded), 0)
    assert ldformat.sharded_world_size(str(sharded)) == 2 and ldformat.sharded_world_size(str(rank0)) is None
    assert chain_info(rank0).sharded is None  # one rank's chain is an ordinary chain


# -- the atomic write -----------------------------------------------------------------------------
class DiskFull(OSError):
    pass


def half_then_fail(tmp: str) -> None:
    with open(tmp, "wb") as f:
        f.write(b"partial")
    raise DiskFull(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    out = tmp_path / "state.pt"
    out.write_bytes(b"previous")
    seen: list[WriteFailure] = []
    with pytest.raises(DiskFull):
        write_atomically(out, half_then_fail, on_error=seen.append)
    assert out.read_bytes() == b"previous" and sorted(os.listdir(tmp_path)) == ["state.pt"]
    (failure,) = seen
    assert failure.created and failure.existed and failure.temporary_left is None
    assert isinstance(failure.error, DiskFull)


def test_an_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    out = tmp_path / "state.pt"
    out.write_bytes(b"previous")

    def interrupted(tmp: str) -> None:
        Path(tmp).write_bytes(b"part")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(out, interrupted)
    assert out.read_bytes() == b"previous" and os.listdir(tmp_path) == ["state.pt"]


def test_write_output_names_the_output_and_the_cause(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "x.bin"

    def fail(f: IO[bytes], tmp: str) -> None:
        half_then_fail(tmp)

    with pytest.raises(OutputWriteError) as raised:
        write_output(out, "step 3", fail)
    assert str(raised.value) == (f"{out}: cannot write step 3: {os.strerror(errno.ENOSPC)} [ENOSPC]; "
                                 "no file was written")
    assert raised.value.errno == errno.ENOSPC and os.listdir(tmp_path / "sub") == []
    def bug(f: IO[bytes], tmp: str) -> None:
        raise ZeroDivisionError("a bug")

    with pytest.raises(ZeroDivisionError):  # not an I/O failure: left as it is
        write_output(out, "step 3", bug)
    assert os.listdir(tmp_path / "sub") == []


def test_a_write_gets_the_umask_mode_and_its_size(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        size = write_atomically(tmp_path / "f", lambda tmp: Path(tmp).write_bytes(b"12345"))
        write_atomically(tmp_path / "d", lambda tmp: (Path(tmp) / "x").write_bytes(b""), directory=True)
    finally:
        os.umask(old)
    assert size == 5 and (tmp_path / "f").read_bytes() == b"12345"
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o750 and os.listdir(tmp_path / "d") == ["x"]
    assert sorted(os.listdir(tmp_path)) == ["d", "f"]


def test_a_failed_directory_write_leaves_nothing(tmp_path: Path) -> None:
    def fail(tmp: str) -> None:
        (Path(tmp) / "data").write_bytes(b"x")
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with pytest.raises(OSError):
        write_atomically(tmp_path / "out", fail, directory=True)
    assert os.listdir(tmp_path) == []


# -- a materialized step as a file -----------------------------------------------------------------
def test_save_step_writes_tied_weights_once(tmp_path: Path) -> None:
    import safetensors.torch

    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    state = {"model": {"head.weight": weight, "embed.weight": weight, "bias": torch.zeros(2)},
             "optimizer": {"state": {}, "param_groups": []}, "step": 3, "extra": {}}
    size = save_step(state, tmp_path / "m.safetensors", format="safetensors")
    assert size == (tmp_path / "m.safetensors").stat().st_size
    loaded = safetensors.torch.load_file(tmp_path / "m.safetensors")
    assert sorted(loaded) == ["bias", "embed.weight"]  # the first name in sorted order is kept
    from safetensors import safe_open

    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        assert f.metadata() == {"ldformat.step": "3", "head.weight": "embed.weight"}
    save_step(state, tmp_path / "m.pt")
    assert torch.load(tmp_path / "m.pt", weights_only=True)["step"] == 3
    assert sorted(os.listdir(tmp_path)) == ["m.pt", "m.safetensors"]


# -- validate(strict=True) -------------------------------------------------------------------------
def test_strict_validation_fails_when_nothing_was_compared(tmp_path: Path, chain: Path) -> None:
    from models import build_grad_chain

    one_anchor = build_grad_chain(tmp_path / "one", steps=3, anchor_every=100)
    report = ldformat.validate(one_anchor, strict=True)
    assert report.deep and not report.ok and not report.drift
    (problem,) = report.problems
    assert str(problem).endswith("validate again once the writer has stored a later anchor, or leave out --strict")
    assert "1 anchor, none reached" in str(problem)
    assert ldformat.validate(one_anchor, deep=True).ok
    strict = ldformat.validate(chain, strict=True)  # anchor 4 is reached from anchor 0
    assert strict.ok and len(strict.drift) == 1
