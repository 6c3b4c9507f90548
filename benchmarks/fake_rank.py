"""The estimate against one rank of a fake process group, at cluster scale: collectives and peak memory.

The 7 B spiking LLM (``zoo/llm.py``, built on ``meta``: no weights) planned for 512 ranks (FSDP2) and
for 64 ranks (FSDP2 x TP 8 x 8); training steps of each plan run on rank 0 of torch's fake process
group with FakeTensors (``record_rank_step``): FSDP2's all-gathers and reduce-scatters and DTensor's
redistributions are issued and counted as on a real rank, torch's MemTracker follows the storages,
nothing is allocated or sent. The first table prints, per mesh dim, kind and phase, the recorded and
estimated count and bytes and whether they are equal; the second the fake rank's tracked peak beside
the estimated one, and the time each run took; then this process's peak memory.

Run: ``PYTHONPATH=. python benchmarks/fake_rank.py`` (a few minutes on 2 cores).
"""
from __future__ import annotations

import resource
import time

import pandas as pd

import snn_explorer as se
from snn_explorer.core.model import TIME_MAJOR
from snn_explorer.estimator import estimate, record_rank_step
from snn_explorer.zoo.llm import build_llm, token_batch

KEY = ["mesh_dim", "kind", "phase"]
GIB = 2 ** 30
FEATURES = se.DistributedFeatureSet(allow_mixed_precision=True)


def _plans(model, analysis):
    fsdp = se.plan(analysis=analysis, objective="speed", mode="fsdp2", topology={"dp": 512}, batch_size=512,
                   features=FEATURES, options=se.PlanOptions(precision="bf16"))
    hybrid = se.plan(analysis=analysis, objective="speed", mode="fsdp2_tp", topology={"dp": 8, "tp": 8},
                     batch_size=64, features=FEATURES, options=se.PlanOptions(precision="bf16", tensor_parallel_plan=model.tensor_parallel_plan()))
    return (("fsdp2 x512", fsdp, "64x8-H100-SXM-96GB"), ("fsdp2_tp 8x8", hybrid, "8x8-H100-SXM-96GB"))


def compare(time_steps: int = 2, seq: int = 256):
    """``(collective rows, peak rows)`` of both plans."""
    model = build_llm("spiking-llm-7b", device="meta")
    analysis = se.analyze(model)
    tables, peaks = [], []
    for label, plan, hardware in _plans(model, analysis):
        tokens = token_batch(model.config, time_steps, plan.batch_size, seq)
        start = time.perf_counter()
        fake = record_rank_step(model, plan, tokens, layout=TIME_MAJOR, optimizer="adamw")
        took = time.perf_counter() - start
        est = estimate(model, plan, example_input=tokens, hardware=hardware, optimizer="adamw", layout=TIME_MAJOR)
        table = fake.collectives.merge(est.collectives[KEY + ["count", "bytes"]], on=KEY, how="outer",
                                       suffixes=("_recorded", "_estimated"))
        table["equal"] = ((table["count_recorded"] == table["count_estimated"])
                          & (table["bytes_recorded"] == table["bytes_estimated"]))
        table.insert(0, "plan", label)
        tables.append(table)
        peaks.append(dict(plan=label, fake_rank_peak_gib=round(fake.peak_bytes / GIB, 2),
                          estimated_peak_gib=round(est.peak_bytes / GIB, 2),
                          error=f"{est.peak_bytes / fake.peak_bytes - 1:+.2%}", fake_rank_s=round(took, 1)))
    return pd.concat(tables, ignore_index=True), pd.DataFrame(peaks)


def main() -> None:
    table, peaks = compare()
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table.to_string(index=False), "\n")
        print(peaks.to_string(index=False))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    print(f"\nall rows equal: {bool(table['equal'].all())}; process peak {rss:.2f} GiB")


if __name__ == "__main__":
    main()
