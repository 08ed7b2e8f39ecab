"""`kvbackend eval --seeds N`: seeded specs run once per k-means seed, the others once, and a summary over seeds."""

import pytest

from kvbackend import codecs
from kvbackend.tools.seeds import SeedSummary, expand, seeded, summarize


@pytest.mark.parametrize("spec, seed, want", [
    ("qvg", 3, "qvg:seed=3"),
    ("quantwm:kchannel=64,seed=5,sink=4", 2, "quantwm:kchannel=64,seed=2,sink=4"),  # replaced, levers kept
    ("auto:bpv=2.6,widths=2-3,base=quantwm:kchannel=64;sink=4", 1,
     "auto:bpv=2.6,widths=2-3,base=quantwm:kchannel=64;sink=4;seed=1"),
    ("kivi:bits=2,group=32", 1, None),  # draws no seed
    ("auto:bpv=2.6,base=kivi:group=64", 1, None),
    ("alignpred:error=1x", 1, None),
])
def test_seeded_sets_the_k_means_seed_where_there_is_one(spec, seed, want):
    got = seeded(spec, seed)
    assert got == want
    if got is not None and not got.startswith("auto:"):
        assert codecs.parse(got).seed == seed


def test_expand_runs_seeded_specs_per_seed_and_the_others_once():
    assert expand(["qvg", "kivi:bits=2"], 1) == [("qvg", "qvg"), ("kivi:bits=2", "kivi:bits=2")]
    assert expand(["qvg", "kivi:bits=2"], 3) == [("qvg", "qvg:seed=0"), ("qvg", "qvg:seed=1"), ("qvg", "qvg:seed=2"),
                                                ("kivi:bits=2", "kivi:bits=2")]
    with pytest.raises(ValueError, match="at least 1"):
        expand(["qvg"], 0)


class _Result:
    def __init__(self, kl, top1, bpv=2.5):
        self.kl, self.top1_agree, self.bpv = kl, top1, bpv


def test_summaries_are_the_mean_and_range_of_each_specs_runs():
    runs = expand(["qvg", "kivi:bits=2"], 2)
    got = summarize(runs, [_Result(0.02, 0.9), _Result(0.04, 0.8), _Result(0.1, 0.7, 4.0)])
    assert got[0] == SeedSummary("qvg", 2, 2.5, pytest.approx(0.03), 0.02, 0.04, pytest.approx(0.85), 0.8, 0.9)
    assert got[1] == SeedSummary("kivi:bits=2", 1, 4.0, 0.1, 0.1, 0.1, 0.7, 0.7, 0.7)
    with pytest.raises(ValueError, match="3 runs but 2 results"):
        summarize(runs, [_Result(0.02, 0.9)] * 2)
