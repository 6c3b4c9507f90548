"""Tensor parallelism of Llama-style blocks as torchtitan shards them: the SwiGLU pair (w1, w3 column-wise, w2
row-wise) found from the traced forward, whatever the Linears are called, and attention split by whole (k/v) heads;
the default plan finds both, plans and estimates of tp / fsdp2_tp on the meta device, and on 4 gloo ranks a few
AdamW steps under tp=4 and fsdp2_tp 2x2 equal the unsharded model's."""
import pytest
import torch
from distributed_harness import run_on_ranks
from torch import nn

import snn_explorer as se
from snn_explorer.core.model import TIME_MAJOR, SNNDistributedAnalysis
from snn_explorer.zoo.llm import LLM_CONFIGS, LLMConfig, build_llm, token_batch

SMALL = LLMConfig(vocab_size=64, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=128, spiking=False)
STEPS, BATCH, SEQ = 3, 4, 8


class Gated(nn.Module):
    """A SwiGLU with names nothing knows: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, combine):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
        self.act, self.combine = nn.SiLU(), combine

    def forward(self, x):
        return self.down(self.combine(self, x))


def _swiglu(m, x):
    return m.act(m.gate(x)) * m.up(x)


def _mixes_features(m, x):
    return m.gate(x) * m.up(x).sum(-1, keepdim=True)  # a sum over features: each rank would sum its shard only


def _chain(m, x):
    return m.act(m.up(m.gate(x).repeat(1, 1)[..., :8]))


def _two_inputs(m, x):
    return m.gate(x) * m.up(x.flip(0))  # same width, but not the same input tensor


def test_a_gated_mlp_is_found_from_its_dataflow_not_its_names():
    found = se.analyze(Gated(_swiglu)).gated_mlps
    assert [(g.branches, g.proj, g.between) for g in found] == [(("gate", "up"), "down", ("act",))]
    for combine in (_mixes_features, _chain, _two_inputs):
        assert se.analyze(Gated(combine)).gated_mlps == (), combine.__name__


def test_the_llama_plan_is_accepted_and_the_default_plan_finds_it():
    """torchtitan's plan of each block (the one the issue saw refused: w3 read as fed by w1) plans, and with no
    plan given the default one is the same, the vocab head gathering its output."""
    model = build_llm(SMALL)
    analysis = se.analyze(model)
    assert len(analysis.gated_mlps) == 2 and all(b.local_heads for b in analysis.attention_blocks)
    own = model.tensor_parallel_plan()
    for mode, topology in (("tp", {"tp": 4}), ("fsdp2_tp", {"dp": 2, "tp": 2})):
        given = se.plan(analysis=analysis, objective="memory", topology=topology, batch_size=4, mode=mode, options=se.PlanOptions(tensor_parallel_plan=own))
        default = se.plan(analysis=analysis, objective="memory", topology=topology, batch_size=4, mode=mode)
        assert given.tensor_parallel_plan == own
        assert default.tensor_parallel_plan == dict(own, head="colwise_gather")
        assert not any("not split by heads" in n for n in default.notes)
    assert SNNDistributedAnalysis.from_dict(analysis.to_dict()) == analysis


@pytest.mark.parametrize("change,match", [
    ({"blocks.0.mlp.w3": "rowwise"}, "gated MLP 'blocks.0.mlp'"),
    ({"blocks.0.mlp.w3": "colwise_gather"}, "gated MLP 'blocks.0.mlp'"),
    ({"blocks.1.attn.o": "colwise_gather"}, "split by heads only"),
])
def test_a_broken_llama_plan_is_refused(change, match):
    model = build_llm(SMALL)
    with pytest.raises(ValueError, match=match):
        se.plan(analysis=se.analyze(model), objective="memory", topology={"tp": 2}, batch_size=4, mode="tp", options=se.PlanOptions(tensor_parallel_plan=dict(model.tensor_parallel_plan(), **change)))


def test_tp_must_divide_the_kv_heads():
    model = build_llm(SMALL, n_kv_heads=2)
    with pytest.raises(ValueError, match="does not divide the 2 k/v heads of blocks.0.attn"):
        se.plan(analysis=se.analyze(model), objective="memory", topology={"tp": 4}, batch_size=4, mode="tp")


def test_llama_tp_and_fsdp2_tp_estimate_on_meta():
    """Llama 3.1 8B's widths (4 of its 32 blocks), built on meta: each rank holds the embedding whole and 1/tp of
    every block Linear and of the vocab head (and 1/dp of that under fsdp2_tp), fp32."""
    cfg = LLM_CONFIGS["llama3.1-8b"]
    model = build_llm(cfg, device="meta", n_layers=4)
    tokens = token_batch(model.config, 1, 8, 64)
    linears = sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, nn.Linear))
    norms = (2 * 4 + 1) * cfg.dim
    analysis = se.analyze(model)
    for mode, topology, tp, dp in (("tp", {"tp": 8}, 8, 1), ("fsdp2_tp", {"dp": 2, "tp": 4}, 4, 2)):
        plan = se.plan(analysis=analysis, objective="memory", topology=topology, batch_size=8, mode=mode)
        assert plan.tensor_parallel_plan["blocks.3.mlp.w3"] == "colwise"
        est = se.estimate(model, plan, example_input=tokens, hardware="H100-SXM", optimizer="adamw",
                          layout=TIME_MAJOR)
        held = (cfg.vocab_size * cfg.dim + norms) / (dp if mode == "fsdp2_tp" else 1) + linears / tp / dp
        assert est.per_rank["params_bytes"].max() == pytest.approx(4 * held, rel=1e-3)
        assert est.step_time_s > 0 and "all_reduce" in set(est.collectives["kind"])


def _train(mode, topology):
    """On each rank: the small Llama unsharded and under ``mode``, the same weights, tokens and AdamW steps."""
    import torch.distributed as dist

    def fresh():
        torch.manual_seed(0)
        return build_llm(SMALL).double()

    tokens = token_batch(SMALL, 1, BATCH, SEQ, seed=1)
    targets = torch.randint(0, SMALL.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))

    def loss_of(out, y):
        return nn.functional.cross_entropy(out.flatten(0, -2), y.expand(out.shape[0], -1, -1).flatten())

    ref_model = fresh()
    opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.0)  # as build_optimizer
    ref_losses, ref_outs = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        out = ref_model(tokens)
        loss = loss_of(out, targets)
        loss.backward()
        opt.step()
        ref_losses.append(float(loss))
        ref_outs.append(float(out.std()))
    model = fresh()
    plan = se.plan(analysis=se.analyze(model), objective="memory", topology=topology, batch_size=BATCH, mode=mode)
    runtime = se.apply(model=model, plan=plan, device_type="cpu")
    start, length = runtime.dp_rank * plan.per_rank_batch, plan.per_rank_batch
    x, y = tokens[:, start:start + length].contiguous(), targets[start:start + length]
    opt = runtime.build_optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = loss_of(runtime.model(x), y)
        loss.backward()
        opt.step()
        loss = loss.detach().clone()
        if plan.dp_size > 1:  # each dp rank's loss is the mean over its half of the batch
            dist.all_reduce(loss, group=runtime.mesh.get_group("dp"))
        losses.append(float(loss) / plan.dp_size)
    local = {n: tuple(getattr(p, "to_local", lambda p=p: p)().shape) for n, p in runtime.model.named_parameters()}
    return dict(ref_losses=ref_losses, ref_outs=ref_outs, losses=losses, local=local, plan=plan.tensor_parallel_plan,
                params=runtime.full_parameters(), ref_params=dict(ref_model.named_parameters()))


def _both():
    return {mode: _train(mode, topology) for mode, topology in (("tp", {"tp": 4}), ("fsdp2_tp", {"dp": 2, "tp": 2}))}


@pytest.fixture(scope="module")
def four_ranks():
    return run_on_ranks(_both, 4, timeout=240)


@pytest.mark.parametrize("mode,tp,dp", [("tp", 4, 1), ("fsdp2_tp", 2, 2)])
def test_llama_training_under_tp_equals_the_unsharded_model(four_ranks, mode, tp, dp):
    for rank, results in enumerate(four_ranks):
        got = results[mode]
        ref = got["ref_losses"]
        assert min(got["ref_outs"]) > 0.1 and ref[0] > ref[-1] + 0.05, (got["ref_outs"], ref)  # outputs vary, it learns
        assert got["plan"]["blocks.1.mlp.w1"] == got["plan"]["blocks.1.mlp.w3"] == "colwise"
        # the Linears are really sharded: w1 holds ffn/tp rows (of them 1/dp under FSDP2), k its tp-th of 4 heads
        assert got["local"]["blocks.1.mlp.w1.weight"] == (SMALL.ffn_dim // tp // dp, SMALL.dim)
        assert got["local"]["blocks.1.attn.k.weight"][0] == 4 * SMALL.head_dim // tp // dp
        assert got["losses"] == pytest.approx(ref, abs=1e-9), rank
        for name, want in got["ref_params"].items():
            torch.testing.assert_close(got["params"][name], want.detach(), rtol=1e-9, atol=1e-9, msg=name)
