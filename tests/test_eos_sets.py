"""Targets whose generation config declares several EOS ids (Llama 3, Qwen and Gemma ship such lists).

The pair is `zoo.two_eos_pair()`: tiny-llama declaring `<eos>` (258) and byte 157, which its target emits
early on some built-in prompts. Stopping at any id of the set is correct; running past any of them is a
structural divergence named `stop_eos`. In-process, the engines are EQSPEC wrapped (tests/eos_engines.py);
end to end, recordings of the reference audited against a target folder that declares both ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_run import audit, runs
from eos_engines import IgnoresLaterEos, StopsAtEosSet
from specaudit.engines.adapters.recorded import write_recording
from specaudit.engines.models import zoo
from specaudit.engines.reference import ReferenceDecoder
from specaudit.engines.registry import make_engine
from specaudit.equivalence.audit import Reference, RunSettings, audit_engine

# built-in prompts whose reference, in 12 new tokens, ends at 157 (0: after 6 tokens, 6: at once), ends at
# 258 (5) and runs to the budget (2)
PROMPT_INDICES = (0, 2, 5, 6)
MAX_NEW = 12
FIRST_EOS, SECOND_EOS = zoo.TWO_EOS_IDS


@pytest.fixture(scope="module")
def pair() -> zoo.ModelPair:
    return zoo.two_eos_pair()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    every = zoo.builtin_prompts()
    return [every[i] for i in PROMPT_INDICES]


@pytest.fixture(scope="module")
def reference(pair, prompts) -> Reference:
    return Reference(pair, prompts, MAX_NEW, pair.eos_token_id)


def test_the_pair_declares_both_ids_and_the_reference_stops_at_each(pair, reference) -> None:
    assert pair.eos_token_id == (FIRST_EOS, SECOND_EOS) and pair.eos_ids == (FIRST_EOS, SECOND_EOS)
    assert pair.target.generation_config.eos_token_id == [FIRST_EOS, SECOND_EOS]
    lengths_and_ends = [(len(o), o[-1]) for o in reference.outputs]
    assert lengths_and_ends[0] == (6, SECOND_EOS) and lengths_and_ends[3] == (1, SECOND_EOS)
    assert lengths_and_ends[2][1] == FIRST_EOS and lengths_and_ends[2][0] < MAX_NEW
    assert lengths_and_ends[1][0] == MAX_NEW and lengths_and_ends[1][1] not in pair.eos_ids


def test_a_target_folder_keeps_every_eos_id_its_generation_config_lists(pair, tmp_path: Path) -> None:
    pair.target.save_pretrained(tmp_path / "target", safe_serialization=True)
    pair.draft.save_pretrained(tmp_path / "draft", safe_serialization=True)
    saved = json.loads((tmp_path / "target" / "generation_config.json").read_text())
    assert saved["eos_token_id"] == [FIRST_EOS, SECOND_EOS]
    loaded = zoo.load_pair(target_path=str(tmp_path / "target"), draft_path=str(tmp_path / "draft"))
    assert loaded.eos_token_id == (FIRST_EOS, SECOND_EOS)
    assert loaded.pad_token_id == zoo.ByteTokenizer.pad_token_id  # the config's pad id, not an EOS id
    one = zoo.load_pair("tiny-llama")
    assert one.eos_token_id == FIRST_EOS and one.eos_ids == (FIRST_EOS,)  # a single id stays an int


def _eqspec(pair: zoo.ModelPair):
    return make_engine("eqspec", pair.target, pair.draft, batch_size=4, draft_tokens=3, record_logits=True)


def test_an_engine_that_stops_at_every_eos_id_is_exact(pair, prompts, reference) -> None:
    # the measured regression: a correct engine on a two-EOS target had rows ruled structural stop_length
    run = audit_engine(StopsAtEosSet(_eqspec(pair)), pair, prompts, RunSettings(max_new_tokens=MAX_NEW, eos_token_id=pair.eos_token_id, dtype="float64", batch_size=4),
                       reference=reference)
    assert run["divergences"] == [] and run["exact_matches"] == len(prompts) and run["equivalent"]


def test_an_engine_that_runs_past_the_second_eos_is_caught_as_stop_eos(pair, prompts, reference) -> None:
    run = audit_engine(IgnoresLaterEos(_eqspec(pair)), pair, prompts, RunSettings(max_new_tokens=MAX_NEW, eos_token_id=pair.eos_token_id, dtype="float64", batch_size=4),
                       reference=reference)
    assert not run["equivalent"]
    # the rows whose reference ends at 157, at the position after it; the row ending at 258 stays exact
    assert [(d["prompt_index"], d["position"], d["kind"]) for d in run["divergences"]] == [
        (0, 6, "structural"), (3, 1, "structural")]
    for divergence in run["divergences"]:
        assert divergence["diagnosis"]["class"] == "stop_eos", divergence["diagnosis"]
        assert f"EOS {SECOND_EOS}" in divergence["diagnosis"]["evidence"]


@pytest.fixture(scope="module")
def folders(pair, prompts, tmp_path_factory) -> dict[str, Path]:
    """The two-EOS target as a folder (its generation config lists both ids), and recordings of a
    correct server (stops at either id) and of one that ran past 157, neither saying its EOS."""
    folder = tmp_path_factory.mktemp("eos2")
    pair.target.save_pretrained(folder / "target", safe_serialization=True)
    decoder = ReferenceDecoder(pair.target)
    correct = decoder.generate(prompts, MAX_NEW, list(pair.eos_ids))
    past = decoder.generate(prompts, MAX_NEW, FIRST_EOS)
    assert correct != past
    return {"target": folder / "target",
            "correct": write_recording(folder / "correct.jsonl", prompts, correct, metadata={"engine": "server"}),
            "past": write_recording(folder / "past.jsonl", prompts, past, metadata={"engine": "server"}),
            "declared": write_recording(folder / "declared.jsonl", prompts, correct,
                                        metadata={"eos_token_id": [SECOND_EOS, FIRST_EOS]})}


def test_a_correct_recording_on_a_two_eos_target_has_no_false_alarm(folders, tmp_path: Path) -> None:
    result = audit("--engine", f"recorded:{folders['correct']}", "--target", str(folders["target"]),
                   "--max-new-tokens", str(MAX_NEW), out=tmp_path)
    (run,) = runs(tmp_path)
    assert result.returncode == 0, (result.stderr, run.get("error"), run["divergences"][:1])
    assert run["divergences"] == [] and run["eos_token_ids"] == [FIRST_EOS, SECOND_EOS]


def test_a_recording_that_ran_past_the_second_eos_is_caught(folders, tmp_path: Path) -> None:
    result = audit("--engine", f"recorded:{folders['past']}", "--target", str(folders["target"]),
                   "--max-new-tokens", str(MAX_NEW), out=tmp_path)
    (run,) = runs(tmp_path)
    assert result.returncode == 1 and run["structural_divergences"] == 2, run.get("error")
    assert {d["diagnosis"]["class"] for d in run["divergences"]} == {"stop_eos"}


def test_eos_ids_on_the_command_line_match_a_recording_as_a_set(folders, tmp_path: Path) -> None:
    # the recording says [157, 258]; the audit is told 258,157 on tiny-llama, which declares only 258
    result = audit("--engine", f"recorded:{folders['declared']}", "--pair", "tiny-llama", "--eos-token-id",
                   f"{FIRST_EOS},{SECOND_EOS}", "--max-new-tokens", str(MAX_NEW), out=tmp_path / "set")
    report = json.loads((tmp_path / "set" / "audit.json").read_text())
    assert result.returncode == 0, (result.stderr, report["runs"][0].get("error"))
    assert report["config"]["eos_token_id"] == [FIRST_EOS, SECOND_EOS]
    one = audit("--engine", f"recorded:{folders['declared']}", "--pair", "tiny-llama", "--eos-token-id",
                str(FIRST_EOS), "--max-new-tokens", str(MAX_NEW), out=tmp_path / "one")
    (run,) = runs(tmp_path / "one")
    assert one.returncode == 1 and f"recorded with eos_token_id=[{SECOND_EOS},{FIRST_EOS}]" in run["error"]
    assert f"pass --eos-token-id {SECOND_EOS},{FIRST_EOS}" in run["error"]


@pytest.mark.parametrize("name, batch_size", [("hf-batched", 4), ("hf-assisted", 1), ("hf-continuous", 4)])
def test_the_hugging_face_adapters_stop_at_every_eos_id(pair, prompts, reference, name: str, batch_size: int) -> None:
    engine = make_engine(name, pair.target, pair.draft, batch_size=batch_size, draft_tokens=3,
                         pad_token_id=pair.pad_token_id)
    assert engine.generate(prompts, MAX_NEW, pair.eos_token_id) == reference.outputs


def test_the_python_api_takes_an_eos_set(folders) -> None:
    import specaudit

    report = specaudit.audit(f"recorded:{folders['past']}", target=str(folders["target"]), max_new_tokens=MAX_NEW,
                             eos_token_id=(FIRST_EOS, SECOND_EOS))
    assert report.data["config"]["eos_token_id"] == [FIRST_EOS, SECOND_EOS]
    assert report.exit_status == 1 and {d["diagnosis"]["class"] for d in report.divergences} == {"stop_eos"}


def test_the_reports_name_the_eos_set(folders, tmp_path: Path) -> None:
    audit("--engine", f"recorded:{folders['correct']}", "--target", str(folders["target"]),
          "--max-new-tokens", str(MAX_NEW), out=tmp_path / "pair")
    assert f"the pair's own ({FIRST_EOS}, {SECOND_EOS})" in (tmp_path / "pair" / "report.md").read_text()
    audit("--engine", f"recorded:{folders['declared']}", "--pair", "tiny-llama", "--eos-token-id",
          f"{FIRST_EOS},{SECOND_EOS}", "--max-new-tokens", str(MAX_NEW), out=tmp_path / "given")
    assert f"{FIRST_EOS}, {SECOND_EOS}" in (tmp_path / "given" / "report.html").read_text()
