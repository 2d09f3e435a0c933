"""The typed records of `audit.json` (equivalence/records/) and their one serializer (records/serialize.py):
every committed `audit.json`, of this version or an earlier one, reads into them and writes back the same; the
audit.json of each door reads back through `specaudit.read_report` into them; they are frozen; a key they do
not name is kept."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import random
from pathlib import Path
from typing import Any

import pytest

import specaudit
from cli_run import audit as cli_audit
from served_lm import EOS as TOY_EOS, ToyLM
from specaudit.engines.adapters.recorded import write_recording
from specaudit.engines.models import zoo
from specaudit.engines.reference import ReferenceDecoder
from specaudit.equivalence import run_record
from specaudit.equivalence.reports.sampled import PASS
from specaudit.equivalence.records import (ABSENT, GREEDY_FIELDS, Audit, Context, ContextText, Diagnosis,
                                           Divergence, FrozenDict, Run, StepBatch)
from specaudit.equivalence.records.serialize import (audit_from_json, audit_to_json, diagnosis_from_json,
                                                     diagnosis_to_json, divergence_from_json, divergence_to_json,
                                                     run_from_json, run_to_json, upgrade, upgrade_run)

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = sorted(path for folder in ("reports", "tests/data") for path in (ROOT / folder).rglob("audit*.json"))


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def _current(data: dict[str, Any]) -> bool:
    """Whether a file has today's layout (every run says its mode): its keys come back in its own order."""
    return all("mode" in run for run in data["runs"])


# ---- (a) every committed audit.json: read, written back the same ------------------------------------------

def test_the_committed_files_span_versions() -> None:
    versions = {_read(path)["specaudit_version"] for path in COMMITTED}
    assert len(COMMITTED) >= 40 and {"0.1.0", "0.2.0", "0.3.0"} <= versions, (len(COMMITTED), versions)
    assert any(_current(_read(path)) for path in COMMITTED) and not all(_current(_read(path)) for path in COMMITTED)


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(ROOT).parent))
def test_a_committed_audit_json_round_trips(path: Path) -> None:
    data = _read(path)
    original = copy.deepcopy(data)
    audit = audit_from_json(data)
    assert data == original, "reading changed the file's dict"
    assert isinstance(audit, Audit) and all(isinstance(run, Run) for run in audit.runs)
    assert audit_to_json(audit) == upgrade(data)
    for run in data["runs"]:
        assert run_to_json(run_from_json(run)) == upgrade_run(run)
        for divergence in upgrade_run(run).get("divergences", []):
            assert divergence_to_json(divergence_from_json(divergence)) == divergence
            if "diagnosis" in divergence:
                assert diagnosis_to_json(diagnosis_from_json(divergence["diagnosis"])) == divergence["diagnosis"]
    if _current(data):  # today's layout: the same text, key order included
        assert json.dumps(audit_to_json(audit)) == json.dumps(data)
    else:  # an earlier one: upgraded, then stable
        assert audit_to_json(audit_from_json(audit_to_json(audit))) == audit_to_json(audit)


def test_an_earlier_served_run_reads_into_the_same_records() -> None:
    """A served run as versions before the one pipeline wrote it: `band`, its divergences' class, `needs_weights`
    and reason at top level, no `detected_by`, its report checks apart in `findings`."""
    flip = {"prompt_index": 0, "position": 3, "reference_token": 5, "engine_token": 9, "kind": "structural",
            "class": "unknown", "needs_weights": True, "decided_by": "reference-margin", "margin": 2.5,
            "margin_exact": True, "band": 1e-5, "reason": "beyond the band", "cause": "needs the weights"}
    near = {"prompt_index": 1, "position": 2, "reference_token": 4, "engine_token": 6, "kind": "numerical",
            "class": None, "needs_weights": False, "decided_by": "reference-margin", "margin": 1e-6,
            "margin_exact": True, "band": 1e-5, "reason": "within the band"}
    usage = {"prompt_index": 1, "position": None, "kind": "structural", "class": "usage_report",
             "needs_weights": False, "decided_by": "usage", "reason": "completion_tokens 7, returned 6",
             "reference_token": None, "engine_token": None, "evidence": {"usage": {"completion_tokens": 7}},
             "detected_by": "usage"}
    old = {"engine": "vllm:http://h:1", "pair": "m", "batch_size": 4, "dtype": "served", "device": "server",
           "num_prompts": 2, "exact_matches": 0, "equivalent": False, "structural_divergences": 2,
           "numerical_divergences": 1, "max_logit_error": None, "logit_tolerance": None, "seconds": 1.5,
           "tokens_generated": 0, "error": None, "trace": None, "prompts": [], "divergences": [flip, near],
           "findings": [usage], "band": {"width": 1e-5, "parts": {}, "notes": []}}
    run = run_from_json(old)
    assert run.mode == "greedy" and run.noise_band == {"width": 1e-5, "parts": {}, "notes": ()}  # lists frozen
    assert run.failures == () and "band" not in run.extra and "findings" not in run.extra
    first, second, third = run.divergences
    assert isinstance(first.diagnosis, Diagnosis) and first.structural and first.detected_by == "tokens"
    assert (first.diagnosis.cls, first.diagnosis.named_by, first.diagnosis.needs_weights) == (
        "unknown", "reference-margin", True)
    assert first.evidence["reason"] == "beyond the band" and first.extra["cause"] == "needs the weights"
    assert second.kind == "numerical" and second.diagnosis is ABSENT and second.evidence == {"reason": "within the band"}
    assert third.detected_by == "usage" and third.diagnosis_class == "usage_report"
    assert run.divergence_classes == ("unknown", "usage_report") and not run.passed
    assert run_to_json(run) == upgrade_run(old) and run_to_json(run_from_json(run_to_json(run))) == run_to_json(run)
    # the dict-level reader that read_report and run_record.upgrade use gives the same names
    upgraded = run_record.upgrade({"runs": [old]})["runs"][0]
    assert upgraded == run_to_json(run) and "band" not in upgraded and "findings" not in upgraded


# ---- (b) each door's audit.json, read back by specaudit.read_report ----------------------------------------

def _typed(report: specaudit.AuditReport) -> tuple[Run, ...]:
    """The report's runs typed, each the same as its JSON, every nested record of its type."""
    records = report.records
    assert len(records) == len(report.runs) and report.records is records  # read once
    for run, data in zip(records, report.runs, strict=True):
        assert isinstance(run, Run) and run_to_json(run) == data
        assert run.passed == run_record.passed(data)
        for divergence in run.divergences:
            assert isinstance(divergence, Divergence) and isinstance(divergence.evidence, FrozenDict)
            assert divergence.context is None or isinstance(divergence.context, (Context, type(ABSENT)))
            assert divergence.text is None or isinstance(divergence.text, (ContextText, type(ABSENT)))
            assert divergence.batch is None or isinstance(divergence.batch, (StepBatch, type(ABSENT)))
            if divergence.structural:
                assert isinstance(divergence.diagnosis, Diagnosis), divergence
    return records


def _same_order(report: specaudit.AuditReport, *engines: str) -> None:
    """The runs of `engines` come back with the pipeline's key order, divergences' included."""
    for run, data in zip(report.records, report.runs, strict=True):
        if run.engine in engines:
            assert json.dumps(run_to_json(run)) == json.dumps(data), run.engine


@pytest.fixture(scope="module")
def in_process(tmp_path_factory) -> specaudit.AuditReport:
    """In process, greedy: a correct engine, one with a planted bug (BSP counts positions past rejections) and
    one that raises."""
    out = tmp_path_factory.mktemp("in-process")
    specaudit.audit(["eqspec", "bsp", "failing_engines:make_raising"], pairs=["tiny-gpt2"], batch_sizes=[2],
                    num_prompts=4, max_new_tokens=8, adversarial=False, out=out)
    return specaudit.read_report(out)


def test_in_process_runs_read_back_typed(in_process) -> None:
    correct, buggy, raising = _typed(in_process)
    assert (correct.engine, correct.mode, correct.passed, correct.divergences) == ("eqspec", "greedy", True, ())
    assert correct.exact_matches == correct.num_prompts == 4 and correct.noise_band is None
    assert isinstance(correct.timing, FrozenDict) and isinstance(correct.eos_token_ids, tuple)
    assert buggy.structural and not buggy.passed and set(buggy.divergence_classes) == {"position_ids"}
    first = buggy.structural[0]
    assert isinstance(first.context, Context) and isinstance(first.batch, StepBatch)
    assert isinstance(first.accepted_history, tuple) and first.decided_by == "float64"
    assert isinstance(first.diagnosis.tried, tuple)
    assert raising.failed is True and "planted failure inside generate" in raising.error
    assert "Traceback" in raising.traceback and raising.noise_band is ABSENT and not raising.passed
    _same_order(in_process, "eqspec", "bsp")


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> specaudit.AuditReport:
    """A recording (`recorded:FILE`) with one token the reference did not choose."""
    folder = tmp_path_factory.mktemp("recording")
    pair = zoo.load_pair("tiny-llama")
    prompts = zoo.builtin_prompts()[:2]
    outputs = ReferenceDecoder(pair.target).generate(prompts, 12, pair.eos_token_id)
    outputs[1][6] = (outputs[1][6] + 1) % 256
    path = write_recording(folder / "bug.jsonl", prompts, outputs)
    result = cli_audit("--engine", f"recorded:{path}", "--pair", "tiny-llama", "--max-new-tokens", "12",
                       out=folder / "out")
    assert result.returncode == 1, result
    return specaudit.read_report(folder / "out")


def test_a_recording_reads_back_typed(recording) -> None:
    (run,) = _typed(recording)
    assert run.engine.startswith("recorded:") and isinstance(run.noise_band, FrozenDict)
    (flip,) = run.structural
    assert (flip.prompt_index, flip.position) == (1, 6) and isinstance(flip.diagnosis, Diagnosis)
    assert isinstance(flip.text, ContextText) and flip.bundle
    _same_order(recording, run.engine)


@pytest.fixture(scope="module")
def sampled(tmp_path_factory) -> specaudit.AuditReport:
    out = tmp_path_factory.mktemp("sampled")
    result = cli_audit("--temperature", "1", "--samples", "8", "--pair", "tiny-llama", "--engine", "sampled-spec",
                       "--num-prompts", "1", "--max-new-tokens", "4", out=out)
    assert result.returncode in (0, 1), result
    return specaudit.read_report(out)


def test_a_sampled_run_reads_back_typed(sampled) -> None:
    (run,) = _typed(sampled)
    assert run.mode == "sampled" and not run.greedy and isinstance(run.sampled, FrozenDict)
    assert run.verdict == run.sampled["verdict"] and run.passed == (run.verdict == PASS)
    assert run.exact_matches == 0 and run.divergences == ()  # the greedy fields: not written for it
    assert not set(GREEDY_FIELDS) & set(run_to_json(run))
    _same_order(sampled, run.engine)


def _toy_recording(path: Path, prompts: list[list[int]], max_new: int
                   ) -> tuple[list[list[int]], list[list[dict[str, float]]]]:
    """The toy model's greedy outputs on `prompts`, with their top-3 log-probabilities (per prompt and new
    token), as a recording."""
    lm, lines, outputs, every_top = ToyLM(), [], [], []
    for prompt in prompts:
        tokens: list[int] = []
        tops: list[dict[str, float]] = []
        for _ in range(max_new):
            lps = lm.logprobs(prompt + tokens)
            order = sorted(range(len(lps)), key=lambda t: -lps[t])
            tops.append({str(t): lps[t] for t in order[:3]})
            tokens.append(order[0])
            if tokens[-1] == TOY_EOS:
                break
        outputs.append(tokens)
        every_top.append(tops)
        lines.append(json.dumps({"prompt_ids": prompt, "output_ids": tokens, "top_logprobs": tops}))
    path.write_text("\n".join(lines) + "\n")
    return outputs, every_top


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> specaudit.AuditReport:
    """Against a served reference (`--reference`, here a recording of the toy model): the engine's output
    takes the reference's third token at prompt 1's new token 2."""
    folder = tmp_path_factory.mktemp("served")
    rng = random.Random(5)
    prompts = [[rng.randrange(0, 250) for _ in range(5)] for _ in range(3)]
    outputs, tops = _toy_recording(folder / "reference.jsonl", prompts, 6)
    altered = [list(o) for o in outputs]
    assert len(outputs[1]) > 2, "the premise: prompt 1's reference output reaches new token 2"
    at = tops[1][2]
    altered[1] = altered[1][:2] + [int(sorted(at, key=lambda t: -at[t])[2])]
    (folder / "engine.jsonl").write_text("".join(json.dumps({"prompt_ids": p, "output_ids": o}) + "\n"
                                                 for p, o in zip(prompts, altered)))
    result = cli_audit("--engine", f"recorded:{folder / 'engine.jsonl'}", "--reference",
                       f"recorded:{folder / 'reference.jsonl'}", "--eos-token-id", str(TOY_EOS),
                       "--max-new-tokens", "6", out=folder / "out")
    assert result.returncode == 1, result
    return specaudit.read_report(folder / "out")


def test_a_served_run_reads_back_typed(served) -> None:
    (run,) = _typed(served)
    assert run.dtype == "served" and isinstance(run.noise_band, FrozenDict) and isinstance(run.outputs, tuple)
    assert run.structural and all(isinstance(d.diagnosis.needs_weights, bool) for d in run.structural)
    assert audit_to_json(audit_from_json(served.data)) == served.data  # the top level's served keys too
    assert isinstance(audit_from_json(served.data).reference, FrozenDict)


def test_committed_server_runs_read_back_typed() -> None:
    """Live servers (vLLM on CPU) audited against the in-process reference, as committed."""
    for folder in ("vllm-cpu/float32", "vllm-cpu/gdn-bf16-ngram", "acceptance-served/payoff"):
        report = specaudit.read_report(ROOT / "reports" / folder)
        records = _typed(report)
        assert records and all(isinstance(run.noise_band, FrozenDict) for run in records), folder
        assert any(run.engine.startswith("vllm:") for run in records), folder


# ---- (c) frozen, (d) unknown keys kept --------------------------------------------------------------------

def test_records_are_frozen_all_the_way_down(in_process) -> None:
    run = in_process.records[1]
    divergence = run.structural[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.equivalent = True  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        divergence.kind = "numerical"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        divergence.diagnosis.cls = "other"  # type: ignore[union-attr,misc]
    with pytest.raises(TypeError, match="read-only"):
        divergence.evidence["reason"] = "changed"  # type: ignore[index]
    with pytest.raises(TypeError, match="read-only"):
        run.timing.update(engine=0.0)  # type: ignore[union-attr]
    assert isinstance(run.prompts, tuple) and isinstance(run.prompts[0], FrozenDict)
    # built in code from lists and dicts: frozen all the same
    built = Divergence(prompt_index=0, position=1, reference_token=2, engine_token=3, kind="structural",
                       detected_by="tokens", evidence={"reason": "x", "seen": [1, 2]}, accepted_history=[1])
    assert built.accepted_history == (1,) and built.evidence["seen"] == (1, 2)
    with pytest.raises(TypeError, match="read-only"):
        built.evidence["reason"] = "y"  # type: ignore[index]
    changed = dataclasses.replace(run, equivalent=True)  # a changed copy, the original untouched
    assert changed.equivalent and not run.equivalent
    assert pickle.loads(pickle.dumps(run)) == run and hash(copy.deepcopy(run)) == hash(run)
    with pytest.raises(ValueError, match="run mode 'beam'"):
        dataclasses.replace(run, mode="beam")


def test_a_key_no_field_names_is_kept_in_extra_and_written_back(in_process) -> None:
    data = copy.deepcopy(in_process.runs[1])
    data["engine_counters"] = {"drafted": [1, 2]}  # an engine's own key, or a later version's
    data["divergences"][0]["why_now"] = "a later version's key"
    data["divergences"][0]["diagnosis"]["confidence"] = 0.5
    data["divergences"][0]["bundle"] = "bundles/x.json"
    run = run_from_json(data)
    assert run.extra == {"engine_counters": {"drafted": (1, 2)}}
    assert run.divergences[0].extra == {"why_now": "a later version's key"}
    assert run.divergences[0].diagnosis.extra == {"confidence": 0.5}
    assert run_to_json(run) == data and list(run_to_json(run))[-1] == "engine_counters"
    with pytest.raises(ValueError, match="extra has 'engine'"):
        run_to_json(dataclasses.replace(run, extra={"engine": "other"}))


def test_a_missing_required_key_is_one_line_naming_it() -> None:
    with pytest.raises(ValueError, match=r"run eqspec has no 'equivalent'") as info:
        run_from_json({"engine": "eqspec", "mode": "greedy", "pair": "p", "batch_size": 1, "dtype": "float64",
                       "device": "cpu", "num_prompts": 1, "seconds": 0.1, "error": None})
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="is list, not an object"):
        run_from_json([])  # type: ignore[arg-type]


def test_the_greedy_fields_default_as_run_record_does() -> None:
    """A greedy run that compared nothing: the record's defaults are run_record.GREEDY_DEFAULTS."""
    defaults = {f.name: f.default for f in dataclasses.fields(Run) if f.name in GREEDY_FIELDS}
    assert {k: list(v) if isinstance(v, tuple) else v for k, v in defaults.items()} == {
        k: v for k, v in run_record.GREEDY_DEFAULTS.items() if k in GREEDY_FIELDS}
    assert set(run_record.GREEDY_DEFAULTS) == set(GREEDY_FIELDS) | {"equivalent", "seconds"}
    failed = run_record.failed_run({"engine": "e", "pair": "p", "batch_size": 1, "dtype": "float64",
                                    "device": "cpu", "num_prompts": 1}, "it broke", RuntimeError("x"))
    assert run_to_json(run_from_json(failed)) == failed and run_from_json(failed).failed is True

