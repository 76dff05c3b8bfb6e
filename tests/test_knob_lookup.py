"""One knob lookup (passes/plan.lookup_knobs) for the one plan both artifacts are built from."""
from __future__ import annotations

import json

import pytest

from convdsl import compiler, policy, stream
from convdsl.problem import problem_from_spec
from convdsl.targets import Target
from convdsl.passes import plan as planner
from convdsl.tuning import db
from convdsl.tuning.knobs import Knobs

SM90 = Target("cuda", "sm_90")


def _tuned_grad_weight():
    """A 16-bit grad_weight the shipped database holds for sm_90."""
    signatures = [s for key, section in db.load_db().items() if key.startswith(f"{SM90}|") for s in section
                  if '"op":"grad_weight"' in s]
    assert signatures, "the shipped database has tuned grad_weight entries for sm_90"
    return problem_from_spec(dict(json.loads(signatures[0]), name="k"))


def test_both_paths_take_the_same_knobs() -> None:
    p = _tuned_grad_weight()
    for q in (p, p.with_(out_dtype="f32"), p.with_(batch=p.batch + 1)):
        planned = compiler.plan(q, SM90)
        assert compiler.tuned_knobs(q, SM90) == (planned.knobs, planned.knobs_source) == planner.lookup_knobs(q, SM90)
        assert planned.stream is None or planned.stream.knobs_source == planned.knobs_source


def test_a_grad_weight_into_f32_takes_its_16_bit_entry_on_both_paths() -> None:
    p = _tuned_grad_weight()
    knobs, source = planner.lookup_knobs(p, SM90)
    assert "tuning database" in source
    widened = p.with_(out_dtype="f32")
    assert db.lookup(widened, SM90, "3.13.0") is None  # no entry of its own
    assert compiler.tuned_knobs(widened, SM90) == (knobs, source)


def test_without_an_entry_the_rules_decide() -> None:
    p = _tuned_grad_weight().with_(batch=12345)
    assert planner.lookup_knobs(p, SM90) == (policy.knobs_for(p, SM90, None), planner.BY_RULES)


@pytest.mark.parametrize("op", ["grad_weight", "forward"])
def test_the_cpu_takes_no_knobs(op: str) -> None:
    p = _tuned_grad_weight().with_(op=op, split_k=None)
    assert planner.lookup_knobs(p, Target("cpu", "host")) == (Knobs(), planner.ON_CPU)
