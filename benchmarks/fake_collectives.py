"""Estimated collectives against those recorded on one rank of a fake process group, at cluster scale.

The 7 B spiking LLM (``zoo/llm.py``, built on ``meta``: no weights) planned for 512 ranks (FSDP2) and
for 64 ranks (FSDP2 x TP 8 x 8); one training step of each plan runs on rank 0 of torch's fake
process group with FakeTensors (``record_collectives``): FSDP2's all-gathers and reduce-scatters and
DTensor's redistributions are issued and counted as on a real rank, nothing is allocated or sent.
The table prints, per mesh dim, kind and phase, the recorded and estimated count and bytes, and
whether they are equal; then the time each recording took and this process's peak memory.

Run: ``PYTHONPATH=. python benchmarks/fake_collectives.py`` (a few minutes on 2 cores).
"""
from __future__ import annotations

import resource
import time

import pandas as pd

import snn_explorer as se
from snn_explorer.estimator import estimate, record_collectives
from snn_explorer.zoo.llm import build_llm, token_batch

KEY = ["mesh_dim", "kind", "phase"]
FEATURES = se.DistributedFeatureSet(allow_mixed_precision=True)


def _plans(model, analysis):
    fsdp = se.plan(analysis=analysis, objective="speed", mode="fsdp2", topology={"dp": 512}, batch_size=512,
                   precision="bf16", features=FEATURES)
    hybrid = se.plan(analysis=analysis, objective="speed", mode="fsdp2_tp", topology={"dp": 8, "tp": 8},
                     batch_size=64, precision="bf16", features=FEATURES, tensor_parallel_plan=model.tensor_parallel_plan())
    return (("fsdp2 x512", fsdp, "64x8-H100-SXM-96GB"), ("fsdp2_tp 8x8", hybrid, "8x8-H100-SXM-96GB"))


def compare(time_steps: int = 2, seq: int = 256) -> pd.DataFrame:
    model = build_llm("spiking-llm-7b", device="meta")
    analysis = se.analyze(model)
    tables = []
    for label, plan, hardware in _plans(model, analysis):
        tokens = token_batch(model.config, time_steps, plan.batch_size, seq)
        start = time.perf_counter()
        recorded = record_collectives(model, plan, tokens, layout=se.TIME_MAJOR, optimizer="adamw")
        took = time.perf_counter() - start
        estimated = estimate(model, plan, example_input=tokens, hardware=hardware, optimizer="adamw",
                             layout=se.TIME_MAJOR).collectives
        table = recorded.merge(estimated[KEY + ["count", "bytes"]], on=KEY, how="outer",
                               suffixes=("_recorded", "_estimated"))
        table["equal"] = ((table["count_recorded"] == table["count_estimated"])
                          & (table["bytes_recorded"] == table["bytes_estimated"]))
        table.insert(0, "plan", label)
        table["record_s"] = round(took, 1)
        tables.append(table)
    return pd.concat(tables, ignore_index=True)


def main() -> None:
    table = compare()
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table.to_string(index=False))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    print(f"\nall rows equal: {bool(table['equal'].all())}; process peak {rss:.2f} GiB")


if __name__ == "__main__":
    main()
