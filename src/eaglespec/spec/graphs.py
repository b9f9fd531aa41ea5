"""CUDA graphs for the step: capture once per (row bucket, sampling kind), replay every step.

A GPU runs a small model's step far faster than Python can launch its ~1,000 kernels, so the
step is recorded once and replayed. What makes that possible is the step itself: fixed shapes for
a given (rows, tree budget, capacity) and no host reads inside. Replays read and write the same
tensors, so the lane's state and sampling tensors must keep their identity (they are updated in
place), and a cache that grows drops every graph.

Warm-up: the first eager steps of a bucket are real steps (they advance the rows like any other),
and capture itself runs nothing, so no state is disturbed.
"""

from __future__ import annotations

import torch

from .sampling import RowSampling
from .step import RowState, SpecStep, StepTimes
from .tree import BatchAcceptance

WARMUP_STEPS = 2


class GraphedSteps:
    def __init__(self, step_fn: SpecStep) -> None:
        self.step_fn = step_fn
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, BatchAcceptance]] = {}
        self._warm: dict[tuple, int] = {}
        self._sampling: dict[int, RowSampling] = {}  # per span: tensors the graphs read

    def reset(self) -> None:
        self._graphs.clear()
        self._warm.clear()

    def sampling(self, fresh: RowSampling) -> RowSampling:
        """Copy `fresh` into this span's persistent tensors (same objects every step)."""
        span = fresh.temperature.shape[0]
        keep = self._sampling.get(span)
        if keep is None:
            self._sampling[span] = fresh
            return fresh
        for name in ("temperature", "top_k", "top_p", "seed"):
            getattr(keep, name).copy_(getattr(fresh, name))
        for name in ("all_greedy", "any_greedy", "any_top_k", "any_top_p"):
            setattr(keep, name, getattr(fresh, name))
        return keep

    def step(self, state: RowState, span: int, sampling: RowSampling, times: StepTimes) -> BatchAcceptance:
        longest = state.target_cache.capacity - self.step_fn.budget
        key = (span, sampling.all_greedy, sampling.any_greedy, sampling.any_top_k, sampling.any_top_p)
        rows = state.rows(span)
        if key in self._graphs:
            graph, out = self._graphs[key]
            graph.replay()
            return out
        if self._warm.get(key, 0) < WARMUP_STEPS:
            self._warm[key] = self._warm.get(key, 0) + 1
            return self.step_fn(rows, sampling, longest, times, exact=False)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = self.step_fn(rows, sampling, longest, exact=False)
        self._graphs[key] = (graph, out)
        graph.replay()
        return out
