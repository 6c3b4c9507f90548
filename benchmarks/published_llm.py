"""The estimator against a published large-model row, then the 7 B spiking LLM's plans at scale.

1. Llama 3.1 8B from its published config, built on the meta device (no weights) and profiled
   shape-only, estimated as torchtitan ran it: 8 x H100 SXM 96 GB HBM2e (the built-in profile
   ``H100-SXM-96GB``, datasheet figures), FSDP2, bf16 (fp32 master weights and reductions),
   AdamW, local batch 2 x sequence 8192. Published (torchtitan
   ``benchmarks/llama3_h100_202412_torchtitan.md``, Table 1, row "FSDP"): 5,762 tokens/s per GPU
   and 82.4 GiB, where the memory is ``torch.cuda.memory_stats()["reserved_bytes.all.peak"]``
   (torchtitan ``train.py`` logs ``max_reserved_gib``; the caching allocator's reserved peak, not
   the bytes allocated). Targets: memory within 10 %, throughput within 20 %. Nothing here is
   fitted to that row. The row used selective *op* activation checkpointing; the plans here express
   activation checkpointing per block (every k-th block, torchtitan's "selective layer"), so the
   row is estimated without checkpointing, with every 2nd block and with every block checkpointed.
2. The 7 B spiking LLM (``zoo.llm``, T time steps of sequence S) on 8, 64 and 512 GPUs of that
   kind: FSDP2, FSDP2 x TP (TP = 8, inside a node) and, from 64 GPUs, the 3-D plan pp x dp x tp
   (mode ``pp_tp``: pp = 2 stages across nodes, TP = 8 inside a node, the rest dp), fastest first
   among those that fit in 96 GB, with predicted peak and step time. The first estimate (512 ranks) is timed, with the
   process's peak memory (target: under 30 s and 2 GiB on this machine).

Run: ``PYTHONPATH=. python benchmarks/published_llm.py`` (several minutes on 2 cores).
"""
from __future__ import annotations

import resource
import sys
import time

import pandas as pd

import snn_explorer as se
from snn_explorer.estimator import estimate
from snn_explorer.zoo.llm import build_llm, token_batch

PUBLISHED = dict(tokens_per_s=5762.0, memory_gib=82.4)
HBM_BYTES = 96e9  # the card's 96 GB
FEATURES = se.DistributedFeatureSet(allow_mixed_precision=True, allow_activation_checkpointing=True)
GIB = 2 ** 30


def _plan(model, mode, topology, batch, checkpointing=None, every=1):
    return se.plan(analysis=se.analyze(model), objective="speed", neuron_backend="torch", mode=mode,
                   topology=topology, batch_size=batch, precision="bf16", features=FEATURES,
                   activation_checkpointing=checkpointing, checkpoint_every=every)


def llama_rows() -> pd.DataFrame:
    model = build_llm("llama3.1-8b", device="meta")
    tokens = token_batch(model.config, 1, 16, 8192)  # global batch 16 = 8 ranks x 2, T = 1 (not spiking)
    rows = []
    for label, checkpointing, every in (("none", None, 1), ("every 2nd block", "blocks", 2),
                                        ("every block", "blocks", 1)):
        plan = _plan(model, "fsdp2", {"dp": 8}, 16, checkpointing, every)
        start = time.perf_counter()
        est = estimate(model, plan, example_input=tokens, hardware="H100-SXM-96GB", optimizer="adamw",
                       layout=se.TIME_MAJOR)
        tps = 2 * 8192 / est.step_time_s
        peak = est.peak_bytes / GIB
        rows.append(dict(checkpointing=label, peak_gib=round(peak, 1), published_gib=PUBLISHED["memory_gib"],
                         memory_err=f"{peak / PUBLISHED['memory_gib'] - 1:+.1%}", tokens_per_s_gpu=round(tps),
                         published_tps=PUBLISHED["tokens_per_s"], tps_err=f"{tps / PUBLISHED['tokens_per_s'] - 1:+.1%}",
                         estimate_s=round(time.perf_counter() - start, 1)))
    return pd.DataFrame(rows)


def spiking_plans(model, world: int, time_steps: int, seq: int) -> pd.DataFrame:
    """FSDP2 (one sample per rank), FSDP2 x TP=8 and (from 64 GPUs) pp=2 x dp x TP=8 plans of ``model`` on
    ``world`` GPUs, one global batch of ``world`` sequences, fastest first."""
    hardware = {8: "H100-SXM-96GB", 64: "8x8-H100-SXM-96GB", 512: "64x8-H100-SXM-96GB"}[world]
    tokens = token_batch(model.config, time_steps, world, seq)
    candidates = [("fsdp2", {"dp": world}, None), ("fsdp2", {"dp": world}, "blocks"),
                  ("fsdp2_tp", {"dp": world // 8, "tp": 8}, None)]
    if world >= 64:
        candidates.append(("pp_tp", {"pp": 2, "dp": world // 16, "tp": 8}, None))
    rows = []
    for mode, topology, checkpointing in candidates:
        if mode in ("fsdp2_tp", "pp_tp"):
            plan = se.plan(analysis=se.analyze(model), objective="speed", neuron_backend="torch", mode=mode,
                           topology=topology, batch_size=world, precision="bf16", features=FEATURES,
                           tensor_parallel_plan=model.tensor_parallel_plan())
        else:
            plan = _plan(model, mode, topology, world, checkpointing)
        start = time.perf_counter()
        est = estimate(model, plan, example_input=tokens, hardware=hardware, optimizer="adamw",
                       layout=se.TIME_MAJOR)
        row = est.summary()
        rows.append(dict(world=world, mode=row["mode"], mesh=row["mesh"], checkpointing=checkpointing or "none",
                         batch_per_rank=row["batch_per_rank"], peak_gib=round(est.peak_bytes / GIB, 1),
                         fits=est.peak_bytes <= HBM_BYTES, step_s=round(est.step_time_s, 3),
                         tokens_per_s_gpu=round(world * seq / est.step_time_s / world),
                         estimate_s=round(time.perf_counter() - start, 1)))
    table = pd.DataFrame(rows)
    return table.sort_values(["fits", "step_s"], ascending=[False, True]).reset_index(drop=True)


def main(time_steps: int = 4, seq: int = 2048) -> None:
    model = build_llm("spiking-llm-7b", device="meta")
    print(f"spiking-llm-7b: {model.config.param_count() / 1e9:.2f} B parameters, T = {time_steps}, "
          f"sequence {seq}, one sequence per data-parallel rank")
    start = time.perf_counter()
    plan = _plan(model, "fsdp2", {"dp": 512}, 512)
    estimate(model, plan, example_input=token_batch(model.config, time_steps, 512, seq),
             hardware="64x8-H100-SXM-96GB", optimizer="adamw", layout=se.TIME_MAJOR)
    took, rss = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    print(f"first estimate of the 7 B spiking LLM for 512 ranks: {took:.1f} s (target < 30 s), process peak "
          f"{rss:.2f} GiB (target < 2 GiB)\n")
    print("Llama 3.1 8B, 8 x H100-SXM-96GB, FSDP2 bf16, local batch 2 x 8192 (torchtitan Table 1: 5,762 tokens/s, "
          "82.4 GiB reserved, selective op checkpointing)")
    print(llama_rows().to_string(index=False), "\n")
    for world in (8, 64, 512):
        print(spiking_plans(model, world, time_steps, seq).to_string(index=False), "\n")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
