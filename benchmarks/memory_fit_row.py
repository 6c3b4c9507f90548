"""The spikformer 75 % row of benchmarks/results/memory_fit.md, measured (not a test).

Run: ``python benchmarks/memory_fit_row.py``. fit_budget's plan for 75 % of spikformer's unlevered peak (zoo
size tiny, T = 16, 2 ranks, step times for the H100-SXM profile, only the checkpointing gate open, so no
offload lever, which CPU ranks refuse), its estimate and ``measure()`` on 2 gloo ranks, beside the same plan
without levers."""
import time

import snn_explorer as se
from snn_explorer.core.levers import copy_without_levers
from snn_explorer.estimator import measure
from snn_explorer.zoo import build

z = build("spikformer", "tiny", time_steps=16)
gates = se.DistributedFeatureSet(allow_activation_checkpointing=True)
top = se.fit_budget(z.model, z.example_input, 2 ** 50, 2, labels=z.labels, hardware="H100-SXM", features=gates)
found = se.fit_budget(z.model, z.example_input, int(top.estimate.peak_bytes * 0.75), 2, labels=z.labels,
                      hardware="H100-SXM", features=gates)
print(found.table[["plan", "peak_bytes", "step_time_s", "outcome"]].head(6).to_string(), flush=True)
estimate_of = se.plan_estimator(z.model, z.example_input, z.labels, hardware="H100-SXM")
for plan in (found.plan, copy_without_levers(found.plan)):
    est = estimate_of(plan)
    started = time.time()
    got = measure(z.model, plan, example_input=z.example_input, labels=z.labels)
    print(repr(plan), "estimated", est.peak_bytes, "measured", got.peak_bytes,
          f"rel {(est.peak_bytes - got.peak_bytes) / got.peak_bytes:+.4f}", f"{time.time() - started:.1f}s", flush=True)
