"""Measurements under the bench: pass and prefill costs, the ideal engine built from them (the
ceilings), and peak memory of a call."""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from specaudit.engines import batch as batch_ops
from specaudit.engines.static.loop import STEP_KIND as FIXED_SHAPE_STEP
from specaudit.engines.ops import ragged
from specaudit.engines.models import zoo
from specaudit.engines.contract import capability


# ---- memory ------------------------------------------------------------------------------------

def _proc_status_kib(field_name: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class KeptMemory:
    """On the CPU with glibc: freed memory stays in the process during a timed call, and is handed back
    to the system before the next one.

    glibc returns large freed blocks to the kernel (mmap'd blocks at once, the heap's top past a
    threshold), so an engine that frees and allocates caches as it goes pays first-touch page faults again
    and again, and what a fault costs depends on the machine's state: on this project's 2-core virtual
    machine the same prefill of 8 prompts faulted in 3.2 us per page in one engine's run and 10.8 us in
    another's, 2 CPU s apart. A caching allocator (PyTorch's on CUDA) keeps freed blocks; this gives glibc
    that behaviour (mallopt: no mmap'd blocks, no trimming), and `hand_back` (malloc_trim) before each
    timed call starts every engine from the same state, its peak memory its own. Elsewhere it does nothing."""

    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters
    DEFAULTS = {M_MMAP_MAX: 65536, M_TRIM_THRESHOLD: 128 * 1024}

    def __init__(self, device: str) -> None:
        self._libc: Any = None
        if device == "cpu":
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                if libc.mallopt(self.M_MMAP_MAX, 0) == 1 and libc.mallopt(self.M_TRIM_THRESHOLD, 2**31 - 1) == 1:
                    self._libc = libc
            except (OSError, AttributeError):  # not glibc
                pass
        self.method = ("glibc: freed memory kept within a timed call (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=2^31-1), "
                       "handed back (malloc_trim) before each" if self._libc is not None else "the allocator's defaults")

    def hand_back(self) -> None:
        if self._libc is not None:
            self._libc.malloc_trim(0)

    def close(self) -> None:
        """glibc's defaults again, and the memory handed back."""
        if self._libc is not None:
            for parameter, value in self.DEFAULTS.items():
                self._libc.mallopt(parameter, value)
            self._libc.malloc_trim(0)
            self._libc = None


class PeakMemory:
    """Peak memory of one call above the memory in use when it started (see the module docstring); with
    `kept`, freed memory is handed back to the system first (`KeptMemory`)."""

    def __init__(self, device: str, kept: KeptMemory | None = None) -> None:
        self.kept = kept
        self.cuda = device.startswith("cuda")
        if self.cuda:
            self.method = "torch.cuda.max_memory_allocated above the allocation before the call"
        elif _proc_status_kib("VmHWM") is not None and self._reset_hwm():
            self.method = "CPU resident set: VmHWM (reset via /proc/self/clear_refs) above VmRSS before the call"
        else:
            self.method = "CPU resident set: getrusage ru_maxrss (process lifetime) above VmRSS before the call"
        self._base = 0

    @staticmethod
    def _reset_hwm() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            return True
        except OSError:
            return False

    def start(self) -> None:
        if self.kept is not None:
            self.kept.hand_back()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
            return
        if self.method.startswith("CPU resident set: VmHWM"):
            self._reset_hwm()
        self._base = (_proc_status_kib("VmRSS") or 0) * 1024

    def peak_bytes(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return int(torch.cuda.max_memory_allocated() - self._base)
        if self.method.startswith("CPU resident set: VmHWM"):
            high = (_proc_status_kib("VmHWM") or 0) * 1024
        else:
            high = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return max(0, int(high - self._base))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- pass costs and the ceiling ----------------------------------------------------------------

def median_seconds(call: Callable[[], Any], repeats: int, device: str, use_cpu_clock: bool = False,
                   after: Callable[[], None] | None = None) -> float:
    """Median seconds of `repeats` calls of `call` after one that warms up, the device synchronised around each;
    `after` runs after each call, untimed."""
    clock = time.process_time if use_cpu_clock else time.perf_counter
    seconds = []
    for _ in range(repeats + 1):
        sync(device)
        start = clock()
        call()
        sync(device)
        seconds.append(clock() - start)
        if after is not None:
            after()
    return statistics.median(seconds[1:])


@torch.no_grad()
def pass_costs(pair: zoo.ModelPair, batch_size: int, ks: list[int], context_length: int, repeats: int,
               device: str, use_cpu_clock: bool = False) -> dict[str, Any]:
    """Median seconds of one cached pass: target over 1 and k + 1 tokens, draft over 1, at `batch_size`."""
    tokens = (torch.arange(context_length) % 256).unsqueeze(0).repeat(batch_size, 1).to(device)  # [B, L]
    lengths = torch.full((batch_size,), context_length, dtype=torch.long, device=device)

    def timed(model, q: int) -> float:
        cache, _ = batch_ops.prefill(model, tokens, lengths)
        inputs = torch.zeros(batch_size, q, dtype=torch.long, device=device)
        # the prefilled layers have spare columns (`layout.SpareColumnsLayer`), as in the engines: each timed
        # pass writes its columns in place, and restoring the views after it drops them again
        saved = [(layer.keys, layer.values) for layer in ragged.cache_layers(cache)]

        def restore() -> None:
            for layer, (keys, values) in zip(ragged.cache_layers(cache), saved):
                layer.keys, layer.values = keys, values

        return median_seconds(lambda: batch_ops.forward(model, cache, inputs, lengths), repeats, device,
                              use_cpu_clock, after=restore)

    costs: dict[str, Any] = {"batch_size": batch_size, "context_length": context_length,
                             "target_1": timed(pair.target, 1), "draft_1": timed(pair.draft, 1), "target_k1": {}}
    for k in ks:
        costs["target_k1"][str(k)] = timed(pair.target, k + 1)
    return costs


@torch.no_grad()
def fixed_shape_pass_costs(pair: zoo.ModelPair, batch_size: int, ks: list[int], context_length: int, repeats: int,
                           device: str, cuda_graphs: bool = True, use_cpu_clock: bool = False) -> dict[str, Any]:
    """The same passes as `pass_costs`, run as the fixed-shape engine runs them: on a `StaticCache` of B rows in
    the length bucket of the context, each shape prepared once by `capture.PassRunner` (a CUDA graph on CUDA
    unless `cuda_graphs` is off, the eager twin elsewhere) and then replayed. Its ideal time is built from
    these: a captured pass skips the host's dispatch that an eager one pays."""
    from specaudit.engines.static.cache import StaticCache
    from specaudit.engines.static.capture import PassRunner, default_capture
    from specaudit.engines.static.engine import length_bucket

    columns = length_bucket(context_length + max(ks, default=0) + 2)
    capture = default_capture(torch.device(device), cuda_graphs)
    captured = cuda_graphs and device.startswith("cuda")
    pool = torch.cuda.graph_pool_handle() if captured else None
    write_at = torch.full((batch_size,), context_length, dtype=torch.long, device=device)  # [B]
    # every runner lives until the end, as an engine's do: a graph freed while its pool still holds blocks
    # leaves the pool unowned, and the next capture into it fails (CUDACachingAllocator asserts use_count > 0)
    runners: list[PassRunner] = []

    def timed(model, role: str, q: int) -> float:
        runner = PassRunner(StaticCache(model, batch_size, columns), role, capture, pool)
        runners.append(runner)
        inputs = torch.zeros(batch_size, q, dtype=torch.long, device=device)  # [B, q]
        runner.run(inputs, write_at)  # prepares the shape (captures it on CUDA): untimed
        return median_seconds(lambda: runner.run(inputs, write_at), repeats, device, use_cpu_clock)

    costs: dict[str, Any] = {"captured": captured, "columns": columns, "target_1": timed(pair.target, "target", 1),
                             "draft_1": timed(pair.draft, "draft", 1), "target_k1": {}}
    for k in ks:
        costs["target_k1"][str(k)] = timed(pair.target, "target", k + 1)
    runners.clear()  # the graphs go before their pool
    return costs


def ceiling(costs: dict[str, Any], k: int, tokens_per_step: float) -> float:
    """Best speedup over plain decoding: tokens per step x plain pass / (verify pass + k draft passes)."""
    return tokens_per_step * costs["target_1"] / (costs["target_k1"][str(k)] + k * costs["draft_1"])


@torch.no_grad()
def prefill_costs(pair: zoo.ModelPair, prompt_length: int, batch_size: int, repeats: int, device: str,
                  use_cpu_clock: bool = False) -> dict[str, Any]:
    """Median seconds to prefill one prompt of `prompt_length` tokens alone and `batch_size` of them in
    one pass (equal lengths: no padding), target and draft. `target_prefill` and `draft_prefill`, the
    per-prompt costs the ideal engine pays, are the cheaper of the two per prompt."""
    def timed(model, rows: int) -> float:
        tokens = (torch.arange(prompt_length) % 256).unsqueeze(0).repeat(rows, 1).to(device)  # [rows, P]
        lengths = torch.full((rows,), prompt_length, dtype=torch.long, device=device)
        return median_seconds(lambda: batch_ops.prefill(model, tokens, lengths), repeats, device, use_cpu_clock)

    out: dict[str, Any] = {"batch_size": batch_size, "prompt_length": prompt_length}
    for name, model in (("target", pair.target), ("draft", pair.draft)):
        alone = timed(model, 1)
        together = timed(model, batch_size) if batch_size > 1 else alone
        out[f"{name}_prefill_alone"], out[f"{name}_prefill_batch"] = alone, together
        out[f"{name}_prefill"] = min(alone, together / batch_size)
    return out


def expected_row_steps(new_tokens: int, k: int, acceptance: float) -> float:
    """Expected speculative steps one row needs to emit `new_tokens` tokens when each draft token is
    right with probability `acceptance`: a step emits j = accepted + 1 tokens, P(j) = A^(j-1) (1 - A)
    for j <= k and A^k for j = k + 1, cut at what the row still needs (so the last step may waste some).
    f(0) = 0, f(m) = 1 + sum_j P(j) f(max(0, m - j)); exact, not m / E."""
    p = [acceptance ** (j - 1) * (1.0 - acceptance) for j in range(1, k + 1)] + [acceptance ** k]
    f = [0.0] * (max(0, new_tokens) + 1)
    for m in range(1, len(f)):
        f[m] = 1.0 + sum(p[j - 1] * f[max(0, m - j)] for j in range(1, k + 2))
    return f[-1]


def ideal_seconds(costs: dict[str, Any], prefill: dict[str, Any], requests: int, row_steps: float,
                  k: int | None = None) -> float:
    """The least time any engine at this batch size can take (a lower bound): every request's prompt
    prefilled once at the per-prompt cost of `prefill` (B prompts of the mean length in one pass, no
    padding; the draft's too when speculating), then `row_steps` row-steps packed B to a pass (every
    row busy in every pass), each pass priced at `costs` (B rows): a plain pass, or a verify pass over
    k + 1 tokens and k draft passes. `row_steps`: the decoding tokens (plain: the first token of each
    request comes from its prefill), or the expected speculative steps (`expected_row_steps`)."""
    batch_size = costs["batch_size"]
    if k is None:
        return requests * prefill["target_prefill"] + row_steps / batch_size * costs["target_1"]
    step = costs["target_k1"][str(k)] + k * costs["draft_1"]
    return requests * (prefill["target_prefill"] + prefill["draft_prefill"]) + row_steps / batch_size * step


def speculation_ceiling(costs: dict[str, Any], prefill: dict[str, Any], request_tokens: list[int], k: int,
                        row_steps: float) -> float:
    """What speculation is worth on this workload against a perfect plain engine: ideal plain time /
    ideal speculative time, both with every prompt's prefill (`ideal_seconds`)."""
    decode_tokens = sum(max(0, n - 1) for n in request_tokens)
    return (ideal_seconds(costs, prefill, len(request_tokens), decode_tokens)
            / ideal_seconds(costs, prefill, len(request_tokens), row_steps, k))


def dispatch_per_step(engine: Any, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None) -> dict[str, Any]:
    """Aten ops dispatched and host synchronisations of one untimed call of `engine` on `prompts`, in all and
    per step (the trace's steps, prefill passes included; without a trace, per new token): kernel launches
    and host reads are a property of the code, so the CPU counts what a GPU pays (`engines/ops/dispatch.py`)."""
    from specaudit.engines.ops.dispatch import AtenOps, HostSyncs

    with torch.no_grad(), HostSyncs() as syncs, AtenOps() as ops:
        outputs = engine.generate([list(p) for p in prompts], max_new_tokens, eos_token_id)
    trace = capability(engine, "last_trace")
    steps = list(trace.steps) if trace is not None else []
    count = len(steps) or sum(len(o) for o in outputs) or 1
    return {"aten_ops": ops.count, "host_syncs": syncs.count, "steps": count,
            "aten_ops_per_step": ops.count / count, "host_syncs_per_step": syncs.count / count,
            "fixed_shape_loop": any(s.kind == FIXED_SHAPE_STEP for s in steps)}
