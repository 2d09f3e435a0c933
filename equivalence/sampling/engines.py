"""The engines the sampled audit can draw from, by name: the built-in sampled engines and
`package.module:factory` (equivalence/sampling/run.py `make_engine`), transformers' assisted
generation sampled (`hf-assisted`, engines/adapters/hf_assisted_sampled.py), and live servers
(`vllm:URL`, `llamacpp:URL`, `sglang:URL`, `trtllm:URL`, engines/adapters/sampled_servers.py), whose
tokens are tested against the target of `--target` (the weights the server serves, in float64)."""

from __future__ import annotations

from typing import Any

from specaudit.engines.sampling.process import SamplingParams

IN_PROCESS = {"hf-assisted": "specaudit.engines.adapters.hf_assisted_sampled:HFAssistedSampled"}


def make_sampled_engine(spec: str, target: Any, draft: Any, params: SamplingParams, *, seed: int,
                        draft_tokens: int, options: dict[str, Any], batch_size: int = 8) -> Any:
    """The engine named `spec`, sampling with `params`; `batch_size`: a server's requests in flight."""
    from specaudit.engines.adapters.sampled_servers import SAMPLED_DIALECTS, make_sampled_server
    from specaudit.engines.registry import black_box_prefix
    from specaudit.equivalence.sampling.run import REQUEST_ENGINES, make_engine

    if black_box_prefix(spec) in SAMPLED_DIALECTS:
        return make_sampled_server(spec, params, seed=seed, batch_size=batch_size, **options)
    if spec in IN_PROCESS:
        import importlib

        module, _, name = IN_PROCESS[spec].partition(":")
        factory = getattr(importlib.import_module(module), name)
        return factory(target, draft, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                       seed=seed, draft_tokens=draft_tokens, **options)
    if spec in REQUEST_ENGINES:  # the project's engines batch as many requests as a server keeps in flight
        options = {"batch_size": batch_size, **options}
    return make_engine(spec, target, draft, params, seed=seed, draft_tokens=draft_tokens, options=options)
