"""core/model/walk.py: an analysis computes each module's answers once, and keeps nothing after it."""
from torch import nn

from snn_explorer import analyze
from snn_explorer.core.model import memo, modules_by_name, one_walk, structure


def _counting(calls):
    def compute():
        calls.append(1)
        return len(calls)
    return compute


def test_memo_keeps_answers_only_inside_a_walk():
    calls = []
    assert memo(("q", 1), _counting(calls)) == 1 and memo(("q", 1), _counting(calls)) == 2  # no walk: recomputed
    with one_walk():
        first = memo(("q", 1), _counting(calls))
        with one_walk():  # a nested walk shares the outer one's answers
            assert memo(("q", 1), _counting(calls)) == first
        assert memo(("q", 2), _counting(calls)) == first + 1  # another key is its own answer
    assert memo(("q", 1), _counting(calls)) == first + 2  # the walk's answers are gone
    assert len(calls) == 5


class _Chained(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.a(x))


def test_analyze_traces_each_forward_once_and_answers_as_before(monkeypatch):
    model = nn.Sequential(_Chained(), nn.ReLU(), _Chained())
    traced = []
    real = structure._traced_chain
    monkeypatch.setattr(structure, "_traced_chain", lambda m: traced.append(id(m)) or real(m))
    result = analyze(model)
    assert result.tensor_parallel_candidate_names == ("0.a", "0.b", "2.a", "2.b")
    assert len(traced) == len(set(traced)) > 0  # each custom forward traced once although several finders ask
    assert modules_by_name(model) is not modules_by_name(model)  # outside the analysis nothing is kept
