"""The zoo's decoder-only (spiking) language model: runs and learns signal at test size, builds every
named size on the meta device, and profiles shape-only as it profiles for real.
(The tests in one process: tests/unit/test_llm.py.)"""
import torch
from distributed_harness import run_on_ranks

import snn_explorer as se
from snn_explorer.zoo.llm import MultiStepLIF, build_llm, token_batch


def _tp_parity():
    """On each rank: the tiny spiking LLM unsharded and under TP=2 along whole heads, same weights and tokens."""
    def fresh():
        torch.manual_seed(0)
        return build_llm("spiking-llm-tiny", tied_embeddings=False).double()

    x = token_batch(fresh().config, 3, 4, 8, seed=1)
    ref_model = fresh()
    rates = []
    for module in ref_model.modules():
        if isinstance(module, MultiStepLIF):
            module.register_forward_hook(lambda m, a, out: rates.append(float(out.mean())))
    ref = ref_model(x)
    ref.square().mean().backward()
    model = fresh()
    plan = se.plan(analysis=se.analyze(model), objective="memory", topology={"tp": 2}, backend="torch",
                   batch_size=4, mode="tp", options=se.PlanOptions(tensor_parallel_plan=model.tensor_parallel_plan()))
    runtime = se.apply(model=model, plan=plan, device_type="cpu")
    runtime.reset_state()
    got = runtime.model(x)
    got.square().mean().backward()
    widths = {name: runtime.module.get_submodule(name).v.shape[-1]
              for name, style in plan.tensor_parallel_plan.items() if style == "local"}
    return dict(ref=ref.detach(), got=got.detach(), rates=rates, widths=widths)


def test_tp_along_whole_heads_equals_the_unsharded_model_on_two_ranks():
    for res in run_on_ranks(_tp_parity, 2, timeout=120):
        assert all(0 < r < 1 for r in res["rates"]) and res["ref"].std() > 0  # spikes fire, output not constant
        torch.testing.assert_close(res["got"], res["ref"])
        # each neuron keeps the state of its rank's half: of dim 32 in attention, of ffn_dim 64 in the MLP
        assert {n: w for n, w in res["widths"].items()} == {n: 32 if ".mlp." in n else 16 for n in res["widths"]}
        assert len(res["widths"]) == 2 * 5
