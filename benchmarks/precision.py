"""fp32 against bf16 per mode: peak memory and step time, estimated and measured on this machine, and
predicted on the built-in A100 / H100 profiles for the reference tables' CIFAR10-DVS VGG.

Run: ``python benchmarks/precision.py [--time-steps 32] [--batch 16] [--markdown FILE]``.

1. This machine (gloo ranks, 2 per plan, 4 for fsdp2_tp): the zoo's ``mlp_all_steps`` at ``--time-steps``
   and ``--batch`` trains under each mode (dp, dp+ZeRO, tp, fsdp2, fsdp2_tp, pp) in fp32 and in bf16
   (neuron state fp32); every plan is measured (``measure_many``: the peak per rank, the mean step of
   each rank, the worst rank's) and estimated (``estimate`` on this machine's calibration, whose
   bf16 matmul and elementwise rates are measured). Then the bf16 / fp32 ratios of each mode, both
   measured in this one run.
2. GPUs, predicted only: CIFAR10DVSVGG (spikingjelly's ``examples/memopt/models.py``, built as
   ``benchmarks/reference_gpu.py`` builds it: batch 16 per rank, T = 10, 48 px) per mode on the
   built-in datasheet profiles, fp32 against bf16 (the half-precision tensor-core rate, activations and
   gradients reduced at 2 bytes).
"""
from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path
from typing import List

import pandas as pd
import torch

import snn_explorer as se
from snn_explorer.estimator import estimate, measure_many
from snn_explorer.zoo import build

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_gpu import FEATURES, vgg  # noqa: E402  (the reference tables' model, built as that benchmark does)

MIB = 2 ** 20
PRECISIONS = ("fp32", "bf16")
#: (label, mode, topology, ZeRO)
MODES = (("dp", "dp", {"dp": 2}, False), ("dp+zero", "dp", {"dp": 2}, True), ("tp", "tp", {"tp": 2}, False),
         ("fsdp2", "fsdp2", {"dp": 2}, False), ("fsdp2_tp", "fsdp2_tp", {"dp": 2, "tp": 2}, False),
         ("pp", "pp", {"pp": 2}, False))
GPU_MODES = (("none", "none", {"dp": 1}, False),) + MODES[:5]
GPUS = ("A100-SXM-80GB", "H100-SXM")


def _plan(analysis, mode, topology, zero, batch, precision, **features):
    gate = se.DistributedFeatureSet(allow_mixed_precision=True, allow_zero_optimizer=zero, **features)
    plan = se.plan(analysis=analysis, objective="speed", topology=topology, mode=mode, batch_size=batch,
                   features=gate, options=se.PlanOptions(precision=precision))
    if plan.uses_zero != zero or plan.precision.name != precision:
        raise RuntimeError(f"{mode} {topology} {precision}: the plan is {plan}")
    return plan


def this_machine(time_steps: int, batch: int) -> pd.DataFrame:
    zoo = build("mlp_all_steps", time_steps=time_steps, batch_size=batch)
    analysis = se.analyze(zoo.model, model_family=zoo.family)
    plans = [(label, _plan(analysis, mode, topology, zero, batch, precision))
             for label, mode, topology, zero in MODES for precision in PRECISIONS]
    measured = measure_many(zoo.model, [p for _, p in plans], example_input=zoo.example_input, labels=zoo.labels,
                            steps=3, timeout=300)
    rows = []
    for (label, plan), got in zip(plans, measured):
        est = estimate(zoo.model, plan, example_input=zoo.example_input, labels=zoo.labels)
        rows.append(dict(mode=label, precision=plan.precision.name, est_peak_kib=est.peak_bytes / 1024,
                         measured_peak_kib=got.peak_bytes / 1024,
                         peak_err=(est.peak_bytes - got.peak_bytes) / got.peak_bytes,
                         est_step_ms=est.step_time_s * 1e3, measured_step_ms=max(got.step_time_s) * 1e3,
                         step_err=(est.step_time_s - max(got.step_time_s)) / max(got.step_time_s)))
    return pd.DataFrame(rows)


def ratios(table: pd.DataFrame, columns: List[str]) -> pd.DataFrame:
    """Per mode, bf16's figure over fp32's for each of ``columns``."""
    wide = table.set_index(["mode", "precision"])[columns].unstack("precision")
    out = pd.DataFrame({c: wide[(c, "bf16")] / wide[(c, "fp32")] for c in columns})
    return out.reindex([m for m in dict.fromkeys(table["mode"])]).reset_index()


def gpus() -> pd.DataFrame:
    model, x, labels, per_rank, layout = vgg()
    analysis = se.analyze(model)
    rows = []
    for label, mode, topology, zero in GPU_MODES:
        dp = topology.get("dp", 1)
        for precision in PRECISIONS:
            try:
                plan = _plan(analysis, mode, topology, zero, per_rank * dp, precision, **FEATURES)
            except ValueError as exc:  # refused at plan time, with the reason
                rows.append(dict(mode=label, precision=precision, refused=str(exc).split(" (")[0]))
                continue
            for gpu in GPUS:
                est = se.estimate(model, plan, example_input=x, labels=labels, hardware=gpu, **layout)
                rows.append(dict(mode=label, precision=precision, gpu=gpu, peak_mib=est.peak_bytes / MIB,
                                 step_ms=est.step_time_s * 1e3,
                                 activations_mib=float(est.per_rank["activations_bytes"].max()) / MIB))
    return pd.DataFrame(rows)


def gpu_ratios(table: pd.DataFrame) -> pd.DataFrame:
    done = table.dropna(subset=["gpu"]) if "gpu" in table else table.iloc[0:0]
    wide = done.set_index(["gpu", "mode", "precision"])[["peak_mib", "step_ms", "activations_mib"]]
    wide = wide.unstack("precision").dropna()
    out = pd.DataFrame({c: wide[(c, "bf16")] / wide[(c, "fp32")] for c in ("peak_mib", "activations_mib", "step_ms")})
    modes = [label for label, *_ in GPU_MODES]
    return out.reset_index().sort_values(["gpu", "mode"], key=lambda c: c.map(modes.index) if c.name == "mode" else c)


def markdown(table: pd.DataFrame) -> str:
    """``table`` as a Markdown table (floats to 3 decimals)."""
    cell = lambda v: f"{v:.3f}" if isinstance(v, float) else ("" if v is None else str(v))
    lines = ["| " + " | ".join(map(str, table.columns)) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.astype(object).where(table.notna(), None)
              .itertuples(index=False)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time-steps", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--markdown", help="also write the tables to this Markdown file")
    args = parser.parse_args()
    fmt = dict(index=False, float_format=lambda v: f"{v:.3f}")
    cpu = this_machine(args.time_steps, args.batch)
    cpu_ratio = ratios(cpu, ["est_peak_kib", "measured_peak_kib", "est_step_ms", "measured_step_ms"])
    gpu = gpus()
    gpu_ratio = gpu_ratios(gpu)
    head = (f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
            f"{torch.get_num_threads()} threads; mlp_all_steps T={args.time_steps}, global batch {args.batch}")
    sections = [("This machine: estimated vs measured, fp32 and bf16 (neuron state fp32)", cpu),
                ("This machine: bf16 / fp32 per mode (one run)", cpu_ratio),
                ("GPUs, predicted: CIFAR10DVSVGG, batch 16 per rank, T = 10", gpu),
                ("GPUs, predicted: bf16 / fp32", gpu_ratio)]
    print(head)
    for title, table in sections:
        print(f"\n{title}\n{table.to_string(**fmt)}")
    if args.markdown:
        text = [f"# fp32 vs bf16 per mode (`python benchmarks/precision.py`)\n\n{head}.\n"]
        text += [f"\n## {title}\n\n{markdown(table)}\n" for title, table in sections]
        Path(args.markdown).write_text("".join(text))


if __name__ == "__main__":
    main()
