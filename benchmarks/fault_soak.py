"""Fault soak: many launches from one process, mixing clean runs and injected faults, each faulty run
restarted from its checkpoints as ``launch_plan(max_restarts=...)`` does; prints a table of faults
injected x outcomes.

Faults (each once per scenario, on rank 0 or 1 in turn, at varying steps, fsdp2 on 2 gloo ranks,
6 steps, a checkpoint every 2): a rank raising, a rank SIGKILLed mid-step, a rank hanging (no
heartbeat for ``--hang-timeout`` s), a rank SIGKILLed inside DCP's write of its checkpoint shard,
a NaN input on one rank (a NaN loss and gradients). Faults done to the folder between a run of 4
steps and its continuation to 6: 400 bytes of the latest checkpoint's shard flipped (same size), its
``.metadata`` replaced by a symlink to a copy outside the folder, a live process holding the
folder's lock. Each must be refused at the start naming the file / holder (a launch that goes on
counts as a silent load); then the damaged checkpoint is removed (the holder ends) and the run
resumes from the last good checkpoint.
For every scenario: was the failure detected and its root cause named with the right rank, the
time from the fault to the error (detect) and to the first step of the resumed run (recover), the
step the run resumed from against the last complete checkpoint before the fault (steps lost beyond
it: target 0), whether the resumed losses equal an uninterrupted run's (float64, 1e-12), and the
processes, listening ports and files left behind (target 0).

Run: ``python benchmarks/fault_soak.py [--launches 100] [--hang-timeout 5]``. Not a test: the
times depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import psutil
from torch import nn

import snn_explorer as se
from snn_explorer.core.checkpoints import CheckpointError, FolderLock, latest_checkpoint
from snn_explorer.launcher import LaunchError
from snn_explorer.zoo import build

STEPS, EVERY = 6, 2
KINDS = ("clean", "nan", "byte_flip", "symlink", "lock", "raise", "sigkill", "hang", "kill_in_save")
#: Faults done to the checkpoint folder between two launches (the first stops after FIRST_STEPS steps).
FOLDER_FAULTS = ("byte_flip", "symlink", "lock")
FIRST_STEPS = 4
TOL = 1e-12


def soak_step(runtime, step, batch, state, inputs, labels, fault=None):
    """One fsdp2 step on this rank's slice of the global batch, with ``fault`` injected once (a
    marker file records that it fired, its mtime when)."""
    share, start = runtime.plan.per_rank_batch, runtime.dp_rank * runtime.plan.per_rank_batch
    x = inputs[:, start:start + share]
    if fault and step == fault["step"] and runtime.dp_rank == fault["rank"] and not os.path.exists(fault["marker"]):
        _inject(fault)
        if fault["kind"] == "nan":
            x = x * float("nan")
    state["optimizer"].zero_grad()
    loss = runtime.train_step(nn.CrossEntropyLoss(), x, labels[start:start + share])
    state["optimizer"].step()
    return loss


def _inject(fault) -> None:
    kind, marker = fault["kind"], fault["marker"]
    if kind == "kill_in_save":  # armed now; fires in the save after this step, when a shard is synced
        real = os.fsync

        def fsync(fd):
            if os.readlink(f"/proc/self/fd/{fd}").endswith(".distcp"):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            return real(fd)
        os.fsync = fsync
        return
    if kind in FOLDER_FAULTS:
        return
    open(marker, "w").close()
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {fault['rank']} at step {fault['step']}")
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        time.sleep(3600)


def scenarios(launches: int):
    """(kind, rank, step) in turn until ``launches`` launches are planned (a fault takes two: the
    failed one and the resumed one)."""
    out, used, i = [], 0, 0
    while used < launches:
        kind = KINDS[i % len(KINDS)]
        cost = 1 if kind == "clean" else 3 if kind in FOLDER_FAULTS else 2
        if used + cost > launches:
            kind, cost = "clean", 1
        cycle = i // len(KINDS)
        step = (1 + cycle % 2) * EVERY - 1 if kind == "kill_in_save" else FIRST_STEPS if kind in FOLDER_FAULTS \
            else 1 + cycle % 4
        out.append((kind, cycle % 2, step))
        used, i = used + cost, i + 1
    return out


def expected_resume(kind: str, step: int) -> int:
    """The last complete checkpoint before the fault: the save of ``step + 1`` never completes
    under kill_in_save; otherwise step ``step`` never completes."""
    if kind in FOLDER_FAULTS:  # the checkpoint of FIRST_STEPS is the damaged one (lock: nothing is damaged)
        return FIRST_STEPS if kind == "lock" else FIRST_STEPS - EVERY
    done = step if kind != "kill_in_save" else step + 1 - EVERY
    return (done // EVERY) * EVERY


class Setup:
    """The model, plan and data every scenario uses, and the uninterrupted run's losses."""

    def __init__(self, hang_timeout: float):
        zoo = build("mlp")
        self.model = zoo.model.double()
        self.plan = se.plan(analysis=se.analyze(self.model, model_family=zoo.family), objective="speed",
                            topology={"dp": 2}, mode="fsdp2", batch_size=zoo.batch_size)
        self.data = {"inputs": zoo.example_input.double(), "labels": zoo.labels}
        self.kw = dict(steps=STEPS, optimizer={"lr": 1e-2}, timeout=hang_timeout)
        self.reference = self.launch(None, None).losses
        if len(set(self.reference[0])) != STEPS:
            raise SystemExit(f"the reference run does not train (losses {self.reference[0]}); nothing to compare")

    def launch(self, fault, ckpt, progress=False, steps=STEPS):
        extra = {} if ckpt is None else {"checkpoint_dir": ckpt, "checkpoint_every": EVERY}
        return se.launch_plan(self.model, self.plan, soak_step, train_kwargs={**self.data, "fault": fault}, steps=steps, optimizer=self.kw["optimizer"], options=se.LaunchOptions(progress=progress, timeout=self.kw["timeout"], **extra))


def _equal(losses, reference, start: int) -> bool:
    return all(len(losses[r]) == STEPS - start and all(abs(a - b) <= TOL for a, b in zip(losses[r], reference[r][start:]))
               for r in reference)


def _damage(kind: str, ckpt: Path, root: Path):
    """Do ``kind`` to the folder; returns what the refusal must name, and how to undo it (the user's fix)."""
    latest = ckpt / f"step-{FIRST_STEPS:06d}"
    if kind == "byte_flip":
        shard = sorted(latest.glob("*.distcp"))[0]
        data = bytearray(shard.read_bytes())
        data[-400:] = bytes(b ^ 0xFF for b in data[-400:])
        shard.write_bytes(bytes(data))
        return shard.name, lambda: shutil.rmtree(latest)
    if kind == "symlink":
        outside = root / "outside.metadata"
        shutil.copy(latest / ".metadata", outside)
        (latest / ".metadata").unlink()
        os.symlink(outside, latest / ".metadata")
        return ".metadata is a symlink", lambda: shutil.rmtree(latest)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    lock = FolderLock(ckpt)
    lock.me["pid"] = holder.pid
    lock.acquire()
    return f"in use by pid {holder.pid}", lambda: (holder.kill(), holder.wait())


def run_folder_fault(setup: Setup, kind: str, root: Path) -> dict:
    """Run FIRST_STEPS steps, do ``kind`` to the folder, launch again (it must be refused naming the
    fault), undo it as a user would, launch again: it resumes from the last good checkpoint."""
    ckpt = root / "ckpt"
    setup.launch(None, ckpt, steps=FIRST_STEPS)
    named, undo = _damage(kind, ckpt, root)
    record = {"kind": kind, "launches": 3}
    fired = time.time()
    try:
        setup.launch(None, ckpt)
        record.update(detected=False, named=False, silent=1)
    except (CheckpointError, LaunchError) as error:
        record.update(detected=True, named=named in str(error), silent=0, detect_s=time.time() - fired,
                      message=str(error).splitlines()[0])
    undo()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "took over the lock": expected here
        latest = latest_checkpoint(ckpt)
        resumed_from = 0 if latest is None else int(latest.name.split("-")[1])
        resumed = setup.launch(None, ckpt)
    record.update(recover_s=time.time() - fired, resumed_from=resumed_from,
                  lost=expected_resume(kind, FIRST_STEPS) - resumed_from, redone=FIRST_STEPS - resumed_from,
                  recovered=_equal(resumed.losses, setup.reference, resumed_from)
                  and latest_checkpoint(ckpt).name == f"step-{STEPS:06d}")
    return record


def run_scenario(setup: Setup, kind: str, rank: int, step: int, root: Path) -> dict:
    if kind in FOLDER_FAULTS:
        return run_folder_fault(setup, kind, root)
    ckpt, marker = root / "ckpt", root / "fired"
    fault = None if kind == "clean" else {"kind": kind, "rank": rank, "step": step, "marker": str(marker)}
    record = {"kind": kind, "launches": 1}
    if fault is None:
        record.update(recovered=_equal(setup.launch(None, ckpt).losses, setup.reference, 0), resumed_from=0)
        return record
    try:
        setup.launch(fault, ckpt)
        record.update(detected=False, named=False, recovered=False)
        return record
    except LaunchError as error:
        failed_at = time.time()
        cause = error.root_cause
        named = cause is not None and cause.rank == rank and not cause.collateral
        if kind == "nan":  # every rank stops with the same error, naming the step and the ranks holding NaN
            listed = str(error).partition("rank(s) [")[2].partition("]")[0]
            named = f"step {step + 1}: non-finite" in str(error) and str(rank) in listed.split(", ")
        record.update(detected=True, named=named, message=str(error).splitlines()[0])
    fired = marker.stat().st_mtime
    latest = latest_checkpoint(ckpt)
    resumed_from = 0 if latest is None else int(latest.name.split("-")[1])
    first_step = {}
    track = lambda snap: first_step.setdefault("t", time.time()) if any(s["step"] for s in snap) else None  # noqa: E731
    resumed = setup.launch(fault, ckpt, progress=track)
    record.update(launches=2, detect_s=failed_at - fired, recover_s=first_step.get("t", float("nan")) - fired,
                  resumed_from=resumed_from, lost=expected_resume(kind, step) - resumed_from,
                  redone=(step + (1 if kind == "kill_in_save" else 0)) - resumed_from,
                  recovered=_equal(resumed.losses, setup.reference, resumed_from)
                  and latest_checkpoint(ckpt).name == f"step-{STEPS:06d}")
    return record


def leftovers(tmp: Path, root: Path) -> tuple:
    """(processes, listening ports, files) this process left: descendants (less multiprocessing's
    reused resource tracker and zombies), their listening sockets, entries in the private temp
    directory and unfinished checkpoint folders."""
    procs = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(child.cmdline()):
                procs.append(child)
        except psutil.NoSuchProcess:
            pass
    ports = 0
    for proc in [psutil.Process()] + procs:
        try:
            ports += sum(c.status == psutil.CONN_LISTEN for c in proc.net_connections("inet"))
        except psutil.NoSuchProcess:
            pass
    partial = [p for p in (root / "ckpt").glob(".*")] if (root / "ckpt").is_dir() else []
    return len(procs), ports, len(os.listdir(tmp)) + len(partial)


def _median_max(values) -> str:
    values = [v for v in values if v == v]
    return f"{statistics.median(values):.1f} / {max(values):.1f}" if values else "-"


def _row(kind: str, rows) -> str:
    faulty = kind != "clean"
    count = lambda key: sum(bool(r.get(key)) for r in rows)  # noqa: E731
    detected = str(count("detected")) if faulty else "-"
    named = str(count("named")) if faulty else "-"
    detect = _median_max([r["detect_s"] for r in rows if "detect_s" in r]) if faulty else "-"
    redone = f"{statistics.mean(r.get('redone', 0) for r in rows):.1f}" if faulty else "-"
    recover = _median_max([r["recover_s"] for r in rows if "recover_s" in r]) if faulty else "-"
    left = [max(r["left"][i] for r in rows) for i in range(3)]
    silent = str(sum(r.get("silent", 0) for r in rows)) if kind in FOLDER_FAULTS else "-"
    return (f"{kind:<14}{len(rows):>5}{sum(r['launches'] for r in rows):>9}{detected:>9}{named:>6}{silent:>7}{detect:>13}"
            f"{count('recovered'):>10}{sum(r.get('lost', 0) for r in rows):>5}{redone:>7}{recover:>13}"
            f"{left[0]:>6}{left[1]:>6}{left[2]:>6}")


def print_table(records, seconds: float) -> None:
    head = (f"{'fault':<14}{'runs':>5}{'launches':>9}{'detected':>9}{'named':>6}{'silent':>7}{'detect s':>13}{'recovered':>10}"
            f"{'lost':>5}{'redone':>7}{'recover s':>13}{'procs':>6}{'ports':>6}{'files':>6}")
    print(head)
    print("-" * len(head))
    for kind in KINDS:
        rows = [r for r in records if r["kind"] == kind]
        if rows:
            print(_row(kind, rows))
    faults = [r for r in records if r["kind"] != "clean"]
    left = [max(r["left"][i] for r in records) for i in range(3)]
    print(f"\n{1 + sum(r['launches'] for r in records)} launches (1 uninterrupted reference) in {seconds:.0f} s; "
          f"faults detected {sum(bool(r.get('detected')) for r in faults)}/{len(faults)}, named with their rank "
          f"{sum(bool(r.get('named')) for r in faults)}/{len(faults)}; silent loads of a damaged, redirected or "
          f"locked folder {sum(r.get('silent', 0) for r in faults)}; runs recovered "
          f"{sum(bool(r.get('recovered')) for r in records)}/{len(records)}; steps lost beyond the last complete "
          f"checkpoint {sum(r.get('lost', 0) for r in faults)}; left over (max after any run): processes {left[0]}, "
          f"ports {left[1]}, files {left[2]}")
    print("detect s / recover s: median / max seconds from the fault (its marker file; a folder fault: the launch "
          "after it) to the launcher's error / to the first step reported by the resumed run (a folder fault: to the "
          "end of the resumed run); silent: a launch that went on past a folder fault; recovered: the run's losses equal the uninterrupted "
          "run's (1e-12); redone: mean steps run again after the resume; lost: steps lost beyond the last "
          "complete checkpoint")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=100)
    parser.add_argument("--hang-timeout", type=float, default=5.0, help="seconds without a heartbeat = hung")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fault-soak-"))
    work = Path(tempfile.mkdtemp(prefix="fault-soak-work-"))
    os.environ["TMPDIR"] = tempfile.tempdir = str(tmp)  # the launcher's run directories go here
    started = time.time()
    setup = Setup(args.hang_timeout)
    records = []
    for i, (kind, rank, step) in enumerate(scenarios(args.launches - 1)):  # the reference was one launch
        root = work / f"{i:03d}"
        root.mkdir()
        record = run_scenario(setup, kind, rank, step, root)
        record["left"] = leftovers(tmp, root)
        records.append(record)
        print(f"[{i:3d}] {kind:<13} rank {rank} step {step}: " + ", ".join(
            f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items() if k != "kind"),
            file=sys.stderr, flush=True)
        shutil.rmtree(root)
    print_table(records, time.time() - started)
    shutil.rmtree(work)
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
