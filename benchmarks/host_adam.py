"""The host CPU's Adam rate, the figure FSDP2's CPU offload steps its optimizer at (``host_adam_params_per_s``).

Run: ``python benchmarks/host_adam.py [--numel 1048576] [--tensors 8]``. Prints this machine's rate
(:func:`~snn_explorer.estimator.calibration.host_adam.this_host_adam_rate`: ``torch.optim.Adam`` on one thread over
``tensors`` fp32 CPU tensors of ``numel`` elements, the fastest of 3 steps) beside the documented rate the built-in
GPU profiles carry, with the wall and CPU time of the measurement and the load average; then what the host step
adds to an FSDP2 + CPU offload estimate (mlp_all_steps, 2 ranks, H100-SXM) at each rate.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

import pandas as pd

import snn_explorer as se
from snn_explorer.estimator import estimate
from snn_explorer.estimator.calibration.host_adam import this_host_adam_rate
from snn_explorer.estimator.timing.hardware import HOST_ADAM_PARAMS_PER_S, hardware_profile
from snn_explorer.zoo import build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--numel", type=int, default=1 << 20)
    parser.add_argument("--tensors", type=int, default=8)
    args = parser.parse_args()
    wall, cpu = time.perf_counter(), time.process_time()
    here = this_host_adam_rate(args.numel, args.tensors)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"load average {os.getloadavg()[0]:.2f}; measured in {wall:.2f} s wall, {cpu:.2f} s CPU")
    zoo = build("mlp_all_steps")
    plan = se.plan(analysis=se.analyze(zoo.model), objective="speed", topology={"dp": 2}, batch_size=zoo.batch_size,
                   mode="fsdp2", features=se.DistributedFeatureSet(allow_cpu_offload=True))
    h100 = hardware_profile("H100-SXM")
    plain = estimate(zoo.model, plan, example_input=zoo.example_input, labels=zoo.labels, hardware=h100)
    rows = []
    for source, rate in (("documented (H100 node host, 1 thread)", HOST_ADAM_PARAMS_PER_S),
                         ("this machine (torch Adam, 1 thread)", here)):
        hw = dataclasses.replace(h100, host_adam_params_per_s=rate)
        off = estimate(zoo.model, dataclasses.replace(plan, cpu_offload=True), example_input=zoo.example_input,
                       labels=zoo.labels, hardware=hw)
        rows.append(dict(source=source, adam_params_per_s=f"{rate:.3e}", plain_step_ms=round(plain.step_time_s * 1e3, 4),
                         offload_step_ms=round(off.step_time_s * 1e3, 4), offload_peak_B=off.peak_bytes,
                         plain_peak_B=plain.peak_bytes))
    print(pd.DataFrame(rows).to_string(index=False))


if __name__ == "__main__":
    main()
