"""Each (batch size, query length) pass of a `StaticCache`, captured once as a CUDA graph and replayed.

`PassRunner.run(input_ids, write_at)` returns the pass's logits [B, q, V]. On CUDA (and `graphs=True`)
the first call with a query length warms the pass up twice on a side stream and records it into a
`torch.cuda.CUDAGraph` whose inputs are static tensors; later calls copy their inputs in and replay it.
The cache's buffers are part of the graph (the pass writes its keys and values in place), and warming up
writes the same columns with the same values as the call itself, so capturing changes nothing. The
returned logits are the graph's output tensor: read them before the next replay of that length. On the
CPU, or with `graphs=False`, it calls the same pass eagerly: the eager twin that CI runs. A pass that
cannot be captured (a host read or a data-dependent branch inside a model's forward) runs eagerly for that
query length, with a RuntimeWarning and the reason kept in `eager_lengths`: slower, never wrong.
"""

from __future__ import annotations

import warnings

import torch

from specaudit.engines.static.cache import StaticCache


class PassRunner:
    def __init__(self, cache: StaticCache, graphs: bool = True) -> None:
        self.cache = cache
        self.graphs = graphs and cache.device.type == "cuda"
        self._captured: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.eager_lengths: dict[int, str] = {}  # query length -> why its capture failed

    def run(self, input_ids: torch.Tensor, write_at: torch.Tensor) -> torch.Tensor:
        """Logits [B, q, V] of `input_ids` [B, q] written at `write_at` [B]."""
        q = input_ids.shape[1]
        if not self.graphs or q in self.eager_lengths:
            return self.cache.forward(input_ids, write_at)
        if q not in self._captured:
            try:
                self._captured[q] = self._capture(input_ids, write_at)
            except RuntimeError as exc:  # the pass writes the same columns again below, so nothing is lost
                self.eager_lengths[q] = f"{type(exc).__name__}: {exc}".splitlines()[0]
                warnings.warn(f"the {q}-token pass could not be captured as a CUDA graph and runs eagerly: "
                              f"{self.eager_lengths[q]}", RuntimeWarning, stacklevel=2)
                return self.cache.forward(input_ids, write_at)
        graph, static_ids, static_at, logits = self._captured[q]
        static_ids.copy_(input_ids)
        static_at.copy_(write_at)
        graph.replay()
        return logits

    def _capture(self, input_ids: torch.Tensor, write_at: torch.Tensor):
        static_ids, static_at = input_ids.clone(), write_at.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # kernels chosen and workspaces allocated before the capture
                self.cache.forward(static_ids, static_at)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self.cache.forward(static_ids, static_at)
        return graph, static_ids, static_at, logits

    @property
    def captured(self) -> list[int]:
        """The query lengths captured so far."""
        return sorted(self._captured)
