"""The reference project's published RTX 4090 tables, predicted by estimate() as the GPUs ran them.

``shared/reference/core-behaviour.md`` holds the figures (7 x RTX 4090, torch 2.7.1, the package's
fused Triton neuron kernels, per-rank batch 16, PCIe without peer-to-peer, no compile). Each row is
estimated on the built-in ``RTX-4090-PCIe-noP2P`` profile (its GPU execution model: the step traced
on the meta device as the GPU runs it; every constant with its source in
``snn_explorer/estimator/timing/hardware.py``) with the package's own model classes, unmodified:

- ``CIFAR10DVSVGG`` (``spikingjelly.activation_based.examples.memopt.models``), input ``[N, T, 2,
  48, 48]`` as the model takes it. estimate() reads ``[T, N, ...]`` until the input-layout work
  lands, so the batch is passed as it is with ``time_steps`` = N and the plan's batch = T x dp: each
  rank then runs exactly the model's ``[16, 10, 2, 48, 48]``; without labels (mean-square loss);
- ``spikformer_ti(T=8)`` (``spikingjelly.activation_based.model.spikformer``; the package ships
  Spikformer-Ti itself: embed 256, 8 heads, 4 blocks, 224 px, 1000 classes), input ``[T, N, 3, 224,
  224]`` time-major as the model takes 5-D input, with labels (cross-entropy).

The published runs' neurons ran "the package's fused Triton neuron kernels": the release whose ``LIFNode``
takes ``backend='triton'`` (its memopt examples' default), whose op saves only ``h`` for backward, where the
installed 2.0.0's own op (``sj_lif``) also keeps the input and ``v_init`` alive
(``snn_explorer/estimator/memory/fused_neurons.py`` gives both sources). The models are the installed
package's classes, their LIF neurons marked ``backend = 'triton'`` (:func:`as_published`), so the trace runs
the op the published runs ran; ``--sj-lif`` predicts with 2.0.0's own op instead.

FSDP2 rows reshard after forward as the reference applies FSDP2: ``fully_shard`` on its chosen sub-modules
with torch's default ``reshard_after_forward=True``, the root with False (the seed's apply; the installed
package's ``distributed/vision/execution.py``, ``_wrap_data_parallel``), so each unit is gathered again in
backward: the plan's ``memopt_level`` 1, which is what turns that on in snn_explorer
(``SNNDistributedPlan.reshard_after_forward``).

The published "MB" is taken as MiB: the reference's trainer reports ``torch.cuda.max_memory_allocated``
bytes and the package's own memory callbacks divide them by ``1024 ** 2`` and call that MB
(``examples/memopt/lightning_callbacks.py``). Over a run that peak includes the first step, where the published op's
Triton kernels autotune (``snn_explorer/estimator/memory/fused_neurons.py``) and the optimizer has no state yet: the
published dp and dp + zero peaks are equal on both tables, as a first-step peak makes them. Printed: published and predicted step time and peak,
their ratio, the plan order by predicted time against the published order, and the median and
worst |error| against the targets (time 15 % / 30 %, memory 5 % / 10 %). No constant is fitted to
these tables.

Run: ``python benchmarks/reference_gpu.py`` (CPU only; a few minutes); ``--physics``: only the line that checks
every GPU profile obeys physics on the same step (H100 < A100 < RTX 4090, bf16 < fp32); ``--pp-cuts``: only the
pipeline rows at several stage cuts; ``--sj-lif``: the installed 2.0.0's own LIF op instead of the published one.
"""
from __future__ import annotations

import dataclasses
import inspect
import statistics
import sys
import time
from typing import List, Optional

import torch

import snn_explorer as se

HARDWARE = "RTX-4090-PCIe-noP2P"
MIB = 2 ** 20
TARGETS = {"time": (0.15, 0.30), "memory": (0.05, 0.10)}

#: (label, mode, topology, ZeRO, published ms, published MB) per model, in the published rows' order.
VGG_ROWS = [("none", "none", {"dp": 1}, False, 38.34, 2265.79),
            ("dp 2", "dp", {"dp": 2}, False, 39.34, 2303.16),
            ("dp 2 + zero", "dp", {"dp": 2}, True, 41.69, 2303.16),
            ("tp 2", "tp", {"tp": 2}, False, 85.71, 1897.22),
            ("fsdp2 2", "fsdp2", {"dp": 2}, False, 47.88, 2285.63),
            ("fsdp2_tp 2x2", "fsdp2_tp", {"dp": 2, "tp": 2}, False, 116.64, 1924.02)]
SPIKFORMER_ROWS = [("none", "none", {"dp": 1}, False, 85.54, 8262.18),
                   ("dp 2", "dp", {"dp": 2}, False, 87.62, 8279.84),
                   ("dp 2 + zero", "dp", {"dp": 2}, True, 89.30, 8279.84),
                   ("fsdp2 2", "fsdp2", {"dp": 2}, False, 91.82, 8260.82),
                   ("tp 2", "tp", {"tp": 2}, False, 197.99, 5379.38),
                   ("fsdp2_tp 2x2", "fsdp2_tp", {"dp": 2, "tp": 2}, False, 281.31, 5383.90)]
#: Pipeline (CIFAR10-DVS VGG, global batch 128, T = 10, 2 GPUs, 8 micro-batches): peak MB, throughput / 1 GPU.
PIPELINE_ROWS = [("1 GPU, batch 128", None, 15835.0, 1.0), ("GPipe pp 2", "gpipe", 9782.0, 0.91),
                 ("1F1B pp 2", "1f1b", 4973.0, 0.78)]
FEATURES = dict(allow_experimental_conv_tp=True, allow_experimental_spikformer_tp=True)
#: Whether estimate() takes the batch in the model's own layout (the input-layout work).
LAYOUTS = "layout" in inspect.signature(se.estimate).parameters
#: The fused neuron op the published runs ran (module doc); ``--sj-lif``: the installed 2.0.0's own op.
PUBLISHED_OP = None if "--sj-lif" in sys.argv[1:] else "triton"


def as_published(model):
    """``model`` with its spikingjelly LIF neurons marked with the fused op the published runs ran
    (:data:`PUBLISHED_OP`; module doc): the attribute a release with a ``backend`` argument keeps."""
    if PUBLISHED_OP is not None:
        for m in model.modules():
            if type(m).__name__ == "LIFNode" and type(m).__module__.startswith("spikingjelly"):
                m.backend = PUBLISHED_OP
    return model


def vgg(n: int = 16):
    """The package's CIFAR10DVSVGG, its batch ``[N, T=10, 2, 48, 48]``, labels, samples per rank and
    estimate()'s layout argument (module doc)."""
    from spikingjelly.activation_based.examples.memopt.models import CIFAR10DVSVGG  # optional dependency
    x = torch.zeros(n, 10, 2, 48, 48)
    if LAYOUTS:  # batch-major input, time-major [T, N, 10] output
        return as_published(CIFAR10DVSVGG()), x, torch.zeros(n, dtype=torch.long), n, dict(layout="batch_major/time_major")
    return as_published(CIFAR10DVSVGG()), x, None, 10, {}


def spikformer():
    """The package's spikformer_ti(T=8), its batch ``[T=8, N=16, 3, 224, 224]``, labels ``[16]``."""
    from spikingjelly.activation_based.model.spikformer import spikformer_ti  # optional dependency
    return as_published(spikformer_ti(T=8)), torch.zeros(8, 16, 3, 224, 224), torch.zeros(16, dtype=torch.long), 16, {}


def plan_of(model, mode: str, topology: dict, zero: bool, samples_per_rank: int):
    dp = topology.get("dp", 1)
    features = se.DistributedFeatureSet(allow_zero_optimizer=zero, **FEATURES)
    plan = se.plan(analysis=se.analyze(model), objective="speed", topology=topology, mode=mode,
                   batch_size=samples_per_rank * dp, features=features, neuron_backend="torch")
    if plan.uses_zero != zero:
        raise RuntimeError(f"{mode} {topology}: the plan's ZeRO is {plan.uses_zero}, the row's {zero}")
    if plan.uses_fsdp:  # the reference reshards its FSDP2 sub-modules after forward (module doc)
        plan = dataclasses.replace(plan, memopt_level=1)
    return plan


def predict(build, rows) -> List[dict]:
    """One dict per published row: published and predicted ms and MiB."""
    model, x, labels, samples_per_rank, layout = build()
    out = []
    for label, mode, topology, zero, ms, mb in rows:
        p = plan_of(model, mode, topology, zero, samples_per_rank)
        e = se.estimate(model, p, example_input=x, labels=labels, hardware=HARDWARE, **layout)
        time_ms = e.time.iloc[0]
        out.append(dict(plan=label, pub_ms=ms, pred_ms=e.step_time_s * 1e3, pub_mb=mb, pred_mb=e.peak_bytes / MIB,
                        compute_ms=time_ms["compute_s"] * 1e3, comm_ms=time_ms["exposed_comm_s"] * 1e3))
    return out


def vgg_chain(n: int):
    """The package's CIFAR10DVSVGG as a chain mode ``pp`` can cut: its own ``features`` and ``classifier``
    modules (the same objects, unmodified) with ``flatten(2)`` between them, as its forward calls them, on
    the batch time-major ``[T=10, N, 2, 48, 48]`` (its forward first transposes ``[N, T, ...]`` to that;
    mode ``pp`` cuts only a forward that chains modules); labels ``[N]``."""
    model = vgg(n)[0]
    chain = torch.nn.Sequential(model.features, torch.nn.Flatten(2), model.classifier)
    return chain, torch.zeros(10, n, 2, 48, 48), torch.zeros(n, dtype=torch.long)


def predict_pipeline() -> List[dict]:
    """The batch-128 single-GPU row and the pp = 2 rows (8 micro-batches, the planner's default stage cut):
    predicted peak and throughput relative to the single GPU's (its step time over the plan's)."""
    model, x, labels, samples, layout = vgg(128)
    single = se.estimate(model, plan_of(model, "none", {"dp": 1}, False, samples), example_input=x, labels=labels,
                         hardware=HARDWARE, **layout)
    chain, xt, labels = vgg_chain(128)
    rows = []
    for label, schedule, mb, ratio in PIPELINE_ROWS:
        row = dict(plan=label, pub_mb=mb, pub_ratio=ratio, pred_mb=single.peak_bytes / MIB, pred_ratio=1.0,
                   pred_ms=single.step_time_s * 1e3, cut="")
        if schedule is not None:
            plan = se.plan(analysis=se.analyze(chain), objective="speed", mode="pp", topology={"pp": 2}, batch_size=128,
                           neuron_backend="torch", options=se.PlanOptions(pp_microbatches=8, pp_schedule=schedule, pp_virtual_stages=1))
            e = se.estimate(chain, plan, example_input=xt, labels=labels, hardware=HARDWARE)
            row.update(pred_mb=e.peak_bytes / MIB, pred_ratio=single.step_time_s / e.step_time_s,
                       pred_ms=e.step_time_s * 1e3, cut=plan.pp_layout)
        rows.append(row)
    return rows


#: Stage cuts (pipeline units per stage) the ``--pp-cuts`` sweep tries: the published runs do not state theirs.
PP_CUTS = ("2|10", "3|9", "4|8", "6|6")


def print_pp_cuts() -> None:
    """GPipe and 1F1B (pp 2, 8 micro-batches, global batch 128) at each of :data:`PP_CUTS`: peak per stage and
    step time, to show which cut, if any, gives the published GPipe and 1F1B peaks together."""
    model, x, labels, samples, layout = vgg(128)
    single = se.estimate(model, plan_of(model, "none", {"dp": 1}, False, samples), example_input=x, labels=labels,
                         hardware=HARDWARE, **layout)
    chain, xt, labels = vgg_chain(128)
    print("\n## Pipeline stage cuts (published: GPipe 9782 MB at 0.91x, 1F1B 4973 MB at 0.78x)\n")
    print("| cut | schedule | peak MiB per stage | ratio to published | throughput / 1 GPU |\n|---|---|---|---|---|")
    for cut in PP_CUTS:
        for schedule, (_, _, mb, ratio) in (("gpipe", PIPELINE_ROWS[1]), ("1f1b", PIPELINE_ROWS[2])):
            plan = se.plan(analysis=se.analyze(chain), objective="speed", mode="pp", topology={"pp": 2}, batch_size=128,
                           neuron_backend="torch", options=se.PlanOptions(pp_microbatches=8, pp_schedule=schedule, pp_virtual_stages=1, pp_layout=cut))
            e = se.estimate(chain, plan, example_input=xt, labels=labels, hardware=HARDWARE)
            stages = " / ".join(f"{v / MIB:.0f}" for v in e.per_rank["peak_bytes"])
            shown = cut.replace("|", " \\| ")  # a bar would end the table cell
            print(f"| {shown} | {schedule} | {stages} | {e.peak_bytes / MIB / mb:.2f} "
                  f"| {single.step_time_s / e.step_time_s:.2f} (published {ratio:.2f}) |")


def order(rows, key: str) -> str:
    return " < ".join(r["plan"] for r in sorted(rows, key=lambda r: r[key]))


def error(pub: float, pred: Optional[float]) -> Optional[float]:
    return None if pred is None else pred / pub - 1.0


def print_model(name: str, rows: List[dict]) -> None:
    print(f"\n## {name}\n")
    print("| plan | published ms | predicted ms (compute + exposed comm) | ratio | published MB | predicted MiB "
          "| ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['plan']} | {r['pub_ms']:.2f} | {r['pred_ms']:.2f} ({r['compute_ms']:.2f} + {r['comm_ms']:.2f}) "
              f"| {r['pred_ms'] / r['pub_ms']:.2f} | {r['pub_mb']:.2f} | {r['pred_mb']:.1f} | {r['pred_mb'] / r['pub_mb']:.2f} |")
    same = order(rows, "pub_ms") == order(rows, "pred_ms")
    print(f"\nplan order, published: {order(rows, 'pub_ms')}\nplan order, predicted: {order(rows, 'pred_ms')}"
          f"\norder {'matches' if same else 'DIFFERS'}")


def print_pipeline(rows: List[dict]) -> None:
    print("\n## Pipeline (CIFAR10-DVS VGG, global batch 128, T = 10, 2 GPUs, 8 micro-batches)\n")
    print("pp rows: the package's own features and classifier chained as its forward calls them (mode pp cuts only "
          "a chain), time-major input; each stage's micro-batch traced and timed as the GPU runs it, the schedule "
          "replayed with the sends between the GPUs; the stage cut is the planner's default (the published one is "
          "not stated). Throughput relative to 1 GPU: its predicted step time over the plan's.\n")
    print("| plan | stage cut | published MB | predicted MiB | ratio | published throughput / 1 GPU | predicted "
          "(step ms) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cut = r["cut"].replace("|", " \\| ")  # a pp_layout's bar would end the table cell
        print(f"| {r['plan']} | {cut} | {r['pub_mb']:.0f} | {r['pred_mb']:.1f} | {r['pred_mb'] / r['pub_mb']:.2f} "
              f"| {r['pub_ratio']:.2f} | {r['pred_ratio']:.2f} ({r['pred_ms']:.1f}) |")


def summary(rows: List[dict]) -> None:
    print("\n## Summary\n")
    for what, pub, pred in (("time", "pub_ms", "pred_ms"), ("memory", "pub_mb", "pred_mb")):
        errs = [abs(error(r[pub], r.get(pred))) for r in rows if r.get(pred) is not None and pub in r]
        med, worst = statistics.median(errs), max(errs)
        t_med, t_worst = TARGETS[what]
        ok = med <= t_med and worst <= t_worst
        print(f"{what}: median |error| {med:.1%} (target {t_med:.0%}), worst {worst:.1%} (target {t_worst:.0%}) "
              f"over {len(errs)} rows: {'MEETS' if ok else 'MISSES'} the targets")


PHYSICS = ("H100-SXM", "A100-SXM-80GB", "RTX-4090")


def print_physics() -> None:
    """The same step (CIFAR10DVSVGG, batch 16, T = 10, one GPU) on every built-in single-node GPU profile, fp32
    and bf16: H100 < A100 < RTX 4090 and bf16 < fp32 must hold (more bandwidth and tensor FLOP/s, in that order)."""
    model, x, labels, n, layout = vgg()
    gate = se.DistributedFeatureSet(allow_mixed_precision=True)
    ms = {}
    for precision in ("fp32", "bf16"):
        plan = se.plan(analysis=se.analyze(model), objective="speed", topology={"dp": 1}, mode="none", batch_size=n,
                       features=gate, neuron_backend="torch", options=se.PlanOptions(precision=precision))
        for hw in PHYSICS:
            e = se.estimate(model, plan, example_input=x, labels=labels, hardware=hw, **layout)
            ms[(hw, plan.precision.name)] = e.step_time_s * 1e3
    print("\n## Physics (the VGG none step on each GPU profile)\n")
    print("| precision | " + " | ".join(PHYSICS) + " |\n|---|" + "---|" * len(PHYSICS))
    for precision in sorted({p for _, p in ms}):
        print(f"| {precision} | " + " | ".join(f"{ms[(hw, precision)]:.2f} ms" for hw in PHYSICS) + " |")
    ordered = all(ms[(PHYSICS[i], p)] < ms[(PHYSICS[i + 1], p)] for p in {p for _, p in ms} for i in range(2))
    halves = all(ms[(hw, "bf16")] < ms[(hw, "fp32")] for hw in PHYSICS if (hw, "bf16") in ms)
    print(f"\nH100 < A100 < RTX 4090: {'holds' if ordered else 'FAILS'}; bf16 < fp32: {'holds' if halves else 'FAILS'}")


def main() -> int:
    start = time.time()
    if "--pp-cuts" in sys.argv[1:]:  # the stage-cut sweep alone
        print_pp_cuts()
        print(f"\n({time.time() - start:.0f} s)")
        return 0
    if "--physics" in sys.argv[1:]:  # the physics line alone (it is also printed after the tables)
        print_physics()
        print(f"\n({time.time() - start:.0f} s)")
        return 0
    print(f"# Reference RTX 4090 tables vs snn_explorer estimate() on {HARDWARE}\n")
    print("CPU machine, predictions only, no GPU: every predicted figure comes from the GPU execution model "
          f"(torch {torch.__version__}). CIFAR10DVSVGG's batch-major input: "
          + ("estimate(layout='batch_major/time_major'), cross-entropy labels." if LAYOUTS else
             "passed as it is with time_steps = N (estimate() reads [T, N, ...] on this branch), no labels.")
          + " Optimizer Adam (the reference runtime's build_optimizer default); published MB read as MiB "
          "(max_memory_allocated / 1024 ** 2, as the package's own callbacks print MB). Fused LIF op: "
          + ("backend='triton' (saves h only), as the published runs ran it." if PUBLISHED_OP else
             "the installed 2.0.0's sj_lif (saves h, the input and v_init)."))
    vgg_rows = predict(vgg, VGG_ROWS)
    print_model("CIFAR10-DVS VGG (CIFAR10DVSVGG, batch 16 per rank, T = 10, 48 px)", vgg_rows)
    spik_rows = predict(spikformer, SPIKFORMER_ROWS)
    print_model("Spikformer-ti (spikformer_ti, batch 16 per rank, T = 8, 224 px)", spik_rows)
    pipe_rows = predict_pipeline()
    print_pipeline(pipe_rows)
    summary(vgg_rows + spik_rows + [dict(pub_mb=r["pub_mb"], pred_mb=r["pred_mb"]) for r in pipe_rows])
    print_physics()
    print(f"\n({time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
