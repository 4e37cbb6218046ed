"""Recovery (materialize anchor + K deltas) and scaling (model size, chain length).

Chains here are written by :class:`ldformat.Checkpointer` from the workload model trained on
*cheap* batches (fewer tokens per step): replay cost (decode + optimizer step) and delta
sizes depend on the model, not on how many tokens produced the gradient, and this keeps the
full benchmark inside its hour. The batch used is stated in every table.
"""

from __future__ import annotations

import dataclasses
import gc
import shutil
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from .stats import human_bytes, table, verdict
from .storage import chain_bytes, full_checkpoint_bytes
from .workload import ModelSize, Trainer, n_params

MODES = {"lowdiff": "grad.topk", "lowdiff+": "grad.dense", "xor": "state.xor"}


def timed(fn: Any, *, reps: int = 3, budget_s: float = 30.0) -> dict[str, Any]:
    """Median wall time of ``fn`` (at least one run; at most ``reps`` or until ``budget_s``),
    and cores used (process CPU time / wall time)."""
    walls, cpus = [], []
    spent = 0.0
    for _ in range(reps):
        gc.collect()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
        walls.append(wall)
        cpus.append(time.process_time() - c0)
        spent += wall
        if spent > budget_s:
            break
    return {"median_s": statistics.median(walls), "runs": walls, "cores": statistics.median(
        c / w for c, w in zip(cpus, walls, strict=True) if w > 0)}


def read_through(path: Path) -> None:
    """Read every file under ``path`` (or ``path`` itself) once, so that it is in the page cache."""
    for f in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def build_chain(size: ModelSize, data: ModelSize, mode: str, steps: int, chain: Path, *, batch_steps: int,
                keep_full: Path | None = None, recover_into: bool = False) -> dict[str, Any]:
    """Train ``steps`` steps with a Checkpointer (anchor at chain step 0, no other anchor)."""
    from ldformat import Checkpointer, TopK

    from .peers import batch_steps_for

    shutil.rmtree(chain, ignore_errors=True)
    batch_steps = batch_steps_for(size, mode, batch_steps, divides=False)  # batches within 1 GiB
    compressor = TopK(0.01) if mode == "lowdiff" else None
    trainer = Trainer(size, compressor=compressor, data=data)
    trainer.prefetch(1, 2)
    for _ in range(2):
        trainer.step()  # AdamW state exists in the anchor
    trainer.prefetch(3, steps)
    ck = Checkpointer(chain, trainer.model, trainer.optimizer, mode=mode, anchor_every=10**9, batch_steps=batch_steps,
                      compressor=compressor, compress=compressor is None)
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.step()
    train_s = time.perf_counter() - t0
    out: dict[str, Any] = {"train_s": train_s, "steps": steps, "batch_steps": batch_steps}
    if recover_into and mode == "lowdiff+":
        other = Trainer(size, data=data)
        out["in_memory_recover_s"] = timed(lambda: ck.recover(other.model, other.optimizer), reps=3)["median_s"]
        del other
    ck.close()
    live = {"model": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            "optimizer": _clone(trainer.optimizer.state_dict())}
    if keep_full is not None:
        torch.save(trainer.state_dict(), keep_full)
    out["live"] = live
    out["trainer"] = trainer
    return out


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def bit_exact(state: dict[str, Any], live: dict[str, Any]) -> bool:
    def iv(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().contiguous()
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])

    for k, v in live["model"].items():
        if not torch.equal(iv(state["model"][k]), iv(v)):
            return False
    for i, st in live["optimizer"]["state"].items():
        for key, v in st.items():
            if not torch.equal(iv(state["optimizer"]["state"][i][key]), iv(v)):
                return False
    return True


def optimizer_step_time(trainer: Trainer, reps: int = 5) -> float:
    """Median time of one AdamW step with dense gradients already set (no forward/backward)."""
    opt = trainer.optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    g = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    for p in params:
        p.grad = None
    return statistics.median(times)


def replay_steps_only_s(chain: Path, k: int, reps: int) -> float:
    """The K optimizer steps of a replay on their own: the same anchor state and the same
    recorded gradients, decoded into memory beforehand (untimed); only the steps are timed.

    This is the irreducible work of a gradient replay (an AdamW step's cost depends on the
    state it runs on, e.g. top-k gradients leave most moments at zero), so materialize is
    compared against torch.load + this.
    """
    from ldformat import ChainReader

    reader = ChainReader(chain)
    anchor_step, path = reader.state.replay_path(k)
    anchor = reader.load_anchor_tensors(anchor_step)
    times = []
    for _ in range(reps):
        replayer = reader.start_replay(anchor_step)
        replayer.tensors = {n: t.clone() for n, t in anchor.items()}
        gc.collect()
        spent = 0.0
        batch: Any = None
        batch_path = None
        for s in path:  # one decoded batch in memory at a time; decoding is not timed
            entry, step_entry = reader.state.deltas[s]
            if entry.path != batch_path:
                batch, batch_path = None, entry.path
                batch = reader.load_batch(entry, s)
            row, slots = batch.row(step_entry.row), {slot.name: slot for slot in entry.slots}
            t0 = time.perf_counter()
            replayer.apply_grad_step(step_entry, row, slots, "reference")
            spent += time.perf_counter() - t0
        times.append(spent)
    return statistics.median(times)


def run_recovery(size: ModelSize, ks: list[int], workdir: Path, *, batch_steps: int, reps: int, budget_s: float,
                 log: Any = print) -> dict[str, Any]:
    from ldformat import ChainReader

    warnings.filterwarnings("ignore", message=".*replaying in a different environment.*")
    data = dataclasses.replace(size, batch=2, seq=min(32, size.seq))
    kmax = max(ks)
    res: dict[str, Any] = {"model": size.to_dict(), "data": {"batch": data.batch, "seq": data.seq}, "ks": ks,
                           "batch_steps": batch_steps, "kinds": {}}
    full_path = workdir / "recovery-full.pt"
    for mode, kind in MODES.items():
        chain = workdir / f"recovery-{mode}"
        built = build_chain(size, data, mode, kmax, chain, batch_steps=batch_steps, keep_full=full_path,
                            recover_into=True)
        trainer = built.pop("trainer")
        live = built.pop("live")
        t_opt = optimizer_step_time(trainer)
        del trainer
        gc.collect()
        reader = ChainReader(chain)
        exact = bit_exact(reader.materialize(kmax), live)
        del live
        # Both sides from the page cache: the writer drops what it made durable from the cache
        # (LocalStore drop_cache), while torch.save's file stays cached.
        read_through(chain)
        read_through(full_path)
        load = timed(lambda: torch.load(full_path, weights_only=True), reps=reps, budget_s=budget_s)
        anchor_only = timed(lambda chain=chain: ChainReader(chain).materialize(0), reps=reps, budget_s=budget_s)
        per_k = {}
        for k in ks:
            m = timed(lambda k=k, chain=chain: ChainReader(chain).materialize(k), reps=reps, budget_s=budget_s)
            steps_s = replay_steps_only_s(chain, k, reps) if kind.startswith("grad.") else k * t_opt
            ref = load["median_s"] + steps_s
            per_k[k] = {"materialize": m, "reference_s": ref, "steps_only_s": steps_s,
                        "ratio_vs_reference": m["median_s"] / ref,
                        "ratio_vs_torch_load": m["median_s"] / load["median_s"]}
            log(f"  {mode}: materialize anchor + {k} deltas {m['median_s']:.2f} s "
                f"(torch.load {load['median_s']:.2f} s, anchor load + {k} AdamW steps {ref:.2f} s)")
        res["kinds"][mode] = {"kind": kind, "bit_exact_at_kmax": exact, "torch_load": load,
                              "optimizer_step_s": t_opt, "anchor_only": anchor_only, "per_k": per_k,
                              "in_memory_recover_s": built.get("in_memory_recover_s"),
                              "chain_build_s": built["train_s"], "batch_steps": built["batch_steps"]}
        shutil.rmtree(chain, ignore_errors=True)
        gc.collect()
    full_path.unlink(missing_ok=True)
    bars = {}
    for mode in ("lowdiff", "lowdiff+"):
        bars[mode] = all(v["ratio_vs_reference"] <= 1.2 for v in res["kinds"][mode]["per_k"].values())
    xor_cores = max(v["materialize"]["cores"] for v in res["kinds"]["xor"]["per_k"].values())
    res["bars"] = {"grad_kinds_le_1.2x": bars, "xor_cores_used": xor_cores,
                   "xor_uses_every_core": xor_cores >= 0.9 * torch.get_num_threads()}
    return res


def report_recovery(res: dict[str, Any]) -> str:
    m = res["model"]
    batches = ", ".join(f"{mode} {r['batch_steps']}" for mode, r in res["kinds"].items())
    lines = [f"Model {m['name']}; chains written by Checkpointer from cheap batches ({res['data']['batch']} x "
             f"{res['data']['seq']} tokens), batch_steps {batches} (at most {res['batch_steps']}, within 1 GiB of "
             "captured steps per batch), one anchor at chain step 0. "
             "Reference for grad kinds = torch.load of a full checkpoint + the same K AdamW steps on their own "
             "(the anchor's state, the recorded gradients already decoded in memory; an AdamW step's cost depends "
             "on the state, e.g. top-k gradients leave most moments at zero, which makes it slower); for xor "
             "(no bar) K x one AdamW step with dense gradients. The chain and the checkpoint are read once before "
             "the timings, so that both come from the page cache. 'cores' = process CPU time / wall time.", ""]
    rows = []
    for mode, r in res["kinds"].items():
        for k, v in r["per_k"].items():
            bar = ""
            if r["kind"].startswith("grad."):
                bar = "<= 1.2x " + verdict(v["ratio_vs_reference"] <= 1.2)
            rows.append([mode, k, f"{v['materialize']['median_s']:.3f}", f"{v['materialize']['cores']:.2f}",
                         f"{r['torch_load']['median_s']:.3f}", f"{v['ratio_vs_torch_load']:.2f}x",
                         f"{v['reference_s']:.3f}", f"{v['ratio_vs_reference']:.2f}x", bar])
    lines.append(table(["mode", "K", "materialize s", "cores", "torch.load s", "vs torch.load",
                        "anchor load + K opt steps s", "vs reference", "bar"], rows))
    lines.append("")
    extras = []
    for mode, r in res["kinds"].items():
        s = (f"{mode}: anchor only {r['anchor_only']['median_s']:.3f} s, one AdamW step "
             f"{r['optimizer_step_s'] * 1000:.0f} ms, bit-exact at K={max(res['ks'])}: "
             f"{'yes' if r['bit_exact_at_kmax'] else 'NO'}")
        if r.get("in_memory_recover_s") is not None:
            s += f", in-memory recover() {r['in_memory_recover_s']:.3f} s"
        extras.append(s)
    lines.append("; ".join(extras) + ".")
    lines.append("")
    b = res["bars"]
    lines.append(f"Bar: materialize <= 1.2x (anchor load + K optimizer steps) for grad kinds: lowdiff "
                 f"{verdict(b['grad_kinds_le_1.2x']['lowdiff'])}, lowdiff+ "
                 f"{verdict(b['grad_kinds_le_1.2x']['lowdiff+'])}; "
                 f"xor decoding uses every core ({torch.get_num_threads()} torch threads): "
                 f"{verdict(b['xor_uses_every_core'])} (max {b['xor_cores_used']:.2f} cores).")
    return "\n".join(lines)


# -- scaling: model size ------------------------------------------------------------------
def scaling_entry_from(size: ModelSize, steps: int, bytes_res: dict[str, Any],
                       rec: dict[str, Any]) -> dict[str, Any] | None:
    """The workload's scaling row from the bytes and recovery sections (same measurements)."""
    if rec.get("model", {}).get("name") != size.name or steps not in rec.get("ks", []) or "kinds" not in bytes_res:
        return None
    full = bytes_res["full_checkpoint_bytes"]
    entry: dict[str, Any] = {"model": size.to_dict(), "params": None, "full_checkpoint_bytes": full,
                             "torch_load_s": rec["kinds"]["lowdiff"]["torch_load"]["median_s"], "kinds": {},
                             "from_sections": "bytes (overhead chains) + recovery"}
    for mode in MODES:
        b = bytes_res["kinds"].get(f"ldformat {mode}")
        if b is None:
            return None
        entry["kinds"][mode] = {"delta_bytes_per_step": b["delta_bytes_per_step"],
                                "log_bytes_per_step": b["log_bytes_per_delta_step"],
                                "full_over_delta": full / b["delta_bytes_per_step"],
                                "materialize_s": rec["kinds"][mode]["per_k"][steps]["materialize"]["median_s"],
                                "anchor_bytes": b["anchor_bytes"]}
    return entry


def run_scaling(sizes: list[ModelSize], steps: int, workdir: Path, *, batch_steps: int, reps: int,
                known: dict[str, dict[str, Any]] | None = None, log: Any = print) -> dict[str, Any]:
    from ldformat import ChainReader

    warnings.filterwarnings("ignore", message=".*replaying in a different environment.*")
    out: dict[str, Any] = {"steps": steps, "batch_steps": batch_steps, "sizes": []}
    for size in sizes:
        if known and size.name in known:
            reused = dict(known[size.name])
            reused["params"] = n_params(Trainer(size).model)
            out["sizes"].append(reused)
            log(f"  {size.name}: taken from the bytes and recovery sections")
            continue
        t_size = time.perf_counter()
        probe = Trainer(size)
        params = n_params(probe.model)
        probe.step()
        full = full_checkpoint_bytes(probe, workdir / "scaling-full.pt")
        torch.save(probe.state_dict(), workdir / "scaling-full.pt")
        del probe
        load = timed(lambda: torch.load(workdir / "scaling-full.pt", weights_only=True), reps=reps)
        entry: dict[str, Any] = {"model": size.to_dict(), "params": params, "full_checkpoint_bytes": full,
                                 "torch_load_s": load["median_s"], "kinds": {}}
        for mode in MODES:
            chain = workdir / f"scaling-{size.name}-{mode}"
            built = build_chain(size, size, mode, steps, chain, batch_steps=batch_steps)
            del built["trainer"], built["live"]
            b = chain_bytes(chain)
            m = timed(lambda chain=chain: ChainReader(chain).materialize(steps), reps=reps)
            entry["kinds"][mode] = {"delta_bytes_per_step": b["delta_bytes_per_step"],
                                    "log_bytes_per_step": b["log_bytes_per_delta_step"],
                                    "full_over_delta": full / b["delta_bytes_per_step"],
                                    "materialize_s": m["median_s"], "anchor_bytes": b["anchor_bytes"]}
            shutil.rmtree(chain, ignore_errors=True)
        (workdir / "scaling-full.pt").unlink(missing_ok=True)
        out["sizes"].append(entry)
        log(f"  {size.name} ({params / 1e6:.1f}M): " + ", ".join(
            f"{mode} {human_bytes(v['delta_bytes_per_step'])}/step" for mode, v in entry["kinds"].items())
            + f" ({time.perf_counter() - t_size:.0f} s)")
        gc.collect()
    return out


def report_scaling(res: dict[str, Any]) -> str:
    rows = []
    for e in res["sizes"]:
        m = e["model"]
        row = [f"{m['name']} ({e['params'] / 1e6:.1f}M; {m['layers']}x{m['width']}, batch {m['batch']}x{m['seq']})",
               human_bytes(e["full_checkpoint_bytes"]), f"{e['torch_load_s']:.3f}"]
        for mode in MODES:
            k = e["kinds"][mode]
            row += [f"{human_bytes(k['delta_bytes_per_step'])} ({k['full_over_delta']:.0f}x)",
                    f"{k['materialize_s']:.3f}"]
        rows.append(row)
    headers = ["model", "full ckpt", "torch.load s"]
    for mode in MODES:
        headers += [f"{mode} delta/step (full/delta)", f"{mode} materialize s"]
    reused = [e["model"]["name"] for e in res["sizes"] if e.get("from_sections")]
    note = (f" The {', '.join(reused)} row comes from sections 2 and 4 (its bytes from real workload steps, its "
            "materialize time from the recovery chain)." if reused else "")
    return (f"Each size trained with a Checkpointer for {res['steps']} steps at its stated batch "
            f"(batch_steps at most {res['batch_steps']}, within 1 GiB of captured steps per batch); "
            f"materialize = anchor + {res['steps']} deltas.{note}\n\n"
            + table(headers, rows))


# -- scaling: chain length ----------------------------------------------------------------
def run_chain_length(size: ModelSize, n: int, workdir: Path, log: Any = print) -> dict[str, Any]:
    """Commit time and reader open time as a chain grows (one commit per step)."""
    from ldformat import ChainReader, ChainWriter

    chain = workdir / "chain-length"
    shutil.rmtree(chain, ignore_errors=True)
    trainer = Trainer(size)
    trainer.step()
    writer = ChainWriter.create(chain, trainer.model, trainer.optimizer, kind="grad.dense", batch_steps=1)
    commit_s: list[float] = []
    record_s: list[float] = []
    opens: dict[int, float] = {}
    checkpoints = sorted({10, n // 10, n // 2, n} - {0})
    trainer.prefetch(2, n)
    for s in range(1, n + 1):
        trainer.step()
        t0 = time.perf_counter()
        writer.record_step(s)
        record_s.append(time.perf_counter() - t0)
        commit_s.append(writer.last_commit_seconds)
        if s in checkpoints:
            opens[s] = timed(lambda: ChainReader(chain), reps=3)["median_s"]
    writer.close()
    tail = max(1, n // 10)
    res: dict[str, Any] = {"model": size.to_dict(), "commits": n, "commit_first_s": statistics.median(commit_s[:tail]),
           "commit_last_s": statistics.median(commit_s[-tail:]), "record_first_s": statistics.median(record_s[:tail]),
           "record_last_s": statistics.median(record_s[-tail:]), "reader_open_s": opens}
    shutil.rmtree(chain, ignore_errors=True)
    log(f"  chain length {n}: commit {res['commit_first_s'] * 1000:.1f} -> {res['commit_last_s'] * 1000:.1f} ms, "
        f"reader open at {n} commits {opens.get(n, float('nan')) * 1000:.0f} ms")
    return res


def report_chain_length(res: dict[str, Any], recovery: dict[str, Any] | None) -> str:
    lines = [f"ChainWriter (grad.dense, {res['model']['name']}, batch_steps=1: one commit per step), {res['commits']} "
             "commits.", "",
             table(["figure", f"first {max(1, res['commits'] // 10)} commits",
                    f"last {max(1, res['commits'] // 10)} commits"],
                   [["commit (fsync + log record) ms", f"{res['commit_first_s'] * 1000:.2f}",
                     f"{res['commit_last_s'] * 1000:.2f}"],
                    ["record_step total ms", f"{res['record_first_s'] * 1000:.2f}",
                     f"{res['record_last_s'] * 1000:.2f}"]]), "",
             table(["commits in the log", "ChainReader open ms"],
                   [[k, f"{v * 1000:.1f}"] for k, v in sorted(res["reader_open_s"].items())])]
    if recovery:
        lines += ["", "Materialize time against the number of deltas replayed (from the recovery benchmark):", ""]
        rows = []
        for mode, r in recovery["kinds"].items():
            ks = sorted(r["per_k"])
            per = [r["per_k"][k]["materialize"]["median_s"] for k in ks]
            slope = (per[-1] - per[0]) / (ks[-1] - ks[0]) if len(ks) > 1 else float("nan")
            rows.append([mode, f"{r['anchor_only']['median_s']:.3f}", *(f"{p:.3f}" for p in per),
                         f"{slope * 1000:.1f}"])
        ks = sorted(next(iter(recovery["kinds"].values()))["per_k"])
        lines.append(table(["mode", "K=0 s", *(f"K={k} s" for k in ks), "ms per extra delta"], rows))
    return "\n".join(lines)
