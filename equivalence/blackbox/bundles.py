"""Repro bundles: one self-contained JSON file per divergence, and its re-check on any machine.

`write_bundles` (called by the audit for every run with divergences) writes
`OUT/bundles/<engine>-<pair>-b<batch>-<dtype>-p<prompt>-<detected by>.json` holding the prompt ids,
the reference's and the engine's outputs, the engine's description and per-token log-probabilities
(when it gave them), the settings (dtype, max_new_tokens, eos_token_id), the ruling with its
evidence, and the noise band of a black-box run. Each divergence record in `audit.json` names its
bundle under `bundle`.

`replay_bundle` decodes the prompt again with the reference (the target alone) and rules on the
engine's recorded output as the audit did. Exit status of `specaudit replay`:
- 0: the reference now agrees with the engine's output, or the divergence is ruled `numerical`;
- 1: the divergence still reproduces as `structural`, or it was found through logits or draft
  proposals (which a bundle cannot re-run without the engine): the recorded ruling stands;
- 2: bad usage (an unreadable bundle, an unknown pair).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from specaudit import __version__ as VERSION
from specaudit.equivalence.records import Divergence
from specaudit.equivalence.records.serialize import divergence_to_json

BUNDLE_FORMAT = "specaudit-repro-bundle/1"


def _slug(text: Any) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(text)).strip("_")[:60] or "x"


@dataclass(frozen=True)
class BundleRun:
    """What a bundle says of the run its divergence came from."""

    engine: str
    pair: str
    dtype: str
    device: str | None
    batch_size: int | None
    engine_description: Mapping[str, Any] | None
    noise_band: Mapping[str, Any] | None  # a black-box run's (rulings.NoiseBand.to_dict), else None


def bundle_name(run: BundleRun, divergence: Divergence) -> str:
    return (f"{_slug(run.engine)}-{_slug(run.pair)}-b{run.batch_size}-{run.dtype}"
            f"-p{divergence.prompt_index}-{divergence.detected_by}.json")


def write_bundles(bundle_dir: Path | str, run: BundleRun, divergences: Sequence[Divergence],
                  prompts: list[list[int]], reference_outputs: list[list[int]], outputs: list[list[int]],
                  engine_logprobs: list[list[dict[int, float]] | None] | None, *,
                  max_new_tokens: int, eos_token_id: int | Sequence[int] | None) -> list[Divergence]:
    """One bundle per divergence of `run`; returns the divergences, each naming its bundle's file."""
    folder = Path(bundle_dir)
    folder.mkdir(parents=True, exist_ok=True)
    named = []
    for divergence in divergences:
        index = divergence.prompt_index
        per_token = engine_logprobs[index] if engine_logprobs and index < len(engine_logprobs) else None
        bundle = {
            "format": BUNDLE_FORMAT,
            "specaudit_version": VERSION,
            "engine": run.engine,
            "engine_description": run.engine_description,
            "pair": run.pair,
            "settings": {"dtype": run.dtype, "device": run.device, "batch_size": run.batch_size,
                         "max_new_tokens": max_new_tokens, "eos_token_id": eos_token_id},
            "prompt_index": index,
            "prompt_ids": [int(t) for t in prompts[index]],
            "reference_output": [int(t) for t in reference_outputs[index]],
            "engine_output": [int(t) for t in outputs[index]],
            "engine_logprobs": ([{str(k): v for k, v in entry.items()} for entry in per_token]
                                if per_token is not None else None),
            "noise_band": run.noise_band,
            "divergence": divergence_to_json(divergence),
        }
        path = folder / bundle_name(run, divergence)
        path.write_text(json.dumps(bundle, indent=1, default=str))
        named.append(replace(divergence, bundle=f"{folder.name}/{path.name}"))
    return named


class BundleError(ValueError):
    """A file that is not a readable repro bundle."""


def read_bundle(path: Path | str) -> dict[str, Any]:
    source = Path(path)
    try:
        bundle = json.loads(source.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BundleError(f"cannot read bundle {str(path)!r}: {exc}") from None
    if not isinstance(bundle, dict) or bundle.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"{str(path)!r} is not a specaudit repro bundle (format {BUNDLE_FORMAT})")
    return bundle


def replay_bundle(bundle: dict[str, Any], target: Any, replay_target: Any | None = None,
                  dtype: str | None = None) -> dict[str, Any]:
    """Re-check one bundle against `target` (a loaded model; `replay_target` its float64 copy when
    `target` is not float64). Returns `{"kind", "exit_status", "message", ...}`."""
    from specaudit.engines.models.zoo import float64_copy
    from specaudit.engines.reference import ReferenceDecoder
    from specaudit.equivalence.compare import compare_tokens
    from specaudit.equivalence.rulings import NoiseBand, Ruler, band_evidence

    settings = bundle["settings"]
    dtype = dtype or settings["dtype"]
    prompt, engine_out = bundle["prompt_ids"], bundle["engine_output"]
    decoder = ReferenceDecoder(target, record_logits=True)
    reference_out = decoder.generate([prompt], settings["max_new_tokens"], settings["eos_token_id"])[0]
    result: dict[str, Any] = {"reference_output": reference_out,
                              "reference_matches_bundle": reference_out == bundle["reference_output"]}
    comparison = compare_tokens(0, reference_out, engine_out)
    detected_by = bundle["divergence"].get("detected_by", "tokens")
    if comparison.exact:
        if detected_by != "tokens":
            return {**result, "kind": "structural", "exit_status": 1,
                    "message": f"the tokens agree with the reference; this divergence was found through "
                               f"{detected_by}, which a bundle cannot re-run without the engine: the recorded "
                               f"ruling ({bundle['divergence'].get('kind')}) stands"}
        return {**result, "kind": None, "exit_status": 0,
                "message": "the reference now agrees with the engine's output: the divergence does not reproduce"}
    position = comparison.first_divergence
    reference_token = reference_out[position] if position < len(reference_out) else None
    engine_token = engine_out[position] if position < len(engine_out) else None
    band_record = bundle.get("noise_band")
    # ruled as the audit rules (equivalence/rulings/): in float64 every mismatch is a bug, below it (or
    # with a black-box engine's band) precision is measured on the run
    exact = replay_target if replay_target is not None else (target if dtype == "float64" else float64_copy(target))
    band = NoiseBand(**band_record) if band_record else None
    kind, evidence = Ruler(dtype, target, exact, band).rule(prompt, reference_out, engine_out, position)
    if band is not None:
        evidence.update(band_evidence(band, evidence, engine_token, reference_token))
    return {**result, "kind": kind, "position": position, "reference_token": reference_token,
            "engine_token": engine_token, "evidence": evidence, "exit_status": 1 if kind == "structural" else 0,
            "message": f"the divergence reproduces at position {position} and is ruled {kind}: {evidence['reason']}"}
