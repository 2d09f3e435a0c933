"""Each pass shape of a `StaticCache`, prepared once for the engine's lifetime and replayed.

A shape is (role, batch, query length, length bucket): the cache fixes the batch and the bucket (its
columns), so a `PassRunner` prepares one pass per query length. Preparing copies the first call's inputs
into static input tensors and hands them to a `Capture`:

- `cuda_graph` (CUDA, `cuda_graphs=True`): warms the pass up twice on a side stream, then records it into
  a `torch.cuda.CUDAGraph` in the engine's one memory pool; a replay runs the recorded kernels;
- `eager` (the CPU, or `cuda_graphs=False`): the same pass called on the same static tensors, the eager
  twin that CI runs.

Later calls copy their inputs into the static tensors and replay. The cache's buffers are part of the pass
(it writes its keys and values in place), and warming up writes the same columns with the same values as
the call itself, so preparing changes nothing. The returned logits are the pass's output tensor: read them
before the next replay of that length. `captures` counts preparations per shape: one per shape for the
engine's lifetime (tests/test_static.py counts them). A capture that fails raises `CaptureError` naming the
shape and stops the engine: recovering from a failed CUDA graph capture is not reliable in PyTorch
(pytorch #51436), so no pass falls back to running eagerly.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch

from specaudit.engines.static.cache import StaticCache

Replay = Callable[[], torch.Tensor]  # runs the prepared pass on its static inputs; logits [B, q, V]
Capture = Callable[[StaticCache, torch.Tensor, torch.Tensor, Any], Replay]  # (cache, ids, write_at, pool)


class CaptureError(RuntimeError):
    """A pass shape that could not be captured: the engine stops (no silent eager fallback)."""


def eager(cache: StaticCache, static_ids: torch.Tensor, static_at: torch.Tensor, pool: Any = None) -> Replay:
    """The pass called eagerly on its static inputs (the CPU's twin of a CUDA graph)."""
    return lambda: cache.forward(static_ids, static_at)


def cuda_graph(cache: StaticCache, static_ids: torch.Tensor, static_at: torch.Tensor, pool: Any = None) -> Replay:
    """The pass recorded as a CUDA graph in the memory pool `pool` (shared by all of an engine's graphs:
    each graph's output stays alive, and graphs never run concurrently)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # kernels chosen and workspaces allocated before the capture
            cache.forward(static_ids, static_at)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        logits = cache.forward(static_ids, static_at)

    def replay() -> torch.Tensor:
        graph.replay()
        return logits

    return replay


def default_capture(device: torch.device, cuda_graphs: bool) -> Capture:
    """CUDA graphs on CUDA (unless turned off), else the eager twin."""
    return cuda_graph if cuda_graphs and device.type == "cuda" else eager


class PassRunner:
    """The prepared passes of one `StaticCache` (`role`: "target" or "draft")."""

    def __init__(self, cache: StaticCache, role: str, capture: Capture, pool: Any = None) -> None:
        self.cache, self.role, self.capture, self.pool = cache, role, capture, pool
        self._passes: dict[int, tuple[torch.Tensor, torch.Tensor, Replay]] = {}
        self.captures: Counter[tuple[str, int, int, int]] = Counter()  # (role, B, q, L) -> preparations

    def shape(self, q: int) -> tuple[str, int, int, int]:
        return self.role, self.cache.rows, q, self.cache.columns

    def run(self, input_ids: torch.Tensor, write_at: torch.Tensor) -> torch.Tensor:
        """Logits [B, q, V] of `input_ids` [B, q] written at `write_at` [B]."""
        q = input_ids.shape[1]
        if q not in self._passes:
            static_ids, static_at = input_ids.clone(), write_at.clone()
            try:
                replay = self.capture(self.cache, static_ids, static_at, self.pool)
            except Exception as exc:
                role, rows, _, columns = self.shape(q)
                raise CaptureError(f"the {role} pass of shape (batch {rows}, query length {q}, length bucket "
                                   f"{columns}) could not be captured: {type(exc).__name__}: {exc}; the fixed-shape "
                                   "engine stops (run it with cuda_graphs=false, or use another engine)") from exc
            self._passes[q] = static_ids, static_at, replay
            self.captures[self.shape(q)] += 1
        static_ids, static_at, replay = self._passes[q]
        static_ids.copy_(input_ids)
        static_at.copy_(write_at)
        return replay()

    @property
    def captured(self) -> list[int]:
        """The query lengths prepared so far."""
        return sorted(self._passes)
