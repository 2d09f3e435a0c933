"""Request parameters under sampling: penalties, logit bias, bad words, min_tokens and min-p, applied in vLLM's
order by the reference (engines/requests/sampled.py, equivalence/sampling/teacher.py) and by the sampled engines;
the exact check of one speculative step with them; the planted faults (a penalty counted once per verify step,
penalties ignored) rejected; the command line, the prompts file, the plugin and the servers' requests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cli_run import audit, usage_error
from repeat_models import repeat_pair
from table_models import PositionTableModel
from specaudit import read_report
from specaudit.engines import acceptance
from specaudit.engines.adapters.sampled_servers import sampled_request
from specaudit.engines.adapters.servers import LlamaCppEngine, SGLangEngine, VLLMEngine
from specaudit.engines.requests import RequestParams, process
from specaudit.engines.requests.rows import RowRequests
from specaudit.engines.requests.sampled import request_table, sampling_of
from specaudit.engines.sampling.engine import SampledRow, SampledSpeculative
from specaudit.engines.sampling.process import SamplingParams, process_logits
from specaudit.equivalence.sampling.exact import outcomes_of
from specaudit.testing.faults.sampling import PenaltiesIgnored, PenaltyPerStep

pytest_plugins = ["pytester"]

EXACT = 1e-9
STOP = 3  # the stop id min_tokens bans
PROMPT = [0]
# every processor at once: a penalty that a token seen in the step must carry at the positions after it
EVERYTHING = RequestParams(temperature=0.8, top_k=4, top_p=0.95, min_p=0.02, repetition_penalty=1.4,
                           presence_penalty=0.9, frequency_penalty=0.6, logit_bias={1: 0.7}, bad_words=[[2, 2]],
                           min_tokens=2)


def test_the_chain_is_vllms_order() -> None:
    """Processors on the history (bad words, min_tokens, logit bias, penalties), then temperature, min-p, top-k,
    top-p: the table equals that composition position by position, and the history of position j holds the
    first j tokens."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6, dtype=torch.float64)
    continuation = [2, 2, 5]
    table = request_table(logits, PROMPT, [4], continuation, EVERYTHING, (STOP,))
    for j in range(3):
        row = process(logits[j], PROMPT, [4] + continuation[:j], EVERYTHING, (STOP,)).greedy
        assert torch.equal(table[j], process_logits(row, sampling_of(EVERYTHING)))
    assert float(table[0, STOP]) == 0.0 and float(table[2, 2]) == 0.0  # min_tokens; the bad word [2, 2] after a 2
    # the logit bias comes before the repetition penalty (vLLM): a seen token's biased logit is divided
    seen = torch.zeros(6, dtype=torch.float64)
    biased = process(seen, [1], [], RequestParams(temperature=1.0, logit_bias={1: 2.0}, repetition_penalty=2.0), ()).greedy
    assert float(biased[1]) == 1.0


def _conditional_departure(outcomes: dict[tuple[int, ...], float], target: torch.Tensor, params: RequestParams,
                           output: list[int]) -> float:
    """The largest TV between the step's next token given each emitted prefix and the target's distribution
    given that prefix (the penalties make it depend on the prefix: `request_table` with the prefix as history)."""
    worst = 0.0
    positions = max(len(seq) for seq in outcomes)
    for j in range(positions):
        prefixes = {seq[:j] for seq in outcomes if len(seq) > j}
        for prefix in prefixes:
            mass = torch.zeros(target.shape[-1], dtype=torch.float64)
            for seq, p in outcomes.items():
                if len(seq) > j and seq[:j] == prefix:
                    mass[seq[j]] += p
            expected = request_table(target[len(PROMPT) - 1 + len(output) + j].unsqueeze(0), PROMPT,
                                     output + list(prefix), [], params, (STOP,))[0]
            worst = max(worst, 0.5 * float((mass / mass.sum() - expected).abs().sum()))
    return worst


def _engine_step(engine_class: type, target: torch.Tensor, draft: torch.Tensor, params: RequestParams, k: int,
                 output: list[int]) -> dict[tuple[int, ...], float]:
    engine = engine_class(PositionTableModel(target), PositionTableModel(draft), temperature=1.0, draft_tokens=k)

    def run(draws) -> list[int]:
        return engine.step([SampledRow(list(PROMPT), list(output), params, (STOP,))], [draws])[0]

    return outcomes_of(run)


def _rows_step(target: torch.Tensor, draft: torch.Tensor, params: RequestParams, k: int) -> dict[tuple[int, ...], float]:
    """One step of the project's engines' sampled path (EQSPEC, EXSPEC, INPLACE): the request's `RowRequests`,
    its pass sampler drawing the drafts, the processed target logits, `acceptance.accept`."""

    def run(draws) -> list[int]:
        requests = RowRequests([PROMPT], [params], eos_token_id=STOP)
        requests.rows[0].sampling.draws = draws
        step = requests.step([0])
        drafts = torch.stack([step.sampler.draft_tokens(draft[j:j + 1])[0] for j in range(k)]).unsqueeze(0)  # [1, k]
        verdict = acceptance.accept(target[: k + 1].unsqueeze(0), drafts, k + 1, None, requests=step,
                                    draft_logits=draft[:k].unsqueeze(0))
        return verdict.tokens[0, : int(verdict.emitted[0])].tolist()

    return outcomes_of(run)


def _cases(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(11)
    return [(torch.randn(6, 5, generator=generator, dtype=torch.float64) * 1.5,
             torch.randn(6, 5, generator=generator, dtype=torch.float64) * 1.5) for _ in range(count)]


@pytest.mark.parametrize("index", range(6))
def test_a_speculative_step_with_every_processor_is_exact(index: int) -> None:
    """sampled-spec and the project engines' path: every emitted token, given the tokens before it in the step,
    has exactly the target's processed distribution (the penalties counting the accepted drafts)."""
    target, draft = _cases(6)[index]
    params = RequestParams(**{**EVERYTHING.to_dict(), "top_k": 0, "top_p": 1.0})
    for output in ([], [2]):
        outcomes = _engine_step(SampledSpeculative, target, draft, params, 2, output)
        assert abs(sum(outcomes.values()) - 1) < EXACT
        assert _conditional_departure(outcomes, target, params, output) < EXACT
    assert _conditional_departure(_rows_step(target, draft, params, 2), target, params, []) < EXACT


def test_a_penalty_counted_once_per_step_and_ignored_penalties_depart_exactly() -> None:
    """The planted faults on the same step: a token drafted and accepted earlier in the step escapes its
    penalty at the positions after it (per step), or no penalty at all (ignored)."""
    params = RequestParams(temperature=1.0, presence_penalty=2.0, frequency_penalty=1.0, repetition_penalty=1.5)
    target = torch.zeros(6, 4, dtype=torch.float64)  # flat: a penalized token's share moves the most
    draft = torch.zeros(6, 4, dtype=torch.float64)
    assert _conditional_departure(_engine_step(SampledSpeculative, target, draft, params, 2, []), target, params, []) < EXACT
    per_step = _conditional_departure(_engine_step(PenaltyPerStep, target, draft, params, 2, []), target, params, [])
    ignored = _conditional_departure(_engine_step(PenaltiesIgnored, target, draft, params, 2, [1]), target, params, [1])
    assert per_step > 0.2 and ignored > 0.2


FAULT = "specaudit.testing.faults.sampling:make_fault_engine"


@pytest.fixture(scope="module")
def repeating() -> list[str]:
    """The repeating pair's folders as `--target`, `--draft` (tests/repeat_models.py)."""
    folders = repeat_pair()
    return ["--target", str(folders.target), "--draft", str(folders.draft)]


def _prompts(tmp_path: Path, *lines: dict) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def _common(tmp_path: Path, repeating: list[str], *lines: dict) -> list[str]:
    return [*repeating, "--temperature", "1.0", "--prompts", _prompts(tmp_path, *lines), "--max-new-tokens", "6",
            "--draft-tokens", "3", "--batch-size", "64", "--samples", "40", "--seed", "3"]


def test_the_audit_passes_the_sampled_engines_and_rejects_both_faults(tmp_path: Path, repeating: list[str]) -> None:
    """The penalties from the command line: sampled-spec, sampled-reference and eqspec pass; a penalty counted once per verify step
    and ignored penalties depart (their power at these settings: reports/sampled-params/README.md)."""
    common = _common(tmp_path, repeating, {"text": "xyz a"}) + ["--presence-penalty", "1.5", "--frequency-penalty", "1.0"]
    result = audit("--engine", "sampled-spec", "--engine", "sampled-reference", "--engine", "eqspec", *common,
                   out=tmp_path / "ok")
    assert result.returncode == 0, result.stdout + result.stderr
    runs = read_report(tmp_path / "ok").sampled
    assert runs["sampled-spec"]["request_params"] == [{"temperature": 1.0, "presence_penalty": 1.5,
                                                       "frequency_penalty": 1.0}]
    assert "request parameters: presence_penalty 1.5, frequency_penalty 1.0" in (tmp_path / "ok" / "report.md").read_text()
    for fault in ("penalty_per_step", "penalties_ignored"):
        result = audit("--engine", FAULT, "--engine-option", f"fault={fault}", *common, out=tmp_path / fault)
        assert result.returncode == 1, (fault, result.stdout)
        assert read_report(tmp_path / fault).sampled[FAULT]["verdict"] == "departure"


def test_per_prompt_params_in_the_prompts_file(tmp_path: Path, repeating: list[str]) -> None:
    """A prompts file line's `params`: the reference applies each prompt's own (the penalties on one; a logit bias,
    min-p, a banned `bb` and min_tokens on the other), and an engine that ignores the penalties departs."""
    common = _common(tmp_path, repeating, {"text": "xyz a", "params": {"presence_penalty": 1.5, "frequency_penalty": 1.0}},
                     {"text": "xyz b", "params": {"logit_bias": {"99": 1.0}, "min_p": 0.05, "bad_words": [[98, 98]],
                                                  "min_tokens": 3}})
    assert audit("--engine", "sampled-spec", *common, out=tmp_path / "ok").returncode == 0
    report = read_report(tmp_path / "ok").sampled["sampled-spec"]
    assert sorted(map(sorted, report["request_params"])) == [
        ["bad_words", "logit_bias", "min_p", "min_tokens", "temperature"],
        ["frequency_penalty", "presence_penalty", "temperature"]]
    faulty = audit("--engine", FAULT, "--engine-option", "fault=penalties_ignored", *common, out=tmp_path / "bad")
    assert faulty.returncode == 1, faulty.stdout


@pytest.mark.parametrize("args, fragments", [
    (("--engine", "sampled-spec", "--stop", "x"), ("--stop", "drop it")),
    (("--engine", "hf-assisted", "--presence-penalty", "0.5"), ("hf-assisted", "takes no request parameters")),
])
def test_what_the_sampled_judge_cannot_apply_is_refused(tmp_path: Path, args, fragments) -> None:
    usage_error(audit(*args, "--pair", "tiny-llama", "--temperature", "1.0", "--num-prompts", "1", "--samples", "10",
                      out=tmp_path), *fragments)


def test_a_prompts_file_asking_for_a_stop_string_is_refused(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"text": "abc", "params": {"stop": ["x"]}}) + "\n")
    usage_error(audit("--engine", "sampled-spec", "--pair", "tiny-llama", "--temperature", "1.0", "--prompts",
                      str(prompts), "--samples", "10", out=tmp_path), "stop", "drop it")


def test_servers_are_sent_the_parameters_in_their_dialect() -> None:
    request = RequestParams(temperature=0.9, top_k=5, min_p=0.1, presence_penalty=0.5, frequency_penalty=0.25,
                            repetition_penalty=1.2, logit_bias={3: -4.0}, min_tokens=2)
    vllm = sampled_request(VLLMEngine("http://x"), [1, 2], 3, 258, sampling_of(request), 7, request)
    assert (vllm["presence_penalty"], vllm["frequency_penalty"], vllm["repetition_penalty"]) == (0.5, 0.25, 1.2)
    assert vllm["logit_bias"] == {"3": -4.0} and vllm["min_tokens"] == 2 and vllm["min_p"] == 0.1
    assert (vllm["temperature"], vllm["top_k"], vllm["seed"]) == (0.9, 5, 7)
    sglang = sampled_request(SGLangEngine("http://x"), [1], 3, 258, sampling_of(request), 7, request)["sampling_params"]
    assert sglang["presence_penalty"] == 0.5 and sglang["min_new_tokens"] == 2 and sglang["min_p"] == 0.1
    llama_request = RequestParams(temperature=0.9, presence_penalty=0.5, repetition_penalty=1.2)
    llama = sampled_request(LlamaCppEngine("http://x"), [1], 3, 258, sampling_of(llama_request), None, llama_request)
    # the whole context, as a count: the prompt's 1 token and 3 new ones
    assert llama["repeat_penalty"] == 1.2 and llama["repeat_last_n"] == 4 and llama["samplers"][0] == "penalties"


PLUGIN = ["-p", "no:cacheprovider", "--specaudit-pair", "tiny-llama", "--specaudit-temperature", "1.0",
          "--specaudit-samples", "60", "--specaudit-seed", "3", "-k", "specaudit-sampled"]
CHECKING_ENGINE = """
from specaudit.engines.sampling.engine import SampledSpeculative


class Checks(SampledSpeculative):
    def generate(self, prompts, max_new_tokens, eos_token_id, seeds=None):
        asked = self.request_params
        if asked is None or len(asked) != len(prompts) or any(p.presence_penalty != 1.5 for p in asked):
            raise RuntimeError(f"request parameters not given: {asked}")
        return super().generate(prompts, max_new_tokens, eos_token_id, seeds=seeds)


def make(target, draft, **options):
    return Checks(target, draft, **options)
"""


def test_the_plugin_takes_request_params(pytester) -> None:
    """`--specaudit-request-params JSON`: every call of the engine's sampled test gets them, one per request (the
    engine raises otherwise), and it passes; a field the sampled judge cannot apply is refused."""
    pytester.makepyfile(test_own="def test_own():\n    assert True\n", checking_engines=CHECKING_ENGINE)
    pytester.syspathinsert()
    asked = pytester.runpytest_inprocess("--specaudit-engine", "checking_engines:make", *PLUGIN,
                                         "--specaudit-request-params", '{"presence_penalty": 1.5, "frequency_penalty": 0.5}')
    asked.assert_outcomes(passed=1)
    missing = pytester.runpytest_inprocess("--specaudit-engine", "checking_engines:make", *PLUGIN)
    missing.assert_outcomes(failed=1)
    refused = pytester.runpytest_inprocess("--specaudit-engine", "checking_engines:make", *PLUGIN,
                                           "--specaudit-request-params", '{"stop": ["x"]}')
    assert refused.ret != 0
    assert "stop is not applied by the sampled test" in refused.stdout.str() + refused.stderr.str()
