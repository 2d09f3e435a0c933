"""What the pytest plugin runs per (engine, pair) with `--specaudit-temperature T`: the sampled audit of the
engine (`equivalence/sampling/`: its samples teacher-forced through the float64 target, goodness-of-fit tests
with the power they have, the seed's promises), so a team gates merges on its sampler as on its greedy path.

Seeds follow the greedy search's (`seed.py`): the run's one seed seeds the engine's requests, so a CI run
draws the same samples on every run of the same code and a failure prints the command that draws them again.
The tests' family-wise false-positive rate is `--specaudit-alpha` (0.01): with a seed drawn at random, a
correct engine fails that often; with CI's fixed seed, a run of the same code passes or fails alike each time.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

# the options of the sampled check, with their defaults (the plugin's own)
SAMPLED_OPTIONS = {"specaudit_temperature": ("--specaudit-temperature", None),
                   "specaudit_top_k": ("--specaudit-top-k", 0),
                   "specaudit_top_p": ("--specaudit-top-p", 1.0),
                   "specaudit_samples": ("--specaudit-samples", 300),
                   "specaudit_sampled_new_tokens": ("--specaudit-sampled-new-tokens", 3),
                   "specaudit_sampled_draft_tokens": ("--specaudit-sampled-draft-tokens", 2),
                   "specaudit_alpha": ("--specaudit-alpha", 0.01),
                   "specaudit_request_params": ("--specaudit-request-params", None)}


class SampledDeparture(AssertionError):
    """The engine's samples depart from the target's distribution, or its seed's promise is broken."""


class SampledRunFailed(AssertionError):
    """The engine could not be built for sampling, or its sampled run failed (a hang, ids outside the
    vocabulary, the wrong number of outputs...): the one-line reason of the sampled audit's guard."""


@dataclass(frozen=True)
class SampledSetting:
    temperature: float
    top_k: int
    top_p: float
    samples: int
    max_new_tokens: int
    alpha: float
    draft_tokens: int
    batch_size: int
    request_params: str | None = None  # a JSON object of request parameters (RequestParams.from_dict)

    def requests(self) -> Any:
        """The one `RequestParams` of the test's prompt (the sampler's fields and the JSON's), or None without
        request parameters; ValueError for a bad object or a field the sampled judge cannot apply."""
        import json

        from specaudit.engines.requests import RequestParams
        from specaudit.equivalence.pipeline.sampled import UNSAMPLED_FIELDS

        if self.request_params is None:
            return None
        try:
            given = json.loads(self.request_params)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--specaudit-request-params: not JSON ({exc.msg})") from None
        if not isinstance(given, dict):
            raise ValueError("--specaudit-request-params: give a JSON object")
        params = RequestParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p).merged(
            RequestParams.from_dict(given))
        refused = next((name for name in params.sent() if name in UNSAMPLED_FIELDS or name == "bad_words_text"), None)
        if refused is not None:
            raise ValueError(f"--specaudit-request-params: {refused} is not applied by the sampled test"
                             + (" (give bad_words as token ids)" if refused == "bad_words_text" else ""))
        return params


def setting_from(config: Any) -> SampledSetting | None:
    """The run's sampled setting, or None without `--specaudit-temperature`."""
    temperature = config.getoption("specaudit_temperature")
    if temperature is None:
        return None
    return SampledSetting(temperature, config.getoption("specaudit_top_k"), config.getoption("specaudit_top_p"),
                          config.getoption("specaudit_samples"), config.getoption("specaudit_sampled_new_tokens"),
                          config.getoption("specaudit_alpha"), config.getoption("specaudit_sampled_draft_tokens"),
                          max(config.getoption("specaudit_batch_size") or [8]),
                          config.getoption("specaudit_request_params"))


def check_setting(setting: SampledSetting) -> None:
    """Bad values, refused before any test runs (raised as ValueError, with the option's name)."""
    from specaudit.engines.sampling.process import SamplingParams

    if setting.temperature <= 0:
        raise ValueError(f"--specaudit-temperature {setting.temperature}: give a temperature above 0 (greedy "
                         "decoding is the equivalence tests' own)")
    SamplingParams(temperature=setting.temperature, top_k=setting.top_k, top_p=setting.top_p)
    if min(setting.samples, setting.max_new_tokens, setting.draft_tokens) < 1:
        raise ValueError("--specaudit-samples, --specaudit-sampled-new-tokens and --specaudit-sampled-draft-tokens "
                         "must be at least 1")
    if not 0 < setting.alpha < 1:
        raise ValueError(f"--specaudit-alpha {setting.alpha}: give a false-positive rate between 0 and 1")
    setting.requests()


def run_sampled(engine: str, pair_name: str, setting: SampledSetting, seed: int,
                required: float | None = None) -> dict[str, Any]:
    """The sampled audit of `engine` on the pair's first built-in prompt (float64, on the CPU); its report.
    Raises `SampledRunFailed` or `SampledDeparture` with the finding in words; with `required`
    (`--specaudit-require-acceptance R`), `AcceptanceShort` where the engine's acceptance is below R x the
    expected overlap at some draft position, significantly (an engine that shows no verify steps has no
    expectation under sampling, and no sampled gate)."""
    from specaudit.engines.sampling.process import SamplingParams
    from specaudit.engines.models.zoo import builtin_prompts
    from specaudit.equivalence.reports.sampled import PASS, engine_sentence
    from specaudit.engines.registry import make_engine
    from specaudit.equivalence.acceptance.findings import headline, short_of_required
    from specaudit.equivalence.plugin.acceptance import AcceptanceShort
    from specaudit.equivalence.sampling.run import guarded_sampled_audit
    from specaudit.testing import models

    pair = models.pair(pair_name)
    requests = setting.requests()
    params = SamplingParams(temperature=setting.temperature, top_k=setting.top_k, top_p=setting.top_p,
                            min_p=requests.min_p if requests is not None else 0.0)
    try:
        built = make_engine(engine, pair.target, pair.draft, sampling=params, seed=seed,
                            draft_tokens=setting.draft_tokens, batch_size=setting.batch_size)
    except Exception as exc:  # noqa: BLE001 - a greedy-only engine, or a factory that raises: one line
        raise SampledRunFailed(f"{engine} cannot sample: {type(exc).__name__}: {exc}") from None
    from specaudit.engines.contract import declares

    if requests is not None and not declares(built, "request_params"):
        raise SampledRunFailed(f"{engine} takes no request parameters (it declares no `request_params`): "
                               "drop --specaudit-request-params")
    report = guarded_sampled_audit(
        engine, lambda: built, pair.target, builtin_prompts()[:1], params, timeout=None,
        vocab_size=pair.target.config.vocab_size, batch_size=setting.batch_size, device="cpu",
        samples=setting.samples, max_new_tokens=setting.max_new_tokens, eos_token_id=pair.eos_token_id, seed=seed,
        alpha=setting.alpha, draft=pair.draft, request_params=None if requests is None else [requests],
        require_acceptance=required, tokenizer=pair.tokenizer, draft_tokens=setting.draft_tokens)
    if report.get("failed"):
        raise SampledRunFailed(engine_sentence(engine, report))
    record = report.get("acceptance")
    short = (f"{engine} on {pair_name}, sampled at temperature {setting.temperature:g}: acceptance below "
             f"{required:g} x expected: {headline(record)}" if required is not None and short_of_required(record)
             else None)
    if report["verdict"] != PASS:
        raise SampledDeparture(engine_sentence(engine, report) + (f"; and {short}" if short else ""))
    if short:
        raise AcceptanceShort(short)
    return report


def replay_command(config: Any, engine: str, pair: str, seed: int) -> str:
    """`pytest -k specaudit-sampled --specaudit-engine E --specaudit-pair P --specaudit-temperature T ...
    --specaudit-seed N`: the same samples, tested the same way."""
    setting = setting_from(config)
    words = ["pytest", "-k", "specaudit-sampled", "--specaudit-engine", engine, "--specaudit-pair", pair,
             "--specaudit-batch-size", str(setting.batch_size if setting else 8), "--specaudit-seed", str(seed)]
    for name, (flag, default) in SAMPLED_OPTIONS.items():
        value = config.getoption(name)
        if value != default:
            words += [flag, str(value)]
    return shlex.join(words)
