"""The estimator against a published large-model row, then the 7 B spiking LLM's plans at scale.

1. Llama 3.1 8B from its published config, built on the meta device (no weights) and profiled
   shape-only, estimated as torchtitan ran it: 8 x H100 SXM 96 GB HBM2e (the built-in profile
   ``H100-SXM-96GB``, datasheet figures), FSDP2, bf16 (fp32 master weights and reductions),
   AdamW, local batch 2 x sequence 8192. Published (torchtitan
   ``benchmarks/llama3_h100_202412_torchtitan.md``, Table 1, row "FSDP"): 5,762 tokens/s per GPU
   and 82.4 GiB, where the memory is ``torch.cuda.memory_stats()["reserved_bytes.all.peak"]``
   (torchtitan ``train.py`` logs ``max_reserved_gib``; the caching allocator's reserved peak, not
   the bytes allocated). Targets: memory within 10 %, throughput within 20 %. Nothing here is
   fitted to that row. The row used selective *op* activation checkpointing, which the plan states
   as ``activation_checkpointing="ops"`` (torchtitan's policy: each decoder block keeps the outputs
   of its matrix products but every second one, and of its attention kernel; the rest is
   recomputed); the loss is torchtitan's, cross-entropy of the fp32 scores of every position
   against next-token labels. Rows without checkpointing, every 2nd and every block bracket it.
   Beside the row: what the op policy keeps of one block (counted by running it on a small model of
   the same block shape), the activations kept, and the recompute (FLOPs as a fraction of a forward,
   seconds per step against the row without checkpointing).
2. The 7 B spiking LLM (``zoo.llm``, T time steps of sequence S, next-token cross-entropy of the
   time-mean scores) on 8, 64 and 512 GPUs of that kind: FSDP2 (no checkpointing, every block,
   op-level), FSDP2 x TP (TP = 8, inside a node) and, from 64 GPUs, the 3-D plans pp x dp x tp
   (mode ``pp_tp``: pp = 2 stages across nodes, TP = 8 inside a node, the rest dp replicating the stages)
   and pp x fsdp2 x tp (mode ``pp_fsdp2_tp``: the same stages FSDP2-sharded over dp), fastest first
   among those that fit in 96 GB, with predicted peak and step time. The first estimate (512 ranks) is timed, with the
   process's peak memory (target: under 30 s and 2 GiB on this machine).
3. spikingjelly's LLM planner (``spikingjelly.activation_based.distributed.llm``, which imports here;
   Megatron Core, which its configs are made of, does not): its static memory figure for the same
   spiking LLM config beside ours, and what each counts. Its ``plan_training`` needs Megatron's
   ``TransformerConfig``; the formulas it holds against the budget are evaluated on the fields it
   reads (:func:`snn_explorer.compat.spikingjelly_llm_planner_bytes`).

Run: ``PYTHONPATH=. python benchmarks/published_llm.py`` (several minutes on 2 cores).
"""
from __future__ import annotations

import dataclasses
import resource
import sys
import time
from collections import Counter
from importlib.metadata import version
from types import SimpleNamespace

import pandas as pd
import torch

import snn_explorer as se
from snn_explorer import compat
from snn_explorer.core.model import TIME_MAJOR
from snn_explorer.core.parallelize import TORCHTITAN_OPS, checkpoint_blocks
from snn_explorer.estimator import estimate
from snn_explorer.zoo.llm import LLM_CONFIGS, build_llm, token_batch

PUBLISHED = dict(tokens_per_s=5762.0, memory_gib=82.4)
HBM_BYTES = 96e9  # the card's 96 GB
FEATURES = se.DistributedFeatureSet(allow_mixed_precision=True, allow_activation_checkpointing=True)
GIB = 2 ** 30


def _plan(model, mode, topology, batch, checkpointing=None, every=1):
    return se.plan(analysis=se.analyze(model), objective="speed", neuron_backend="torch", mode=mode,
                   topology=topology, batch_size=batch, features=FEATURES, options=se.PlanOptions(precision="bf16", activation_checkpointing=checkpointing, checkpoint_every=every))


def next_tokens(cfg, batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    """Next-token labels ``[N, S]`` (random ids: only their shape matters to the estimate)."""
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def op_policy_of_one_block(name: str) -> str:
    """What torchtitan's op policy keeps of one decoder block of config ``name``: the forward decisions
    counted while a one-block model of that block's code (small widths: the operators do not depend on
    them) runs forward and backward checkpointed with the policy."""
    cfg = dataclasses.replace(LLM_CONFIGS[name], vocab_size=64, dim=64, n_heads=4, ffn_dim=128, n_layers=1,
                              n_kv_heads=None if LLM_CONFIGS[name].spiking else 2)
    model = build_llm(cfg)
    tally: Counter = Counter()
    checkpoint_blocks(model, ["blocks.0"], saved_ops=TORCHTITAN_OPS, tally=tally)
    model(token_batch(cfg, 2 if cfg.spiking else 1, 1, 16)).float().square().mean().backward()
    kept = ", ".join(f"{op.split('.')[1]} {n}" for (op, d), n in sorted(tally.items()) if d == "save")
    mm = f"{tally[('aten.mm.default', 'save')]} of {tally[('aten.mm.default', 'save')] + tally[('aten.mm.default', 'recompute')]}"
    others = sum(n for (op, d), n in tally.items() if d == "recompute" and op != "aten.mm.default")
    return f"kept: {kept} (matrix products {mm}); recomputed: {others} other operator calls (views included)"


def llama_rows() -> pd.DataFrame:
    model = build_llm("llama3.1-8b", device="meta")
    tokens = token_batch(model.config, 1, 16, 8192)  # global batch 16 = 8 ranks x 2, T = 1 (not spiking)
    labels = next_tokens(model.config, 16, 8192)  # torchtitan's loss: cross-entropy of every position
    rows, plain_s = [], None
    for label, checkpointing, every in (("none", None, 1), ("every 2nd block", "blocks", 2),
                                        ("every block", "blocks", 1), ("ops (torchtitan's)", "ops", 1)):
        plan = _plan(model, "fsdp2", {"dp": 8}, 16, checkpointing, every)
        start = time.perf_counter()
        est = estimate(model, plan, example_input=tokens, labels=labels, hardware="H100-SXM-96GB",
                       optimizer="adamw", layout=TIME_MAJOR)
        plain_s = est.step_time_s if plain_s is None else plain_s
        tps = 2 * 8192 / est.step_time_s
        peak = est.peak_bytes / GIB
        rows.append(dict(checkpointing=label, peak_gib=round(peak, 1), published_gib=PUBLISHED["memory_gib"],
                         memory_err=f"{peak / PUBLISHED['memory_gib'] - 1:+.1%}", tokens_per_s_gpu=round(tps),
                         published_tps=PUBLISHED["tokens_per_s"], tps_err=f"{tps / PUBLISHED['tokens_per_s'] - 1:+.1%}",
                         activations_gib=round(est.per_rank["activations_bytes"].max() / GIB, 1),
                         recompute_fwd=round(est.recompute_forward_fraction, 2),
                         recompute_s=round(est.step_time_s - plain_s, 3),
                         estimate_s=round(time.perf_counter() - start, 1)))
    return pd.DataFrame(rows)


def spiking_plans(model, world: int, time_steps: int, seq: int) -> pd.DataFrame:
    """FSDP2 (one sample per rank), FSDP2 x TP=8 and (from 64 GPUs) pp=2 x (dp | fsdp2) x TP=8 plans of ``model`` on
    ``world`` GPUs, one global batch of ``world`` sequences, fastest first."""
    hardware = {8: "H100-SXM-96GB", 64: "8x8-H100-SXM-96GB", 512: "64x8-H100-SXM-96GB"}[world]
    tokens = token_batch(model.config, time_steps, world, seq)
    labels = next_tokens(model.config, world, seq)
    candidates = [("fsdp2", {"dp": world}, None), ("fsdp2", {"dp": world}, "blocks"), ("fsdp2", {"dp": world}, "ops"),
                  ("fsdp2_tp", {"dp": world // 8, "tp": 8}, None)]
    if world >= 64:
        candidates += [(mode, {"pp": 2, "dp": world // 16, "tp": 8}, None) for mode in ("pp_tp", "pp_fsdp2_tp")]
    rows = []
    for mode, topology, checkpointing in candidates:
        if mode in ("fsdp2_tp", "pp_tp", "pp_fsdp2_tp"):
            plan = se.plan(analysis=se.analyze(model), objective="speed", neuron_backend="torch", mode=mode,
                           topology=topology, batch_size=world, features=FEATURES, options=se.PlanOptions(precision="bf16", tensor_parallel_plan=model.tensor_parallel_plan()))
        else:
            plan = _plan(model, mode, topology, world, checkpointing)
        start = time.perf_counter()
        est = estimate(model, plan, example_input=tokens, labels=labels, hardware=hardware, optimizer="adamw",
                       layout=TIME_MAJOR)
        row = est.summary()
        rows.append(dict(world=world, mode=row["mode"], mesh=row["mesh"], checkpointing=checkpointing or "none",
                         batch_per_rank=row["batch_per_rank"], peak_gib=round(est.peak_bytes / GIB, 1),
                         activations_gib=round(est.per_rank["activations_bytes"].max() / GIB, 1),
                         fits=est.peak_bytes <= HBM_BYTES, step_s=round(est.step_time_s, 3),
                         tokens_per_s_gpu=round(world * seq / est.step_time_s / world),
                         estimate_s=round(time.perf_counter() - start, 1)))
    table = pd.DataFrame(rows)
    return table.sort_values(["fits", "step_s"], ascending=[False, True]).reset_index(drop=True)


def spikingjelly_version() -> str:
    return version("spikingjelly")


def megatron_fields(cfg, time_steps: int, seq: int) -> SimpleNamespace:
    """The fields of a spikingjelly ``TrainingConfig`` its LLM planner reads, for our config ``cfg`` trained
    as here: bf16 (Megatron's bf16 parameters), one sequence per micro-batch, RMSNorm, rotary positions."""
    transformer = SimpleNamespace(hidden_size=cfg.dim, ffn_hidden_size=cfg.ffn_dim, num_attention_heads=cfg.n_heads,
                                  num_query_groups=cfg.kv_heads, kv_channels=cfg.head_dim,
                                  gated_linear_unit=not cfg.spiking, normalization="RMSNorm", fp16=False, bf16=True,
                                  num_layers=cfg.n_layers, params_dtype=torch.bfloat16)
    model = SimpleNamespace(transformer=transformer, vocab_size=cfg.vocab_size, max_sequence_length=seq,
                            time_steps=time_steps, share_embeddings_and_output_weights=cfg.tied_embeddings,
                            position_embedding_type="rope")
    return SimpleNamespace(model=model, sequence_length=seq, micro_batch_size=1)


def reference_side_by_side(model, plans8: pd.DataFrame, time_steps: int, seq: int) -> pd.DataFrame:
    """spikingjelly 2.0.0's LLM planner (``activation_based.distributed.llm``) beside our estimate, the 7 B
    spiking LLM on 8 GPUs with data-parallel sharding over 8 (its distributed optimizer; our FSDP2), without
    recompute and with its selective recompute (Megatron's ``core_attn``) against our op-level checkpointing."""
    fields = megatron_fields(model.config, time_steps, seq)
    rows = []
    for selective, ours in ((False, "none"), (True, "ops")):
        params, activations = compat.spikingjelly_llm_planner_bytes(fields, 1, 1, 1, 8, selective)
        row = plans8[plans8["checkpointing"] == ours].iloc[0]
        rows.append(dict(reference=f"selective recompute={selective}", reference_gib=round((params + activations) / GIB, 1),
                         reference_params_optim_gib=round(params / GIB, 1),
                         reference_activations_gib=round(activations / GIB, 1), ours=f"fsdp2 {ours}",
                         ours_peak_gib=row["peak_gib"], ours_activations_gib=row["activations_gib"]))
    return pd.DataFrame(rows)


REFERENCE_COUNTS = """what each counts:
  spikingjelly's planner: static formulas per GPU. Parameters x (6 + 12 / dp) bytes in bf16 (bf16 weight, fp32
    gradient, fp32 master and Adam moments sharded over dp). Activations: sequence x (micro-batch x T) x hidden x
    (10 + 24 / tp) per layer without recompute, (18 + 4 ffn / hidden) with selective recompute, plus the embedding and
    the output layer's scores; no neuron state, no temporaries of the backward, no communication buffers, not the
    caching allocator's reserve.
  ours: the shape-only run of the model as a rank runs it: every parameter, gradient and optimizer-state tensor of
    the rank's FSDP2 shard, each tensor autograd saves (neuron state and spikes included, checkpointing applied),
    FSDP2's all-gather / reduce-scatter buffers replayed at torch's points, and the peak of the forward, backward
    and optimizer step (allocated bytes; the allocator's reserve is not modelled)."""


def main(time_steps: int = 4, seq: int = 2048) -> None:
    model = build_llm("spiking-llm-7b", device="meta")
    print(f"spiking-llm-7b: {model.config.param_count() / 1e9:.2f} B parameters, T = {time_steps}, "
          f"sequence {seq}, one sequence per data-parallel rank")
    start = time.perf_counter()
    plan = _plan(model, "fsdp2", {"dp": 512}, 512)
    estimate(model, plan, example_input=token_batch(model.config, time_steps, 512, seq),
             labels=next_tokens(model.config, 512, seq), hardware="64x8-H100-SXM-96GB", optimizer="adamw",
             layout=TIME_MAJOR)
    took, rss = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    print(f"first estimate of the 7 B spiking LLM for 512 ranks: {took:.1f} s (target < 30 s), process peak "
          f"{rss:.2f} GiB (target < 2 GiB)\n")
    print("Llama 3.1 8B, 8 x H100-SXM-96GB, FSDP2 bf16, local batch 2 x 8192 (torchtitan Table 1: 5,762 tokens/s, "
          "82.4 GiB reserved, selective op checkpointing)")
    print(f"op policy, one Llama 3.1 block: {op_policy_of_one_block('llama3.1-8b')}")
    print(llama_rows().to_string(index=False), "\n")
    tables = {world: spiking_plans(model, world, time_steps, seq) for world in (8, 64, 512)}
    for table in tables.values():
        print(table.to_string(index=False), "\n")
    print(f"spikingjelly {spikingjelly_version()}'s LLM planner and ours, spiking-llm-7b, T = {time_steps}, "
          f"sequence {seq}, 8 GPUs")
    print(reference_side_by_side(model, tables[8], time_steps, seq).to_string(index=False))
    print(REFERENCE_COUNTS)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
