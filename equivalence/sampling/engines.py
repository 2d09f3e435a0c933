"""The engines the sampled audit can draw from, by name: the registry's sampled engines
(`sampled-spec`, `sampled-reference`, `hf-assisted`: transformers' assisted generation sampled,
engines/adapters/hf_assisted_sampled.py), the project's engines sampled through their request
parameters and `package.module:factory` (equivalence/sampling/run.py `make_engine`, resolved by
engines/registry.py as in the greedy audit), and live servers (`vllm:URL`, `llamacpp:URL`,
`sglang:URL`, `trtllm:URL`, engines/adapters/sampled_servers.py), whose tokens are tested against
the target of `--target` (the weights the server serves, in float64)."""

from __future__ import annotations

from typing import Any

from specaudit.engines.sampling.process import SamplingParams


def make_sampled_engine(spec: str, target: Any, draft: Any, params: SamplingParams, *, seed: int,
                        draft_tokens: int, options: dict[str, Any], batch_size: int = 8) -> Any:
    """The engine named `spec`, sampling with `params`. `batch_size`: a server's requests in flight, the
    project's engines' batch, and any other engine's where its factory takes `batch_size`."""
    from specaudit.engines.adapters.sampled_servers import SAMPLED_DIALECTS, make_sampled_server
    from specaudit.engines.registry import black_box_prefix
    from specaudit.equivalence.sampling.run import make_engine, takes_keyword

    if black_box_prefix(spec) in SAMPLED_DIALECTS:
        return make_sampled_server(spec, params, seed=seed, batch_size=batch_size, **options)
    if takes_keyword(spec, "batch_size"):
        options = {"batch_size": batch_size, **options}
    return make_engine(spec, target, draft, params, seed=seed, draft_tokens=draft_tokens, options=options)
