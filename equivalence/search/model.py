"""The model beside the implementation: what one drawn example is, in plain data, and what it covered.

An example (`Mix`) is a list of requests in the order they were drawn, each with its prompt (and how it was made:
fresh, sharing a prefix with an earlier request, or identical to one), its parameters and its arrival. `waves`
turns the arrivals into the order of sending: a wave is sent together (in flight at once on a server, one
`generate` call in process), and the waves one after another. The state machine (equivalence/search/machine.py)
builds a `Mix` and the implementation sends it (equivalence/search/arrival.py); `Coverage` counts what the
examples reached.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from specaudit.engines.requests import RequestParams
from specaudit.equivalence.search.strategies import BLOCK_SIZE, FAMILIES


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    params: RequestParams
    arrival: str  # strategies.ARRIVALS
    kind: str  # strategies.PROMPT_KINDS
    shared_with: int | None = None  # the earlier request whose prefix it shares (or whose prompt it repeats)
    shared_length: int = 0  # tokens shared with it


@dataclass
class Mix:
    requests: list[Request] = field(default_factory=list)
    # sampled probes of the requests' prompts with seeds (equivalence/search/seeds.py), judged after the requests
    probes: list[Any] = field(default_factory=list)

    def key(self) -> tuple:
        """What the mix sends, as a hashable value (the same key: the same requests, arrivals and probes)."""
        return (tuple((r.prompt, r.params, r.arrival) for r in self.requests),
                tuple((p.request, p.temperature, p.seed) for p in self.probes))

    def waves(self) -> list[list[int]]:
        """The request indices sent together, wave by wave (module docstring)."""
        out: list[list[int]] = []
        open_wave = False
        for index, request in enumerate(self.requests):
            if request.arrival == "join" and out and open_wave:
                out[-1].append(index)
            else:
                out.append([index])
                open_wave = request.arrival != "alone"
        return out


def families_of(params: RequestParams) -> list[str]:
    """The parameter families a request set (strategies.FAMILIES)."""
    sent = set(params.sent()) | ({"logprobs"} if params.logprobs is not None else set())
    found = []
    for family in FAMILIES:
        names = {"penalties": {"repetition_penalty", "presence_penalty", "frequency_penalty"},
                 "bad_words": {"bad_words", "bad_words_text"}}.get(family, {family})
        if sent & names:
            found.append(family)
    return found


@dataclass
class Coverage:
    """What the examples reached: parameter families and pairs of them within one request, prompt shapes, arrival
    and wave sizes, and the reference's own endings (a stop string inside the output, a stop id, the budget)."""

    examples: int = 0
    requests: int = 0
    families: Counter = field(default_factory=Counter)
    pairs: Counter = field(default_factory=Counter)
    shapes: Counter = field(default_factory=Counter)
    wave_sizes: Counter = field(default_factory=Counter)
    endings: Counter = field(default_factory=Counter)
    refused: Counter = field(default_factory=Counter)
    constraints: Counter = field(default_factory=Counter)  # structured-output kinds drawn
    probes: int = 0  # sampled probes with seeds judged (seeds.py)

    def add(self, mix: Mix, run: dict[str, Any]) -> None:
        self.examples += 1
        self.probes += sum(1 for seen in run.get("seed_probes") or [] if "refused" not in seen)
        self.requests += len(mix.requests)
        for request in mix.requests:
            names = families_of(request.params)
            self.families.update(names or ["none"])
            self.pairs.update(f"{a}+{b}" for i, a in enumerate(names) for b in names[i + 1:])
            self.shapes[request.kind] += 1
            if request.params.constraint is not None:
                self.constraints[request.params.constraint.kind] += 1
                if request.params.constraint.reasoning_end:
                    self.constraints["after a reasoning end marker"] += 1
            if request.kind == "shared":
                aligned = request.shared_length % BLOCK_SIZE == 0
                self.shapes["shared, block-aligned" if aligned else "shared, not block-aligned"] += 1
                if request.shared_length >= BLOCK_SIZE:
                    self.shapes[f"shared, at least one block ({BLOCK_SIZE} tokens)"] += 1
        for wave in mix.waves():
            self.wave_sizes[str(len(wave)) if len(wave) < 3 else "3+"] += 1
        for record in run.get("prompts") or []:
            finish = record.get("reference_finish") or [None, None]
            reason, stop = finish[0], finish[1]
            self.endings["stop string" if isinstance(stop, str) else "stop id" if isinstance(stop, int)
                         else "eos" if reason == "stop" else "length"] += 1
        for refusal in run.get("refused_parameters") or []:
            self.refused[str(refusal.get("parameter"))] += 1

    def not_reached(self) -> list[str]:
        """What the search never reached, each as a short phrase."""
        missing = [f"no request with {family}" for family in FAMILIES if not self.families[family]]
        if not self.shapes["shared"]:
            missing.append("no prefix shared")
        elif not self.shapes[f"shared, at least one block ({BLOCK_SIZE} tokens)"]:
            missing.append(f"no prefix of a whole block ({BLOCK_SIZE} tokens) shared")
        if not self.shapes["identical"]:
            missing.append("no identical prompts")
        if not (self.wave_sizes["2"] or self.wave_sizes["3+"]):
            missing.append("no two requests in flight together")
        if not self.endings["stop string"]:
            missing.append("no stop string inside the reference's output")
        if not self.probes:
            missing.append("no sampled probe with seeds (the engine takes no sampled requests, or none was drawn)")
        return missing

    def to_dict(self) -> dict[str, Any]:
        return {"examples": self.examples, "requests": self.requests, "families": dict(self.families),
                "pairs": dict(self.pairs), "shapes": dict(self.shapes), "wave_sizes": dict(self.wave_sizes),
                "reference_endings": dict(self.endings), "refused": dict(self.refused), "constraints": dict(self.constraints),
                "seed_probes": self.probes,
                "not_reached": self.not_reached()}
