"""Engine names: the built-in ones, a black-box `PREFIX:LOCATION` (`recorded:FILE`,
`llamacpp:URL`, `vllm:URL`, `sglang:URL`, `trtllm:URL`), or `package.module:factory` for anything else.
`resolve` is the one place a name becomes a factory, for the greedy and the sampled audit alike
(`resolve(spec, sampled=True)` looks in `SAMPLED_ENGINES` first).

A factory is called as `factory(target, draft, batch_size=..., draft_tokens=..., **options)` with
the two loaded models and returns an object with
`generate(prompts, max_new_tokens, eos_token_id) -> list[list[int]]`.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

# How an engine takes sampled requests in the sampled audit (`--temperature`):
REQUESTS = "request parameters"  # one `RequestParams` per prompt (engines/requests/rows.py): the project's engines


@dataclass(frozen=True)
class EngineEntry:
    """One named engine and what it can do. `greedy`: its factory for the greedy audit,
    `factory(target, draft, batch_size=, draft_tokens=, **options)`, or None when it only samples.
    `sampled`: how the sampled audit draws from it: a factory called as `factory(target, draft,
    temperature=, top_k=, top_p=, seed=, draft_tokens=, **options)` (equivalence/sampling/run.py),
    `REQUESTS` (the greedy engine itself, given sampled request parameters), or None (greedy only)."""

    greedy: str | None
    sampled: str | None = None


# The one table of engine names. `hf-assisted` samples as transformers' assisted generation with
# do_sample=True, a factory of its own.
ENGINES: dict[str, EngineEntry] = {
    "reference": EngineEntry("specaudit.engines.reference:ReferenceDecoder", REQUESTS),
    "eqspec": EngineEntry("specaudit.engines.eqspec:EQSpec", REQUESTS),
    "exspec": EngineEntry("specaudit.engines.exspec:EXSpec", REQUESTS),
    "inplace": EngineEntry("specaudit.engines.inplace:InplaceEngine", REQUESTS),
    "batched": EngineEntry("specaudit.engines.batched:BatchedGreedy", REQUESTS),
    "fixedshape": EngineEntry("specaudit.engines.static.engine:FixedShapeEngine", REQUESTS),
    "hf-assisted": EngineEntry("specaudit.engines.adapters.hf_assisted:HFAssisted",
                               "specaudit.engines.adapters.hf_assisted_sampled:HFAssistedSampled"),
    "hf-prompt-lookup": EngineEntry("specaudit.engines.adapters.hf_assisted:HFPromptLookup"),
    "hf-batched": EngineEntry("specaudit.engines.adapters.hf_batched:HFBatched"),
    "hf-continuous": EngineEntry("specaudit.engines.adapters.hf_continuous:HFContinuous"),
    "bsp": EngineEntry("specaudit.engines.adapters.bsp:BSPEngine"),
    "dsd": EngineEntry("specaudit.engines.adapters.dsd:DSDEngine"),
    "sampled-spec": EngineEntry(None, "specaudit.engines.sampling.engine:SampledSpeculative"),
    "sampled-reference": EngineEntry(None, "specaudit.engines.sampling.engine:SampledReference"),
}

# Views of the table: the greedy audit's names, the sampled audit's own factories, and the engines
# sampled through their request parameters.
BUILTIN_ENGINES: dict[str, str] = {name: e.greedy for name, e in ENGINES.items() if e.greedy}
SAMPLED_ENGINES: dict[str, str] = {name: e.sampled for name, e in ENGINES.items() if e.sampled and e.sampled != REQUESTS}
REQUEST_ENGINES: tuple[str, ...] = tuple(name for name, e in ENGINES.items() if e.sampled == REQUESTS)


# Black-box engines, named `PREFIX:LOCATION`: they take no models, only where to find the outputs.
# Their factory is called as `factory(location, batch_size=..., **options)`. Dispatched before
# `module:factory`, since a URL holds colons of its own.
BLACK_BOX_ENGINES: dict[str, str] = {
    "recorded": "specaudit.engines.adapters.recorded:RecordedEngine",
    "llamacpp": "specaudit.engines.adapters.servers:LlamaCppEngine",
    "vllm": "specaudit.engines.adapters.servers:VLLMEngine",
    "sglang": "specaudit.engines.adapters.servers:SGLangEngine",
    "trtllm": "specaudit.engines.adapters.servers:TRTLLMEngine",
}


def black_box_prefix(spec: str) -> str | None:
    """`recorded`, `llamacpp`, ... when `spec` names a black-box engine (`PREFIX:LOCATION`), else None."""
    prefix, sep, location = spec.partition(":")
    return prefix if sep and location and prefix in BLACK_BOX_ENGINES else None


class EngineSpecError(ValueError):
    """An engine name that is neither built in nor an importable `module:factory`."""


def resolve(spec: str, *, sampled: bool = False) -> Callable[..., Any]:
    """The factory named by a built-in engine name or by `package.module:factory`; with `sampled`, the
    sampled audit's own names (`SAMPLED_ENGINES`) come before the greedy ones."""
    prefix = black_box_prefix(spec)
    names = {**BUILTIN_ENGINES, **SAMPLED_ENGINES} if sampled else BUILTIN_ENGINES
    path = BLACK_BOX_ENGINES[prefix] if prefix else names.get(spec, spec)
    if ":" not in path:
        raise EngineSpecError(
            f"unknown engine {spec!r}: use a built-in name ({', '.join(BUILTIN_ENGINES)}), "
            f"recorded:FILE, {'|'.join(p for p in BLACK_BOX_ENGINES if p != 'recorded')}:URL, or package.module:factory"
        )
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EngineSpecError(f"cannot import {module_name!r} for engine {spec!r} ({exc}): check the module name, "
                              "and that its package is installed or on PYTHONPATH (PYTHONPATH=. for a module in "
                              "the current folder)") from exc
    except Exception as exc:  # the module itself fails while being imported
        raise EngineSpecError(f"module {module_name!r} of engine {spec!r} fails while being imported "
                              f"({type(exc).__name__}: {exc}): fix the module") from exc
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise EngineSpecError(f"{module_name!r} has no attribute {attr!r} (engine {spec!r}): name a function "
                                  "or class defined in that module")
    if not callable(factory):
        raise EngineSpecError(f"engine {spec!r} names {type(factory).__name__}, not a callable factory: name a "
                              "function or class that returns the engine")
    return factory


def takes_option(spec: str, name: str) -> bool:
    """Whether the factory of `spec` accepts the option `name` (a parameter of that name or **kwargs);
    True when its signature cannot be read."""
    try:
        params = inspect.signature(resolve(spec)).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def takes_request_params(spec: str, *, sampled: bool = False) -> bool:
    """Whether the engine named `spec` takes request parameters (engines/requests/): its factory (a class)
    declares a `request_params` attribute, which the audit sets to one `RequestParams` per prompt before
    `generate`. With `sampled`: whether it also samples through them, as the project's engines do (a class of
    `engines/requests/rows.TakesRequestParams`: its rows decided by its `sampling_rule`, driven by
    `sampling.engine.RequestSampled`); a class that only declares `request_params` (hf-assisted) decodes
    greedily with them. False when the name does not resolve."""
    from specaudit.engines.contract import Capabilities

    try:
        factory = resolve(spec)
    except EngineSpecError:
        return False
    if sampled:
        from specaudit.engines.requests.rows import TakesRequestParams

        return isinstance(factory, type) and issubclass(factory, TakesRequestParams)
    if isinstance(factory, type):  # declared by the class or a base other than the contract's defaults
        return any("request_params" in vars(cls) for cls in factory.__mro__ if cls is not Capabilities)
    return hasattr(factory, "request_params")


def make_engine(spec: str, target: Any, draft: Any, *, batch_size: int, draft_tokens: int,
                sampling: Any = None, seed: int = 0, rule: Any = None, **options: Any) -> Any:
    """The one engine builder, for every audit. Greedy (`sampling` None): the factory of `spec` called as
    `factory(target, draft, batch_size=, draft_tokens=, **options)` (a black-box engine: `factory(location,
    batch_size=, **options)`). Options the factory does not accept (it has no **kwargs and no such parameter)
    are left out, so a minimal user factory need only take the four contract arguments.

    Sampled (`sampling` a `SamplingParams`, `seed` the run's): a live server asked for seeded samples
    (engines/adapters/sampled_servers.py); one of the project's engines (`REQUEST_ENGINES`) sampled through its
    request parameters (`sampling.engine.RequestSampled`; `rule` the `SpeculativeRule` it decides sampled rows
    by, for planting a fault), and so is a `package.module:Class` whose class takes request parameters
    (`engines/requests/rows.TakesRequestParams`, e.g. a planted structured-output fault); a sampled factory (`SAMPLED_ENGINES`, `package.module:factory`) called as
    `factory(target, draft, temperature=, top_k=, top_p=, seed=, draft_tokens=, [batch_size=,] **options)`."""
    if sampling is not None:
        return _make_sampled(spec, target, draft, sampling, seed=seed, batch_size=batch_size,
                             draft_tokens=draft_tokens, rule=rule, options=options)
    factory = resolve(spec)
    options = _accepted(factory, options)
    if black_box_prefix(spec):
        engine = factory(spec.partition(":")[2], batch_size=batch_size, **options)
    else:
        engine = factory(target, draft, batch_size=batch_size, draft_tokens=draft_tokens, **options)
    if not callable(getattr(engine, "generate", None)):
        raise EngineSpecError(f"engine {spec!r}: the factory returned {type(engine).__name__}, which has no generate()")
    return engine


def _accepted(factory: Callable[..., Any], options: dict[str, Any]) -> dict[str, Any]:
    """The options `factory` takes (a parameter of that name, or **kwargs); all of them when its signature
    cannot be read (builtins)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return options
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return {k: v for k, v in options.items() if takes_any or k in params}


def _make_sampled(spec: str, target: Any, draft: Any, params: Any, *, seed: int, batch_size: int, draft_tokens: int,
                  rule: Any, options: dict[str, Any]) -> Any:
    from specaudit.engines.adapters.sampled_servers import SAMPLED_DIALECTS, make_sampled_server

    if black_box_prefix(spec) in SAMPLED_DIALECTS:
        return make_sampled_server(spec, params, seed=seed, batch_size=batch_size, **options)
    if spec in REQUEST_ENGINES:
        from specaudit.engines.sampling.engine import RequestSampled

        options = dict(options)
        batch_size = int(options.pop("batch_size", batch_size))  # an --engine-option's batch wins
        engine = make_engine(spec, target, draft, batch_size=batch_size, draft_tokens=draft_tokens, **options)
        engine.sampling_rule = rule
        return RequestSampled(engine, params, seed)
    if not black_box_prefix(spec) and ":" in spec and takes_request_params(spec, sampled=True):
        # a user engine built like the project's (engines/requests/rows.py): sampled through its request parameters
        from specaudit.engines.sampling.engine import RequestSampled

        options = dict(options)
        batch_size = int(options.pop("batch_size", batch_size))
        engine = make_engine(spec, target, draft, batch_size=batch_size, draft_tokens=draft_tokens, **options)
        engine.sampling_rule = rule
        return RequestSampled(engine, params, seed)
    if spec not in SAMPLED_ENGINES and ":" not in spec:
        what = ("decodes greedily only, it takes no sampled requests" if spec in BUILTIN_ENGINES
                else "is no sampled engine")
        raise EngineSpecError(f"{spec!r} {what}: give {', '.join([*SAMPLED_ENGINES, *REQUEST_ENGINES])}, "
                              "recorded:FILE or package.module:factory")
    factory = resolve(spec, sampled=True)
    if "batch_size" in _accepted(factory, {"batch_size": batch_size}):  # its batch, where it takes one
        options = {"batch_size": batch_size, **options}
    if rule is not None:
        options = {**options, "rule": rule}
    return factory(target, draft, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                   seed=seed, draft_tokens=draft_tokens, **options)
