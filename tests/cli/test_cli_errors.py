"""How ``ldtools`` fails: one line on stderr, no traceback, the exit codes of spec section 18.1.

0 success, 1 a problem with the chain, 2 a usage error or not a chain, 3 an output could not
be written, 4 the chain is locked, 70 an internal error, 130 interrupted or not confirmed,
141 a broken pipe. Driven in-process with click's CliRunner, and as real processes where the
operating system is part of the failure (a closed pipe, a file size limit, undecodable bytes).
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
from click.testing import CliRunner
from clirun import child_env, invoke, ldtools_cmd
from models import GRAD_CHAIN_ANCHOR_EVERY, GRAD_CHAIN_STEPS, TinyNet

import ldformat
import ldtools.cli
from ldformat import ChainReader, ChainWriter, errors
from ldformat.errors import ChainLockedError, FormatError, LockLostError
from ldtools.cli import cli

pytestmark = pytest.mark.filterwarnings(
    "ignore:Converting a tensor with requires_grad=True to a scalar:UserWarning"
)

STEPS = GRAD_CHAIN_STEPS
ANCHOR_EVERY = GRAD_CHAIN_ANCHOR_EVERY
COMMANDS: list[list[str]] = [
    ["info"], ["info", "--json"], ["log"], ["log", "--json"], ["validate"], ["validate", "--json"],
    ["compact", "--dry-run"], ["compact", "--dry-run", "--json"],
]


# -- helpers ---------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("LDTOOLS_DEBUG", raising=False)
    yield


def odd_dir(parent: Path, stem: str = "ch") -> Path:
    """A directory name holding the byte 0xff, which is not UTF-8 (skips where the OS refuses it)."""
    path = Path(os.fsdecode(os.fsencode(str(parent)) + b"/" + stem.encode() + b"\xffain"))
    try:
        path.mkdir()
    except (OSError, UnicodeError) as e:
        pytest.skip(f"the file system refuses non-UTF-8 names: {e}")
    return path


@pytest.fixture
def odd_chain(grad_chain_pristine: Path, tmp_path: Path) -> Path:
    """The chain, in a directory whose name has the byte 0xff."""
    path = odd_dir(tmp_path)
    path.rmdir()
    return Path(shutil.copytree(grad_chain_pristine, path))


def fails(code: int, *args: Any, names: tuple[str, ...] = (), env: dict[str, str] | None = None) -> str:
    """``ldtools args`` exits ``code`` with one line on stderr naming ``names``; returns that line."""
    result = invoke(*args, env=env, code=code)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ldtools: error: "), lines[0]
    assert result.stdout == "", result.stdout
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def anchor_file(chain: Path, step: int) -> Path:
    return next(p for p in (chain / "anchors").rglob(f"{step}-*") if p.is_file())


# -- 1. an output that cannot be written: exit 3, one line, no partial file --------------------
class FailingFile:
    """A binary file that takes ``limit`` bytes, then fails like a full or broken disk."""

    def __init__(self, f: Any, limit: int, code: int) -> None:
        self.f, self.limit, self.code, self.written = f, limit, code, 0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if self.written + n > self.limit:
            raise OSError(self.code, os.strerror(self.code))
        self.written += n
        return int(self.f.write(data))

    def flush(self) -> None:
        self.f.flush()


def fail_pt_write(monkeypatch: pytest.MonkeyPatch, code: int, watch: Path, seen: list[list[str]]) -> None:
    """torch.save really serializes, into a file that fails after 2 KiB."""
    real_save: Any = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        seen.append(files_in(watch))
        real_save(obj, FailingFile(f, 2048, code), *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def fail_safetensors_write(monkeypatch: pytest.MonkeyPatch, code: int, watch: Path,
                           seen: list[list[str]]) -> None:
    """safetensors writes half the file, then fails the way its Rust writer reports an OS error."""

    def save_file(tensors: Any, filename: Any, metadata: Any = None) -> None:
        seen.append(files_in(watch))
        data = safetensors.torch.save(tensors, metadata=metadata)
        with open(filename, "wb") as f:
            f.write(data[: len(data) // 2])
        raise safetensors.SafetensorError(
            f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})"
        )

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


FAILS = {".pt": fail_pt_write, ".safetensors": fail_safetensors_write}


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO], ids=["ENOSPC", "EIO"])
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
@pytest.mark.parametrize("existing", [False, True], ids=["new", "replace"])
def test_materialize_write_failure_mid_file(chain: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            code: int, suffix: str, existing: bool) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    target = out_dir / f"state{suffix}"
    if existing:
        target.write_bytes(b"previous")
    seen: list[list[str]] = []
    FAILS[suffix](monkeypatch, code, out_dir, seen)
    line = fails(3, "materialize", chain, "--step", 7, "-o", target, "--force",
                 names=(str(target), "step 7", os.strerror(code), errno.errorcode[code]))
    assert ("the existing file is unchanged" if existing else "no file was written") in line
    # The serializer wrote into a temporary file next to the target, not into the target ...
    assert len(seen) == 1, seen
    temps = [name for name in seen[0] if name != target.name]
    assert len(temps) == 1 and temps[0].startswith("."), seen
    # ... which is gone: no partial file, the old file untouched.
    assert files_in(out_dir) == (["state" + suffix] if existing else [])
    if existing:
        assert target.read_bytes() == b"previous"
    # Without the fault the same command writes the file (and only it).
    monkeypatch.undo()
    invoke("materialize", chain, "--step", 7, "-o", target, "--force")
    assert files_in(out_dir) == ["state" + suffix]


def test_materialize_fsync_or_rename_failure(chain: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "state.pt"
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", fsync)
    fails(3, "materialize", chain, "-o", target, names=(str(target), f"step {STEPS}", "[EIO]"))
    assert files_in(tmp_path) == ["chain"]
    monkeypatch.setattr(os, "fsync", real_fsync)

    def replace(src: Any, dst: Any) -> None:
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src), str(dst))

    monkeypatch.setattr(os, "replace", replace)
    fails(3, "materialize", chain, "-o", target, names=(str(target), "[EXDEV]"))
    assert files_in(tmp_path) == ["chain"]


@pytest.mark.procs
@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs RLIMIT_FSIZE and SIGXFSZ (POSIX)")
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_materialize_real_write_error_in_a_process(chain: Path, tmp_path: Path, suffix: str) -> None:
    """The kernel refuses the write half-way (file size limit, EFBIG), as a full disk would."""
    import resource

    target = tmp_path / "out" / f"state{suffix}"
    limit = 3000  # the output is ~6 KiB (safetensors) or ~17 KiB (.pt)

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run(ldtools_cmd("materialize", chain, "-o", target), capture_output=True, timeout=300,
                          env=child_env(), preexec_fn=limit_file_size)
    err = proc.stderr.decode()
    assert proc.returncode == 3, (proc.returncode, err)
    assert err.count("\n") == 1 and err.startswith("ldtools: error: ") and "Traceback" not in err, err
    assert str(target) in err and f"step {STEPS}" in err and os.strerror(errno.EFBIG) in err, err
    assert proc.stdout == b""
    assert files_in(target.parent) == []  # created the directory, left no partial file


def test_materialize_output_that_cannot_be_a_file(chain: Path, tmp_path: Path) -> None:
    """A target that is a directory, or under a regular file: exit 3 before any replay."""
    (tmp_path / "dir.pt").mkdir()
    fails(3, "materialize", chain, "-o", tmp_path / "dir.pt", names=(str(tmp_path / "dir.pt"), "[EISDIR]"))
    assert files_in(tmp_path / "dir.pt") == []
    (tmp_path / "file").write_bytes(b"x")
    fails(3, "materialize", chain, "-o", tmp_path / "file" / "x.pt", names=("[ENOTDIR]",))
    assert (tmp_path / "file").read_bytes() == b"x"
    # /dev/full is not a checkpoint name: a usage error, and the device is left alone.
    if os.path.exists("/dev/full"):
        fails(2, "materialize", chain, "-o", "/dev/full", names=("/dev/full", ".pt"))


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes anywhere")
def test_materialize_into_a_read_only_directory(chain: Path, tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        fails(3, "materialize", chain, "-o", ro / "x.pt", names=(str(ro / "x.pt"), "[EACCES]"))
    finally:
        ro.chmod(0o755)
    assert files_in(ro) == []


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_materialize_output_mode_honours_umask(chain: Path, tmp_path: Path, suffix: str, umask: int) -> None:
    old = os.umask(umask)
    try:
        invoke("materialize", chain, "-o", tmp_path / f"x{suffix}")
    finally:
        os.umask(old)
    assert (tmp_path / f"x{suffix}").stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.procs
@pytest.mark.skipif(sys.platform != "linux", reason="needs a /dev/full that fails writes")
@pytest.mark.parametrize("args", [["log"], ["info", "--json"]])
def test_stdout_on_a_full_device(chain: Path, args: list[str]) -> None:
    try:
        with open("/dev/full", "wb", buffering=0) as probe:
            probe.write(b"x")
        pytest.skip("/dev/full accepts writes here")
    except OSError as e:
        if e.errno != errno.ENOSPC:
            pytest.skip(f"/dev/full: {e}")
    with open("/dev/full", "wb") as full:
        proc = subprocess.run(ldtools_cmd(args[0], chain, *args[1:]), stdout=full, stderr=subprocess.PIPE,
                              timeout=300, env=child_env())
    err = proc.stderr.decode()
    assert proc.returncode == 3 and err.count("\n") == 1 and "standard output" in err and "[ENOSPC]" in err, err


@pytest.mark.procs
@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs RLIMIT_FSIZE and SIGXFSZ (POSIX)")
def test_stdout_to_a_file_that_cannot_grow(chain: Path, tmp_path: Path) -> None:
    """``ldtools log --json CHAIN > file`` where the write fails: exit 3, not a chain problem."""
    import resource

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))

    with open(tmp_path / "log.json", "wb") as f:
        proc = subprocess.run(ldtools_cmd("log", chain, "--json"), stdout=f, stderr=subprocess.PIPE,
                              timeout=300, env=child_env(), preexec_fn=limit_file_size)
    err = proc.stderr.decode()
    assert proc.returncode == 3, (proc.returncode, err)
    assert err.count("\n") == 1 and "standard output" in err and "[EFBIG]" in err and "Traceback" not in err, err


# -- 2. a closed stdout pipe: exit 141, nothing printed --------------------------------------
class ClosedPipe:
    """A text stdout whose reader has gone away."""

    encoding = "utf-8"
    errors = "strict"

    def write(self, s: str) -> int:
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        raise OSError(errno.EBADF, "no file descriptor")


def run_with_closed_stdout(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                           args: list[str]) -> tuple[int | str | None, str]:
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args=args, prog_name="ldtools")
    monkeypatch.undo()
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("args", [*COMMANDS, ["materialize", "-o", "{tmp}/x.pt"],
                                  ["truncate", "--after", "11", "--yes"], ["--help"], ["--version"], ["log", "--help"]],
                         ids=lambda a: " ".join(a))
def test_broken_pipe_is_quiet_141(chain: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    if args[0].startswith("-") or "--help" in args:
        argv = args
    else:
        argv = [args[0], str(chain), *[a.replace("{tmp}", str(tmp_path)) for a in args[1:]]]
    code, err = run_with_closed_stdout(monkeypatch, capsys, argv)
    assert code == 141, (code, err)
    assert err == "", err


@pytest.mark.procs
def test_broken_pipe_after_head_took_its_line(chain: Path) -> None:
    """``(echo first; ldtools log CHAIN) | head -n 1``: head has exited when ldtools writes."""
    if shutil.which("head") is None:
        pytest.skip("no head(1)")
    for args in (["log", chain], ["info", chain, "--json"]):
        read_end, write_end = os.pipe()
        head = subprocess.Popen(["head", "-n", "1"], stdin=read_end, stdout=subprocess.PIPE)
        os.close(read_end)
        os.write(write_end, b"first\n")
        assert head.communicate(timeout=60)[0] == b"first\n"  # head exited: the pipe has no reader
        proc = subprocess.Popen(ldtools_cmd(*args), stdout=write_end, stderr=subprocess.PIPE, env=child_env())
        os.close(write_end)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 141, (args, proc.returncode, err.decode())
        assert err == b"", err.decode()


@pytest.mark.procs
def test_pipe_into_head(chain: Path, tmp_path: Path) -> None:
    """A plain ``ldtools log CHAIN | head -n 1``: whichever way the race goes, quiet, and 0 or 141."""
    if shutil.which("bash") is None or shutil.which("head") is None:
        pytest.skip("no bash(1) or head(1)")
    for args in (["log", chain], ["log", chain, "--json"]):
        proc = subprocess.run(["bash", "-c", '"$@" 2>err.txt | head -n 1; exit ${PIPESTATUS[0]}', "bash",
                               *ldtools_cmd(*args)], capture_output=True, timeout=300, env=child_env(), cwd=tmp_path)
        assert proc.returncode in (0, 141), (proc.returncode, (tmp_path / "err.txt").read_text())
        assert proc.stdout.count(b"\n") == 1 and proc.stderr == b"", proc
        assert (tmp_path / "err.txt").read_bytes() == b""


# -- 3. paths with bytes that are not UTF-8 ---------------------------------------------------
def escaped(path: Path) -> str:
    """How ldtools prints a path with undecodable bytes: the bytes as \\xNN."""
    return os.fsencode(str(path)).decode("utf-8", "backslashreplace")


def test_undecodable_chain_path_in_process(odd_chain: Path, tmp_path: Path) -> None:
    shown = escaped(odd_chain)
    assert "\\xff" in shown
    out = invoke("info", odd_chain, code=None)
    assert out.exit_code == 0 and f"chain        {shown}  " in out.stdout, out.output
    assert json.loads(invoke("info", odd_chain, "--json").stdout)["path"] == str(odd_chain)  # lossless in JSON
    invoke("log", odd_chain)
    assert invoke("validate", odd_chain, code=None).stdout.startswith("ok: ")
    out_dir = odd_dir(tmp_path, "out")
    result = invoke("materialize", odd_chain, "--step", 5, "-o", out_dir / "x.pt", code=None)
    assert result.exit_code == 0 and f"to {escaped(out_dir / 'x.pt')} (" in result.stdout, result.output
    assert torch.load(out_dir / "x.pt", weights_only=True)["step"] == 5
    # Errors naming the path print too.
    fails(2, "info", odd_chain / "missing", names=(escaped(odd_chain / "missing"),))
    fails(1, "materialize", odd_chain, "--step", 99, "-o", out_dir / "y.pt", names=(shown, "step 99"))
    # A damaged chain: each problem line names the object under the odd directory.
    anchor = anchor_file(odd_chain, ANCHOR_EVERY)
    data = bytearray(anchor.read_bytes())
    data[len(data) // 2] ^= 0xFF
    anchor.write_bytes(bytes(data))
    result = invoke("validate", odd_chain, code=None)
    assert result.exit_code == 1, result.output
    assert escaped(anchor) in result.stdout and f"(step {ANCHOR_EVERY})" in result.stdout, result.stdout
    report = json.loads(invoke("validate", odd_chain, "--json", code=None).stdout)
    assert report["problems"][0]["path"] == str(anchor)
    fails(1, "materialize", odd_chain, "-o", out_dir / "z.pt", names=(escaped(anchor), f"step {ANCHOR_EVERY}"))


@pytest.mark.procs
def test_undecodable_chain_path_in_a_process(odd_chain: Path, tmp_path: Path) -> None:
    """With a strict stdout encoding (PYTHONIOENCODING), as under a UTF-8 locale."""
    encoding = "utf-8"
    env = child_env(PYTHONIOENCODING=encoding)
    anchor = anchor_file(odd_chain, ANCHOR_EVERY)
    data = bytearray(anchor.read_bytes())
    data[len(data) // 2] ^= 0xFF
    anchor.write_bytes(bytes(data))
    out_dir = odd_dir(tmp_path, "out")
    for args, code, names_path in ((["info", odd_chain], 0, True), (["log", odd_chain], 0, False),
                                   (["validate", odd_chain], 1, True),
                                   (["materialize", odd_chain, "--step", 5, "-o", out_dir / "x.pt"], 0, True),
                                   (["materialize", odd_chain, "-o", out_dir / "y.pt"], 1, True),
                                   (["log", odd_chain / "nothing"], 2, True)):
        proc = subprocess.run(ldtools_cmd(*args), capture_output=True, timeout=300, env=env)
        output = (proc.stdout + proc.stderr).decode(encoding)
        assert proc.returncode == code, (args, proc.returncode, output)
        assert "Traceback" not in output and "UnicodeEncodeError" not in output, output
        assert ("\\xff" in output) == names_path, output
    assert files_in(out_dir) == ["x.pt"]
    # A stdout that cannot encode anything but ASCII.
    proc = subprocess.run(ldtools_cmd("info", odd_chain), capture_output=True, timeout=300,
                          env=child_env(PYTHONIOENCODING="ascii"))
    assert proc.returncode == 0 and f"chain        {escaped(odd_chain)}  ".encode() in proc.stdout, proc


# -- 4. exit codes ----------------------------------------------------------------------------
def test_help_documents_every_exit_code() -> None:
    out = invoke("--help", code=None).stdout
    import re

    for code in ("0", "1", "2", "3", "4", "70", "130", "141"):
        assert re.search(rf"^ +{code} +[a-z]", out, re.MULTILINE), (code, out)
    assert "--debug" in out


def test_usage_errors_exit_2(chain: Path, tmp_path: Path) -> None:
    fails(2, "info", tmp_path / "nothing", names=(str(tmp_path / "nothing"),))
    fails(2, "materialize", chain, "-o", tmp_path / "x.txt", names=("x.txt",))
    result = invoke("materialize", chain, "--step", "seven", "-o", tmp_path / "x.pt", code=None)
    assert result.exit_code == 2 and "seven" in result.stderr
    assert invoke("frobnicate", code=None).exit_code == 2


def test_chain_problems_exit_1(chain: Path, tmp_path: Path) -> None:
    fails(1, "materialize", chain, "--step", 99, "-o", tmp_path / "x.pt", names=("step 99", str(chain)))
    fails(1, "truncate", chain, "--after", 99, "--yes", names=("step 99",))
    (chain / "ldformat.json").write_bytes(b"{not json")
    fails(1, "info", chain, names=("ldformat.json",))
    assert files_in(tmp_path) == ["chain"]


def test_format_error_exits_1(chain: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def malformed(path: Any, **kwargs: Any) -> Any:
        raise FormatError(f"{path}/log/00000003.json: not canonical JSON")

    monkeypatch.setattr(ldformat, "validate", malformed)
    fails(1, "validate", chain, names=("00000003.json",))


def test_step_is_named_when_the_library_error_lacks_it(chain: Path, tmp_path: Path) -> None:
    """The damaged object is the anchor of step 10; the user asked for step 12 (or the latest)."""
    anchor = anchor_file(chain, ANCHOR_EVERY)
    rel = anchor.relative_to(chain).as_posix()
    anchor.unlink()
    for args in (["--step", STEPS], []):
        line = fails(1, "materialize", chain, *args, "-o", tmp_path / "x.pt",
                     names=(rel, f"step {ANCHOR_EVERY}", f"while materializing step {STEPS}"))
        assert line.count(f"step {STEPS}") == 1, line
    # When the error already names the requested step, nothing is added.
    line = fails(1, "materialize", chain, "--step", ANCHOR_EVERY, "-o", tmp_path / "x.pt", names=(rel,))
    assert "while materializing" not in line, line


def test_io_error_on_the_chain_exits_1_naming_object_and_step(chain: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    def read_object(self: ChainReader, ref: Any, step: int | None = None, prefix: str = "") -> Any:
        raise OSError(errno.EIO, os.strerror(errno.EIO), f"{self.path}/{ref.path}")

    monkeypatch.setattr(ChainReader, "read_object", read_object)
    fails(1, "materialize", chain, "--step", 7, "-o", tmp_path / "x.pt",
          names=(f"{chain}/anchors/", "[EIO]", "while materializing step 7"))
    assert files_in(tmp_path) == ["chain"]


def test_locked_chain_exits_4(chain: Path) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    writer = ChainWriter.open(chain, model, opt)
    try:
        fails(4, "compact", chain, "--max-replay", 2, names=(str(chain), "locked"))
        fails(4, "truncate", chain, "--after", 5, "--yes", names=(str(chain), "locked"))
    finally:
        writer.close()
    assert ChainReader(chain).steps == list(range(STEPS + 1))
    invoke("truncate", chain, "--after", 5, "--yes")


@pytest.mark.parametrize("error", [ChainLockedError, LockLostError])
def test_lock_errors_exit_4(chain: Path, monkeypatch: pytest.MonkeyPatch, error: type[Exception]) -> None:
    def compact(path: Any, **kwargs: Any) -> Any:
        raise error(f"{path}: the writer lock was taken over by another process")

    monkeypatch.setattr(ldformat, "compact", compact)
    fails(4, "compact", chain, names=(str(chain), "taken over"))


def raise_in_info(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    def chain_info(reader: Any) -> Any:
        raise exc

    monkeypatch.setattr(ldtools.cli, "chain_info", chain_info)


def test_unexpected_exception_is_one_line_exit_70(chain: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raise_in_info(monkeypatch, ValueError("boom\nsecond line"))
    result = invoke("info", chain, env={"LDTOOLS_DEBUG": ""}, code=None)
    assert result.exit_code == 70, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ldtools: internal error: ValueError: boom second line"), lines
    assert "report" in lines[0] and "LDTOOLS_DEBUG=1" in lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.mark.parametrize("how", ["env", "option"])
def test_debug_prints_the_traceback_and_keeps_the_code(chain: Path, monkeypatch: pytest.MonkeyPatch,
                                                       how: str) -> None:
    raise_in_info(monkeypatch, ValueError("boom"))
    args: list[Any] = ["info", chain]
    result = CliRunner().invoke(cli, [str(a) for a in (["--debug", *args] if how == "option" else args)],
                                env={"LDTOOLS_DEBUG": "1" if how == "env" else ""})
    assert result.exit_code == 70, result.output
    assert "Traceback (most recent call last)" in result.stderr and "ValueError: boom" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("ldtools: internal error: ValueError: boom")
    # Debugging a chain error: the traceback, then the usual line and exit code.
    result = CliRunner().invoke(cli, ["--debug", "info", str(chain / "missing")])
    assert result.exit_code == 2 and "Traceback" in result.stderr, result.output


@pytest.mark.procs
def test_a_process_never_prints_a_traceback(chain: Path, tmp_path: Path) -> None:
    """A real process with an internal error: one line, exit 70; LDTOOLS_DEBUG=1 adds the traceback."""
    script = ("import sys, ldtools.cli as c\n"
              "def broken(reader):\n    raise RuntimeError('simulated bug')\n"
              "c.chain_info = broken\nsys.argv[0] = 'ldtools'\nc.main()\n")
    for debug in ("", "1"):
        proc = subprocess.run([sys.executable, "-c", script, "info", str(chain)], capture_output=True, timeout=300,
                              env=child_env(LDTOOLS_DEBUG=debug))
        err = proc.stderr.decode()
        assert proc.returncode == 70, (proc.returncode, err)
        assert err.strip().splitlines()[-1].startswith("ldtools: internal error: RuntimeError: simulated bug"), err
        if debug:
            assert "Traceback (most recent call last)" in err, err
        else:
            assert err.count("\n") == 1 and "Traceback" not in err, err


def test_interrupt_and_declined_confirmation_exit_130(chain: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(path: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(ldformat, "validate", interrupted)
    result = invoke("validate", chain, code=None)
    assert result.exit_code == 130 and result.stderr.strip() == "ldtools: interrupted", result.output
    monkeypatch.undo()

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", Terminal("n\n"))  # the user answers "n" at the prompt
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args=["truncate", str(chain), "--after", "5"], prog_name="ldtools")
    captured = capsys.readouterr()
    assert exit_info.value.code == 130, captured
    assert "remove 7 steps (6..12)?" in captured.out
    assert captured.err.strip() == "ldtools: aborted; nothing was changed"
    assert ChainReader(chain).steps == list(range(STEPS + 1))


def test_classify_maps_every_documented_error() -> None:
    from ldtools.cli import classify

    cases: list[tuple[BaseException, int]] = [
        (errors.CorruptChainError("c"), 1), (errors.FormatError("f"), 1), (errors.MissingObjectError("m"), 1),
        (errors.UnsupportedVersionError("u"), 1), (errors.StepNotFoundError("s"), 1),
        (errors.EmptyChainError("e"), 1), (errors.WriterIOError("w"), 1), (OSError(errno.EIO, "eio"), 1),
        (errors.NotAChainError("n"), 2), (errors.UsageError("u"), 2), (errors.OutputWriteError("o"), 3),
        (errors.ChainLockedError("l"), 4), (errors.LockLostError("l"), 4), (RuntimeError("r"), 70),
        (KeyboardInterrupt(), 130), (BrokenPipeError(errno.EPIPE, "p"), 141), (OSError(errno.EPIPE, "p"), 141),
    ]
    for exc, code in cases:
        assert classify(exc)[0] == code, (exc, classify(exc))
