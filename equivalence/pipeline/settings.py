"""The audit's settings: one frozen record, built once (from the command line, the Python API or the pytest
plugin) and read by every stage of the one pipeline (equivalence/pipeline/runner.py).

A run is a composition of three choices, each read off the settings:

| choice | values | decided by |
|---|---|---|
| how outputs are obtained (`source_of`) | an in-process engine, a live server, a recording | the engine spec: `recorded:FILE`, `vllm:URL` (and the other server prefixes), anything else |
| the oracle (`oracle`) | the in-process reference with the weights, or a served reference | `reference`: None, or `vllm:URL` etc. |
| how outputs are judged (`mode`) | greedy tokens, or sampled statistics | `sampling`: None, or the temperature, cuts, samples and seed |

Only `runner.compose` reads `oracle` and `mode` to choose; it builds the judge (equivalence/pipeline/judges.py)
and the oracles from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from specaudit.equivalence.rulings.thresholds import ALPHA

TEACHER_FORCING_TOP = 20  # a served reference's top log-probabilities per position (vLLM's default max_logprobs)
Source = Literal["in-process", "server", "recording"]
Oracle = Literal["weights", "served"]
Mode = Literal["greedy", "sampled"]


@dataclass(frozen=True)
class UserPair:
    target: str
    draft: str | None  # None: a target alone, enough for black-box engines (recordings, live servers)
    trust_remote_code: bool = False
    allow_pickle_weights: bool = False

    @property
    def name(self) -> str:
        return "+".join(Path(p).name for p in (self.target, self.draft) if p is not None)


@dataclass(frozen=True)
class SamplingSettings:
    """The sampled audit's settings (`--temperature` and the options beside it)."""

    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    samples: int = 400
    seed: int = 0
    alpha: float = ALPHA  # the family-wise false-positive rate of the tests together (Holm)


@dataclass(frozen=True)
class SearchSettings:
    """The workload drawn instead of fixed (`--search`, equivalence/search/): a Hypothesis state machine of
    request mixes. The budget is examples or minutes (exactly one of them), `seed` derandomizes the draws."""

    examples: int | None = 50  # examples judged (None: `minutes` decides)
    minutes: float | None = None
    seed: int = 0
    max_requests: int = 6  # requests per example (Hypothesis's steps of the state machine)
    diagnosis: str = "off"  # during the search ("off" or "quick"); the shrunk case gets "full"
    # the parameter families drawn (equivalence/search/strategies.py FAMILIES); None: every one
    families: tuple[str, ...] | None = None
    max_findings: int = 4  # distinct failures shrunk and kept (equivalence/search/run.py `signatures`)
    # the reasoning end marker the engine applies to every constraint (`--reasoning-end`; a server's reasoning
    # parser); "": a server applies none, an in-process engine gets one drawn per constraint, on or off
    reasoning_end: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"examples": self.examples, "minutes": self.minutes, "seed": self.seed,
                "max_requests": self.max_requests, "diagnosis": self.diagnosis,
                "families": None if self.families is None else list(self.families),
                "max_findings": self.max_findings, "reasoning_end": self.reasoning_end or None}


@dataclass(frozen=True)
class AuditSettings:
    engines: list[str]
    pairs: list[str | UserPair] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=lambda: [8])
    dtypes: list[str] = field(default_factory=lambda: ["float64"])
    device: str = "cpu"
    prompts: str = "builtin"
    num_prompts: int | None = None
    max_new_tokens: int = 32
    draft_tokens: int = 4
    # "pair": the pair's own EOS ids; an id or a list of ids (any of them ends a row); None: never stop early
    eos_token_id: int | list[int] | None | str = "pair"
    engine_options: dict[str, Any] = field(default_factory=dict)
    timeout: float | None = 3600.0  # seconds per run (engines) and per ask (a served reference)
    # black-box engines (recordings, servers): a declared noise band (equivalence/rulings/band.py)
    engine_dtype: str | None = None
    logit_tolerance: float | None = None
    bundles: bool = True  # write OUT/bundles/*.json, one repro bundle per divergence
    adversarial: bool = True  # add the adversarial prompts (equivalence/adversarial.py) to every prompt set
    pad_token_id: int | None = None  # the pad id the pair declares to the engines (None: the pair's own)
    require_speculation: bool = False  # a run whose engine drafted nothing (or exposes no counters) fails
    plain_engine: str | None = None  # the same engine without speculation: three-way rulings (rulings/plain.py)
    # acceptance per draft position (equivalence/acceptance/): the stated proposer (`draft:k=4`,
    # `ngram:k=4,min=2,max=5`), an earlier audit.json as the expectation, the gate's ratio R (0 < R <= 1)
    speculation: str | None = None
    acceptance_baseline: str | None = None
    require_acceptance: float | None = None
    payoff: int = 0  # --payoff N: tokens per second against the plain engine, N repeats (0: not measured)
    diagnosis: str = "full"  # "quick": checks and replays only; "full": re-runs of the engine too
    diagnosis_budget: float | None = None  # seconds per run for the diagnosis's re-runs (None: --timeout's)
    request_params: Any = None  # one RequestParams for every prompt (engines that declare `request_params`)
    # the oracle: None, the in-process reference; else a served reference (served_audit.py) and its options
    reference: str | None = None
    tokenizer: str | None = None  # the served model's tokenizer and config folder (no weights)
    reference_batch_invariant: bool = False
    reference_top_logprobs: int = 5
    # the judge: None, greedy tokens; else sampled statistics
    sampling: SamplingSettings | None = None
    search: SearchSettings | None = None  # the workload: None, the fixed prompt set; else drawn (--search)

    @property
    def oracle(self) -> Oracle:
        return "weights" if self.reference is None else "served"

    @property
    def mode(self) -> Mode:
        """How outputs are judged: greedy tokens, or sampled statistics (`--temperature`)."""
        return "greedy" if self.sampling is None else "sampled"

    def to_dict(self) -> dict[str, Any]:
        """The settings as `audit.json`'s `config` keeps them (every field name kept from earlier versions)."""
        data: dict[str, Any] = {
            "engines": list(self.engines),
            "pairs": [p if isinstance(p, str) else {"target": p.target, "draft": p.draft} for p in self.pairs],
            "batch_sizes": list(self.batch_sizes), "dtypes": list(self.dtypes), "device": self.device,
            "prompts": self.prompts, "num_prompts": self.num_prompts, "max_new_tokens": self.max_new_tokens,
            "draft_tokens": self.draft_tokens, "eos_token_id": self.eos_token_id,
            "engine_options": self.engine_options, "timeout": self.timeout,
            "engine_dtype": self.engine_dtype, "logit_tolerance": self.logit_tolerance,
            "adversarial": self.adversarial, "pad_token_id": self.pad_token_id,
            "require_speculation": self.require_speculation, "plain_engine": self.plain_engine,
            "speculation": self.speculation, "acceptance_baseline": self.acceptance_baseline,
            "require_acceptance": self.require_acceptance, "payoff": self.payoff,
            "diagnosis": self.diagnosis, "diagnosis_budget": self.diagnosis_budget,
            "request_params": self.request_params.to_dict() if self.request_params is not None else None,
            "oracle": self.oracle, "judge": self.mode,  # "judge": the key earlier versions wrote
        }
        if self.search is not None:
            data["search"] = self.search.to_dict()
        if self.reference is not None:
            data.update(reference=self.reference, tokenizer=self.tokenizer,
                        reference_batch_invariant=self.reference_batch_invariant,
                        reference_top_logprobs=self.reference_top_logprobs)
        if self.sampling is not None:
            sampling = self.sampling
            data.update(mode="sampled", seed=sampling.seed, samples=sampling.samples, alpha=sampling.alpha,
                        sampling={"temperature": sampling.temperature, "top_k": sampling.top_k,
                                  "top_p": sampling.top_p},
                        # the oracle the tests hold the tokens against
                        teacher_forcing=({"device": "cpu", "dtype": "float64"} if self.reference is None
                                         else {"reference": self.reference, "top": TEACHER_FORCING_TOP}))
        return data


def source_of(spec: str) -> Source:
    """How an engine spec's outputs are obtained."""
    from specaudit.engines.registry import black_box_prefix

    prefix = black_box_prefix(spec)
    return "recording" if prefix == "recorded" else "server" if prefix else "in-process"
