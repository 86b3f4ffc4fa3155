"""A step's phases (replicas/engine/phases.py) are labelled in torch.profiler's trace, each once per step and
nested as the step runs them; without a profiler the step records nothing."""

from torch.autograd import profiler
from torch.profiler import ProfilerActivity, profile

from replicas.engine.phases import PHASES
from tests.engine.conftest import greedy, prompts


def test_each_phase_is_labelled_once_per_step(make_engine):
    engine = make_engine()
    engine.add_request(greedy("a", prompts([12])[0], max_tokens=8))
    engine.step()  # the prefill
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            assert engine.step()
    counts = {name: 0 for name in PHASES}
    for event in prof.events():
        if event.name.startswith("step."):
            counts[event.name.removeprefix("step.")] += 1
    assert counts == {name: 3 for name in PHASES}
    forward = [e for e in prof.events() if e.name == "step.forward"]
    assert all(e.cpu_children for e in forward)  # the model's ops run inside the forward phase
    assert not profiler._is_profiler_enabled
