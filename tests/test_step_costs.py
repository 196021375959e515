"""How wide speculative decoding lets a step grow (runtime/speculative.py,
plan_drafts) from what the methods' calls cost (runtime/offgraph.py,
MethodCosts)."""

from __future__ import annotations

import pytest
import torch

from kvexport.runtime.offgraph import OTHERS_PER_TOKEN, MethodCosts
from kvexport.runtime.speculative import Drafting, NgramIndex, plan_drafts


class Costed:
    """A manager as plan_drafts sees one: its static sizes and their measured times."""

    def __init__(self, sizes, **seconds):
        self.static_sizes = sizes
        self.costs = MethodCosts()
        for method, value in seconds.items():
            self.costs._seconds[method] = value
            self.costs._last[method] = 0


def drafters(*kept_and_refused, width=8, text=tuple(range(20)) * 2):
    """Sequences with these drafting records (kept, refused) and a text that
    lookup finds 20 tokens to propose in."""
    out = []
    for kept, refused in kept_and_refused:
        state = Drafting(NgramIndex(text, 3), torch.Generator(), width=width)
        state.kept, state.refused = kept, refused
        out.append(state)
    return out


def test_drafts_widen_a_step_only_where_it_decodes_more_tokens_a_second():
    """plan_drafts: a step bound by reading the weights (forward_8 about as
    dear as forward_1) takes drafts; one whose rows cost what they read (a
    full batch) decodes plainly; a draft package's steps count against its
    drafts; a poor drafter gets none that cost anything."""
    weight_bound = Costed([1, 8, 16], forward_1=0.020, forward_8=0.024, forward_16=0.030)
    sure = drafters((30, 1))
    assert plan_drafts(sure, [9], 8, 0, weight_bound, None, 16) == [7], "forward_8 holds 7 drafts; the 8th is not worth forward_16"
    assert plan_drafts(sure, [9], 8, 0, Costed([1, 8, 16], forward_1=0.02, forward_8=0.024, forward_16=0.024), None, 16) == [8]
    busy = Costed([1, 8, 16], forward_1=0.020, forward_8=0.080, forward_16=0.160)
    assert plan_drafts(drafters(*[(30, 1)] * 8), [9] * 8, 8, 0, busy, None, 16) == [0] * 8, "wider costs what it brings"
    assert sum(plan_drafts(drafters(*[(30, 1)] * 5), [9] * 5, 8, 0, busy, None, 16)) == 3, \
        "lookup's drafts fill forward_8's padding for free"
    draft = Costed([1, 8], forward_1=0.020, forward_8=0.024)
    assert plan_drafts(sure, [9], 8, 0, weight_bound, draft, 16) == [0], "a draft as dear as the target never pays"
    assert plan_drafts(sure, [9], 8, 0, weight_bound, Costed([1, 8], forward_1=0.015), 16) == [3], \
        "each round of a draft costs a step of its own: a few pay, 7 would not"
    cheap = Costed([1, 8], forward_1=0.002, forward_8=0.003)
    assert plan_drafts(sure, [9], 8, 0, weight_bound, cheap, 16) == [7]
    assert plan_drafts(drafters((0, 30)), [9], 8, 0, weight_bound, cheap, 16) == [0], "a drafter that is always refused"
    assert plan_drafts(sure, [9], 8, 0, weight_bound, None, 1) == [0], "no wider step than `width`"


def test_a_draft_behind_on_a_long_text_catches_up_only_where_the_steps_left_repay_it():
    weight_bound = Costed([1, 8, 16], forward_1=0.020, forward_8=0.024, forward_16=0.030)
    draft = Costed([1, 8], forward_1=0.002, forward_8=0.003, **{OTHERS_PER_TOKEN: 0.001})
    behind = drafters((30, 1), text=tuple(range(20)) * 20)  # 400 tokens, none in the draft's cells
    assert plan_drafts(behind, [9], 8, 0, weight_bound, draft, 16) == [0], "0.4 s of prefill for 9 tokens"
    assert sum(plan_drafts(behind, [2000], 8, 0, weight_bound, draft, 16)) > 0
    behind[0].draft_fed = 399  # all but the pending token
    assert sum(plan_drafts(behind, [9], 8, 0, weight_bound, draft, 16)) > 0
    behind[0].draft_fed = 0
    unmeasured_draft = Costed([1, 8])
    assert sum(plan_drafts(behind, [9], 8, 0, weight_bound, unmeasured_draft, 16)) > 0, "before any figure, free"
    prefilled = Costed([1, 8, 16], forward_1=0.020, forward_8=0.024, forward_16=0.030, **{OTHERS_PER_TOKEN: 0.001})
    assert plan_drafts(behind, [9], 8, 0, prefilled, unmeasured_draft, 16) == [0], "the target's prefill rate stands in"


def test_a_draft_package_waits_for_a_measured_step_and_lookup_does_not():
    unmeasured, cheap = Costed([1, 8, 16]), Costed([1, 8], forward_1=0.002, forward_8=0.003)
    assert plan_drafts(drafters((30, 1)), [9], 8, 0, unmeasured, cheap, 16) == [0]
    assert sum(plan_drafts(drafters((30, 1)), [9], 8, 0, unmeasured, None, 16)) > 0


def test_lookup_plans_only_the_drafts_it_can_propose():
    weight_bound = Costed([1, 2, 4, 8], forward_1=0.020, forward_2=0.021, forward_4=0.022, forward_8=0.024)
    text = [1, 2, 3, 9, 1, 2]  # "1 2" was followed by 3 9 1 2
    assert plan_drafts(drafters((30, 1), text=text), [9], 8, 0, weight_bound, None, 8) == [4]
    assert plan_drafts(drafters((30, 1), text=[1, 2, 3]), [9], 8, 0, weight_bound, None, 8) == [0], "nothing recurs"


def test_method_costs_skip_a_warm_up_and_forget_stale_figures():
    costs = MethodCosts()
    costs.observe("forward_8", 5.0)
    assert costs.of("forward_8") is None, "the first call warms up: not counted"
    costs.observe("forward_8", 0.04)
    costs.observe("forward_8", 0.08)
    assert costs.of("forward_8") == pytest.approx(0.04 + MethodCosts.WEIGHT * 0.04)
    for _ in range(MethodCosts.STALE + 1):
        costs.observe("forward_1", 0.02)
    assert costs.of("forward_8") is None, "no call renewed it lately: tried again"
    costs.observe("forward_8", 0.03)
    assert costs.of("forward_8") == 0.03, "a stale figure does not weigh on the new one"
    assert costs.of("forward_1") == pytest.approx(0.02)
