"""The phases of an engine step, as labelled ranges in torch.profiler's trace.

    schedule   Scheduler.schedule: admission, chunking, blocks          (Engine.step)
    build      BatchBuilder: the step's ForwardBatch                     (ModelRunner.prepare)
    forward    the model, logits included                                (ModelRunner.run)
    sample     the sampler over the SamplingRows                         (ModelRunner.run)
    output     postprocess, detokenize, the deltas                       (Engine.step)

bench/engine/profile_step.py prints each phase's time per step. With no profiler running a phase costs one
flag check, so the labels stay in the serving path.
"""

from contextlib import nullcontext

import torch
from torch.autograd import profiler

PHASES = ("schedule", "build", "forward", "sample", "output")


def phase(name: str):
    """A `step.<name>` range while torch.profiler records, else nothing."""
    return torch.profiler.record_function(f"step.{name}") if profiler._is_profiler_enabled else nullcontext()
