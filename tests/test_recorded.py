"""Recordings as engines: `specaudit audit --engine recorded:FILE`, `specaudit diff`, repro
bundles and `specaudit replay`, end to end on tiny-llama in float64.

A correct recording is made here with the reference decoder; a buggy one changes one token; a
misattached one swaps two prompts' outputs.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from specaudit.engines.models import zoo
from specaudit.engines.adapters.recorded import RecordedEngine, RecordingError, read_recording, write_recording
from specaudit.engines.reference import ReferenceDecoder
from specaudit.cli import main

MAX_NEW = 48
NUM_PROMPTS = 4


def cli(*argv: str) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else 2
    return code, stdout.getvalue(), stderr.getvalue()


@pytest.fixture(scope="module")
def recordings(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("recordings")
    pair = zoo.load_pair("tiny-llama")
    prompts = zoo.builtin_prompts()[:NUM_PROMPTS]
    outputs = ReferenceDecoder(pair.target).generate(prompts, MAX_NEW, pair.eos_token_id)
    assert all(len(o) > 12 for o in outputs)
    buggy = [list(o) for o in outputs]
    buggy[1][12] = (buggy[1][12] + 1) % 256  # a token the reference did not choose
    swapped = [outputs[1], outputs[0]] + outputs[2:]
    return {
        "good": write_recording(folder / "good.jsonl", prompts, outputs, metadata={"server": "reference"}),
        "bug": write_recording(folder / "bug.jsonl", prompts, buggy),
        "swapped": write_recording(folder / "swapped.jsonl", prompts, swapped),
    }


def audit(recording: Path, out: Path, *extra: str) -> tuple[int, dict]:
    code, stdout, stderr = cli("audit", "--engine", f"recorded:{recording}", "--pair", "tiny-llama",
                               "--dtype", "float64", "--max-new-tokens", str(MAX_NEW), "--out", str(out),
                               "--no-progress", *extra)
    assert (out / "audit.json").is_file(), stderr
    return code, json.loads((out / "audit.json").read_text())


def test_correct_recording_is_equivalent(recordings, tmp_path):
    code, report = audit(recordings["good"], tmp_path)
    assert code == 0
    (run,) = report["runs"]
    assert run["num_prompts"] == NUM_PROMPTS  # the file's prompts, not the built-in set
    assert run["exact_matches"] == NUM_PROMPTS and run["divergences"] == []
    assert run["engine_description"]["kind"] == "recorded"
    assert run["noise_band"]["source"] == "audit-dtype"


def test_recording_with_a_bug_is_structural_with_a_bundle_that_replays(recordings, tmp_path):
    code, report = audit(recordings["bug"], tmp_path)
    assert code == 1
    (run,) = report["runs"]
    (divergence,) = run["divergences"]
    assert (divergence["prompt_index"], divergence["position"], divergence["kind"]) == (1, 12, "structural")
    bundle_path = tmp_path / divergence["bundle"]
    bundle = json.loads(bundle_path.read_text())
    good = read_recording(recordings["good"])[1]
    assert bundle["prompt_ids"] == good.prompt_ids and bundle["reference_output"] == good.output_ids
    assert bundle["engine_output"][12] != good.output_ids[12]
    assert bundle["divergence"]["kind"] == "structural" and bundle["settings"]["max_new_tokens"] == MAX_NEW

    code, stdout, _ = cli("replay", str(bundle_path), "--pair", "tiny-llama")
    assert code == 1, stdout  # still reproduces, still structural
    bundle["engine_output"] = good.output_ids  # as if the engine were fixed
    fixed = tmp_path / "fixed.json"
    fixed.write_text(json.dumps(bundle))
    code, stdout, _ = cli("replay", str(fixed), "--pair", "tiny-llama")
    assert code == 0, stdout


def test_outputs_attached_to_the_wrong_prompts_are_structural(recordings, tmp_path):
    code, report = audit(recordings["swapped"], tmp_path)
    assert code == 1
    (run,) = report["runs"]
    assert {d["prompt_index"] for d in run["divergences"]} == {0, 1}
    assert all(d["kind"] == "structural" for d in run["divergences"])


def test_recording_made_with_other_settings_is_refused(recordings, tmp_path):
    lines = read_recording(recordings["good"])
    path = write_recording(tmp_path / "other.jsonl", [l.prompt_ids for l in lines], [l.output_ids for l in lines],
                           metadata={"max_new_tokens": 16})
    engine = RecordedEngine(str(path))
    with pytest.raises(RecordingError, match="--max-new-tokens 16"):
        engine.generate(engine.recorded_prompts, MAX_NEW, 258)
    with pytest.raises(RecordingError, match="not in the recording"):
        RecordedEngine(str(recordings["good"])).generate([[1, 2, 3]], MAX_NEW, 258)


def test_a_recordings_eos_ids_are_compared_as_a_set(recordings, tmp_path):
    lines = read_recording(recordings["good"])
    path = write_recording(tmp_path / "two.jsonl", [l.prompt_ids for l in lines], [l.output_ids for l in lines],
                           metadata={"eos_token_id": [258, 157]})
    engine = RecordedEngine(str(path))
    assert engine.generate(engine.recorded_prompts, MAX_NEW, (157, 258)) == [l.output_ids for l in lines]
    assert engine.generate(engine.recorded_prompts, MAX_NEW, [258, 157]) == [l.output_ids for l in lines]
    with pytest.raises(RecordingError, match=r"recorded with eos_token_id=\[258,157\].*audited with 258: "
                                             r"pass --eos-token-id 258,157"):
        engine.generate(engine.recorded_prompts, MAX_NEW, 258)
    with pytest.raises(RecordingError, match="audited with none"):
        engine.generate(engine.recorded_prompts, MAX_NEW, None)


def test_a_recording_brings_its_own_prompts_past_the_builtin_preflight(recordings, tmp_path):
    # a target of 512 positions: built-in prompt 16 (915 tokens) would not fit, but a recording's
    # audit never decodes the built-in prompts, so their preflight must not stop it
    target = zoo.load_pair("tiny-llama").target
    target.config.max_position_embeddings = 512
    target.save_pretrained(tmp_path / "target", safe_serialization=True)
    code, stdout, stderr = cli("audit", "--engine", f"recorded:{recordings['good']}", "--target",
                               str(tmp_path / "target"), "--max-new-tokens", str(MAX_NEW), "--eos-token-id", "258",
                               "--out", str(tmp_path / "out"), "--no-progress")
    assert code == 0, stderr
    (run,) = json.loads((tmp_path / "out" / "audit.json").read_text())["runs"]
    assert run["num_prompts"] == NUM_PROMPTS and run["exact_matches"] == NUM_PROMPTS
    # the prompts a recording brings are still checked against the model's positions
    code, _, stderr = cli("audit", "--engine", f"recorded:{recordings['good']}", "--target",
                          str(tmp_path / "target"), "--max-new-tokens", "600", "--eos-token-id", "258",
                          "--out", str(tmp_path / "long"), "--no-progress")
    assert code == 2 and "512 positions" in stderr and "good.jsonl, prompt 1" in stderr


@pytest.mark.parametrize("content, fragment", [
    ('{"prompt_ids": [1], "output_ids": [3], "eos_token_id": "eos"}', "eos_token_id must be null, a token id"),
    ('{"prompt_ids": [1], "output_ids": [3], "eos_token_id": [258, -1]}', ":1: eos_token_id"),
    ('{"prompt_ids": [1, 2]}', ":1:"),
    ('{"prompt_ids": [], "output_ids": [3]}', "empty"),
    ('{"prompt_ids": [1], "output_ids": [3, 4], "logprobs": [-0.1]}', "one entry per output token"),
    ("not json", ":1:"),
])
def test_malformed_recordings_name_the_line(tmp_path, content, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text(content + "\n")
    with pytest.raises(RecordingError, match=fragment):
        read_recording(path)


def test_logprob_forms_are_read_per_token(tmp_path):
    path = tmp_path / "lp.jsonl"
    path.write_text(json.dumps({"prompt_ids": [1], "output_ids": [5, 6, 7], "logprobs": [-0.1, -0.2, -0.3],
                                "top_logprobs": [{"5": -0.1, "9": -2.0}, [[6, -0.2], [8, -1.0]],
                                                 [{"id": 7, "logprob": -0.3}, {"id": 4, "logprob": -3.0}]],
                                "note": "free metadata"}) + "\n")
    (line,) = read_recording(path)
    assert line.logprobs == [{5: -0.1, 9: -2.0}, {6: -0.2, 8: -1.0}, {7: -0.3, 4: -3.0}]
    assert line.metadata == {"note": "free metadata"}


def test_diff_exit_codes_and_rulings(recordings, tmp_path):
    code, stdout, _ = cli("diff", str(recordings["good"]), str(recordings["good"]))
    assert code == 0 and f"{NUM_PROMPTS} identical" in stdout
    code, stdout, _ = cli("diff", str(recordings["good"]), str(recordings["bug"]))
    assert code == 1 and "position 12" in stdout
    out = tmp_path / "diff.json"
    code, stdout, _ = cli("diff", str(recordings["good"]), str(recordings["bug"]), "--pair", "tiny-llama",
                          "--out", str(out))
    assert code == 1
    (difference,) = json.loads(out.read_text())["differences"]
    assert difference["rulings"]["A"]["kind"] is None  # the correct recording agrees with the reference
    assert difference["rulings"]["B"]["kind"] == "structural" and difference["rulings"]["B"]["position"] == 12
    code, _, stderr = cli("diff", str(recordings["good"]), str(tmp_path / "missing.jsonl"))
    assert code == 2 and "missing.jsonl" in stderr
    fewer = tmp_path / "fewer.jsonl"
    fewer.write_text("".join(recordings["good"].read_text().splitlines(keepends=True)[:2]))
    code, stdout, _ = cli("diff", str(recordings["good"]), str(fewer))
    assert code == 1 and "missing from B" in stdout  # equal where both have the prompt, but not the same prompts


def test_target_alone_is_refused_for_engines_that_draft(tmp_path):
    code, _, stderr = cli("audit", "--engine", "eqspec", "--target", str(tmp_path), "--out", str(tmp_path / "o"),
                          "--no-progress")
    assert code == 2 and "--draft" in stderr


def test_target_alone_is_enough_for_a_recording(recordings, tmp_path):
    target_dir = tmp_path / "target"
    zoo.load_pair("tiny-llama").target.save_pretrained(target_dir, safe_serialization=True)
    code, stdout, stderr = cli("audit", "--engine", f"recorded:{recordings['bug']}", "--target", str(target_dir),
                               "--dtype", "float64", "--max-new-tokens", str(MAX_NEW), "--eos-token-id", "258",
                               "--out", str(tmp_path / "out"), "--no-progress")
    report = json.loads((tmp_path / "out" / "audit.json").read_text())
    (run,) = report["runs"]
    assert code == 1, (run.get("error"), stderr)
    assert run["pair"] == "target" and [d["prompt_index"] for d in run["divergences"]] == [1]


def test_bundles_of_a_built_in_engine_replay(tmp_path):
    from specaudit.engines.registry import make_engine
    from specaudit.equivalence.audit import RunSettings, audit_engine
    from specaudit.equivalence.blackbox.bundles import read_bundle, replay_bundle

    pair = zoo.load_pair("tiny-llama")
    prompts = zoo.builtin_prompts()[:2]
    engine = make_engine("bsp", pair.target, pair.draft, batch_size=2, draft_tokens=4, record_logits=True)
    run = audit_engine(engine, pair, prompts, RunSettings(max_new_tokens=6, eos_token_id=pair.eos_token_id, dtype="float64", engine_name="bsp", batch_size=2),
                       bundle_dir=tmp_path / "bundles")
    assert run["structural_divergences"] > 0 and run["noise_band"] is None
    for divergence in run["divergences"]:
        bundle = read_bundle(tmp_path / divergence["bundle"])
        result = replay_bundle(bundle, pair.target)
        assert result["exit_status"] == 1 and result["reference_matches_bundle"], result["message"]
        if divergence["detected_by"] == "tokens":
            assert result["kind"] == "structural" and result["position"] == divergence["position"]
