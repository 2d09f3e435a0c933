"""The engine contract: `generate`, and each optional attribute the audit reads, declared once.

Contract: `generate(prompts, max_new_tokens, eos_token_id) -> list[list[int]]`, per prompt only
the new tokens: the first EOS kept and nothing after it, never more than `max_new_tokens`.
`eos_token_id` is one id, a sequence of ids or None (`limits.eos_ids`): a row ends at the first token
that is any of them.
The built-in engines (reference, batched, EQSPEC, EXSPEC, INPLACE, fixedshape) also take `max_new_tokens` as
one budget per prompt (`request_limits`), so that rows of a batch end at different steps, as
requests of a server do; a row's budget is read by its prompt index (`row_limits`). They take request
parameters too (`requests.rows.TakesRequestParams`): set `request_params`, one per prompt, before
`generate`, and each row is decoded under its own (engines/requests/rows.py).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from specaudit.engines.limits import request_limits, row_limits  # noqa: F401 (re-exported)
from specaudit.engines.trace import Trace


@runtime_checkable
class Engine(Protocol):
    """What every engine must have: one call from prompts to each prompt's new tokens (module docstring)."""

    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int],
                 eos_token_id: int | Sequence[int] | None) -> list[list[int]]: ...


class Capabilities:
    """What an engine may have beyond `generate`, each declared here once with its default. The project's
    engines derive from this class; an engine written elsewhere need not, and is read through `capability`
    with the same defaults. The audit reads these and nothing else of an engine."""

    black_box: bool = False  # recordings and live servers: no models in process; ruled by a noise band
    record_logits: bool = False  # the audit sets it where an engine declares it: logits into `last_trace`
    last_trace: Trace | None = None  # the last `generate` call's steps (and logits)
    proposals_from_draft_model: bool = False  # its drafts are the draft model's own choices (checked as such)
    last_logprobs: list[Any] | None = None  # a black-box engine's reported log-probabilities, per prompt
    last_failures: Sequence[tuple[int, BaseException]] = ()  # requests that errored in the last call
    last_speculation: dict[str, Any] | None = None  # a server's speculation counters over the last call
    # per-position acceptance counters the engine keeps itself over the last call: the fields of
    # equivalence/acceptance/observed.ObservedAcceptance, as that record or its JSON
    last_acceptance: Any = None
    last_step_offsets: list[list[int]] | None = None  # per token its offset in the step that emitted it
    recorded_prompts: list[list[int]] | None = None  # a recording's own prompts (the audit decodes those)
    describe: Callable[[], dict[str, Any]] | None = None  # what the engine is (versions, settings)
    close: Callable[[], None] | None = None  # frees what it holds (a server's session)
    # request parameters: an engine that declares `request_params` takes them (one RequestParams per prompt,
    # or one for all), set by the audit before `generate`; `request_tokenizer` the target's, for stop strings
    request_params: Any = None
    request_tokenizer: Any = None
    penalty_scope: str | None = None  # what presence and frequency penalties count: "output" or "context"
    # structured outputs: the engine applies a `RequestParams.constraint` (engines/constraints/); one that does
    # not declare it is refused a constrained request (never sent it unconstrained)
    takes_constraints: bool = False
    # live servers (engines/adapters/server_base.py): what each answer said beside its tokens
    dialect: str | None = None  # the request dialect ("vllm", "sglang", "llamacpp", "trtllm"); None: not a server
    url: str | None = None  # a server's address
    path: str | None = None  # a recording's file, or a server's endpoint path
    last_completions: list[Any] | None = None  # per prompt the server's answer as read (`Completion`), or None
    last_details: list[dict[str, Any]] | None = None  # per prompt what the client did to it (EOS appended, cuts)
    last_refused: Sequence[tuple[int, BaseException]] = ()  # requests whose parameters the server refused
    # teacher forcing through a server: (prefix, token, eos, top) -> {token id: log-probability} at the prefix
    logprobs_at: Callable[..., dict[int, float] | None] | None = None
    drafter: Any = None  # an in-process speculative engine's proposer (engines/drafters.py)
    compactions: int | None = None  # INPLACE: how often it compacted its holes (the bench reports it)


DEFAULTS: dict[str, Any] = {name: value for name, value in vars(Capabilities).items()
                            if not name.startswith("_")}


def capability(engine: object, name: str) -> Any:
    """The engine's capability `name` (one of `Capabilities`), or its declared default."""
    return getattr(engine, name, DEFAULTS[name])


def declares(engine: object, name: str) -> bool:
    """Whether the engine itself has capability `name` (an attribute the audit may set, or counters of its
    own), not only the default `Capabilities` gives it."""
    if name not in DEFAULTS:
        raise KeyError(f"{name!r} is no engine capability: {', '.join(DEFAULTS)}")
    if name in getattr(engine, "__dict__", {}):
        return True
    for cls in type(engine).__mro__:
        if cls is Capabilities:
            return False
        if name in vars(cls):
            return True
    return hasattr(engine, name)  # a wrapper that hands attributes on (the guard): what it wraps has it
