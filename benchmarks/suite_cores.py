"""Where a whole test run spends its wall time, and how many of the machine's cores it keeps busy meanwhile.

Runs a command (by default ``bash .ci/run`` in a fresh clone of this checkout's HEAD), reads the system-wide busy
time from ``/proc/stat`` every ``--every`` seconds, and splits the run at the lines ``scripts/test.sh`` prints
when a phase starts (``== ...``). Prints one row per phase: its seconds, its busy CPU-seconds and the cores that
makes on average, then the whole run and its floor (busy CPU-seconds / cores: no schedule of the same work can
end sooner). Busy time is system-wide: run it on an otherwise idle machine.

Run: ``python benchmarks/suite_cores.py [--keep-clone] [-- command ...]``. Needs Linux (``/proc/stat``).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def busy_seconds() -> float:
    """CPU-seconds every core has spent outside idle and iowait since boot."""
    with open("/proc/stat") as fh:
        fields = [int(v) for v in fh.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def sample(samples: list, stop: threading.Event, every: float) -> None:
    while not stop.is_set():
        samples.append((time.monotonic(), busy_seconds()))
        stop.wait(every)


def busy_between(samples: list, start: float, end: float) -> float:
    inside = [b for t, b in samples if start <= t <= end]
    return inside[-1] - inside[0] if len(inside) > 1 else float("nan")


def run(command: list, cwd: str, every: float) -> tuple:
    """(exit code, [(phase, start, end)], samples): the command's output is echoed as it comes."""
    samples, stop = [], threading.Event()
    sampler = threading.Thread(target=sample, args=(samples, stop, every), daemon=True)
    sampler.start()
    phases = [("set-up", time.monotonic())]
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        sys.stdout.write(line)
        if line.startswith("== "):
            phases.append((line.strip("= \n")[:60], time.monotonic()))
    code = proc.wait()
    end = time.monotonic()
    stop.set()
    sampler.join()
    samples.append((end, busy_seconds()))
    bounds = [(name, start, nxt) for (name, start), (_, nxt) in zip(phases, phases[1:] + [("", end)])]
    return code, bounds, samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=2.0, help="seconds between reads of /proc/stat")
    parser.add_argument("--keep-clone", action="store_true", help="leave the fresh clone in place")
    parser.add_argument("command", nargs="*", help="the command to run (default: bash .ci/run in a fresh clone)")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    work = tempfile.mkdtemp(prefix="snn-suite-cores-")
    if args.command:
        command, cwd = args.command, str(REPO)
    else:
        subprocess.run(["git", "clone", "-q", str(REPO), f"{work}/clone"], check=True)
        command, cwd = ["bash", ".ci/run"], f"{work}/clone"
    code, bounds, samples = run(command, cwd, args.every)
    print(f"\n{'phase':62} {'s':>6} {'busy CPU-s':>11} {'cores':>6}")
    for name, start, end in bounds:
        busy = busy_between(samples, start, end)
        print(f"{name:62} {end - start:6.0f} {busy:11.0f} {busy / max(end - start, 1e-9):6.2f}")
    total_s = bounds[-1][2] - bounds[0][1]
    total_busy = busy_between(samples, bounds[0][1], bounds[-1][2])
    print(f"{'whole run (exit code ' + str(code) + ')':62} {total_s:6.0f} {total_busy:11.0f} {total_busy / total_s:6.2f}")
    print(f"floor on {cores} cores: {total_busy / cores:.0f} s")
    if not args.keep_clone:
        subprocess.run(["rm", "-rf", work], check=False)
    return code


if __name__ == "__main__":
    sys.exit(main())
