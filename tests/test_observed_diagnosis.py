"""The diagnosis by observation (`equivalence/diagnosis/observe.py`) on engines written for it
(`tests/observed_engines.py`): a left-padded loop numbering the padded width, a speculative engine leaving
rejected slots as masked holes and numbering every column, an uncached loop whose mask shows the padding,
`model.generate` on left-padded chunks with an all-ones mask. On learned positions (tiny-gpt2), positions
from the mask (tiny-opt) and rotary positions (tiny-qwen3, where a constant offset per row changes no token,
so only the holes engine's positions show), at least 90% of each buggy engine's structural divergences are
named by their cause, none `cross_row`, the observation decides and says what it saw; the correct twins are
exact. A class the observation contradicts becomes `unknown`. A cache not cropped at a rejection and a mask
that hides the pad id in content are named `kv_cache` and `pad_as_content`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cli_run import audit, runs
from specaudit.equivalence.diagnosis.causes import Cause
from specaudit.equivalence.diagnosis.core import PROVENANCE, Diagnoser
from specaudit.equivalence.diagnosis.facts import RunFacts
from specaudit.equivalence.diagnosis.observe import DRAFT_CHOICE
from specaudit.equivalence.diagnosis.provenance import (CHOSE_RIGHT, MISSING_ENTRY, CallRecord, ProvenanceLog,
                                                        Reading, RowFeed)

EXPECTED = {"loop_padded_positions": "position_ids", "holes_all_slots": "position_ids",
            "recompute_sees_padding": "attention_mask", "generate_all_ones": "attention_mask",
            "loop": None, "holes": None, "recompute": None, "generate": None}
# rotary positions: a whole row numbered from its padding is a constant offset, which changes no attention score
SHOWS = {"tiny-gpt2": set(EXPECTED), "tiny-opt": set(EXPECTED),
         "tiny-qwen3": set(EXPECTED) - {"loop_padded_positions", "loop"}}
SETTINGS = ("--batch-size", "4", "--num-prompts", "8", "--max-new-tokens", "12", "--no-adversarial")


@pytest.mark.parametrize("pair", sorted(SHOWS))
def test_observed_bugs_are_named_by_their_cause(pair: str, tmp_path: Path) -> None:
    engines = sorted(SHOWS[pair])
    args = [arg for engine in engines for arg in ("--engine", f"observed_engines:{engine}")]
    result = audit(*args, "--pair", pair, *SETTINGS, out=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    wrong = []
    for run in runs(tmp_path):
        variant = run["engine"].split(":")[1]
        expected = EXPECTED[variant]
        structural = [d for d in run["divergences"] if d["kind"] == "structural"]
        if expected is None:
            assert run["equivalent"] and not run["divergences"] and not run["failures"], variant
            continue
        assert structural, f"{variant}: no structural divergence"
        named = [d for d in structural if d["diagnosis"]["class"] == expected]
        if len(named) < 0.9 * len(structural) or any(d["diagnosis"]["class"] == "cross_row" for d in structural):
            wrong.append(f"{variant}: " + "; ".join(f"prompt {d['prompt_index']}: {d['diagnosis']['class']}"
                                                   for d in structural))
        observed = [d for d in named if seen(d)]
        assert observed, f"{variant}: the observation decided none"
        evidence = observed[0]["diagnosis"]["evidence"]  # what each query read, by its writers
        fact = "wrong position" if expected == "position_ids" else "padding visible"
        assert " fed at position " in evidence and f"was expected there: {fact}" in evidence, evidence
        assert run["timing"]["observation"] > 0, run["timing"]
    assert not wrong, "\n".join(wrong)



def seen(divergence: dict) -> bool:
    """Named by what the run's own call was seen to read: the provenance of each column read."""
    return divergence["diagnosis"].get("named_by") == PROVENANCE


@pytest.mark.precision  # the engine's tokens round in bfloat16: run under the CPU's other kernels too
def test_the_observation_reads_a_cache_below_float64(tmp_path: Path) -> None:
    """In bfloat16 (numpy has no such dtype) the cache's keys that follow each slot are read as raw bytes: the
    observation is made, and decides the engine's position bug as in float64."""
    result = audit("--engine", "observed_engines:holes_all_slots", "--pair", "tiny-gpt2", *SETTINGS, "--dtype",
                   "bfloat16", out=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    (run,) = runs(tmp_path)
    structural = [d for d in run["divergences"] if d["kind"] == "structural"]
    assert structural
    tried = [line for d in structural for line in d["diagnosis"]["tried"]]
    assert not [line for line in tried if "the observation failed" in line], tried
    named = [d for d in structural if d["diagnosis"]["class"] == "position_ids"]
    assert len(named) >= 0.9 * len(structural), [d["diagnosis"]["class"] for d in structural]
    assert any(seen(d) for d in named)


SLIDING = {"holes": "the window counts columns", "recompute": "the window is not applied",
           "recompute_sees_padding": "padding column(s)", "loop": None, "generate": None}


def test_sliding_window_targets_are_observed(tmp_path: Path) -> None:
    """tiny-gemma3 (sliding-window layers beside a full one), engines that are exact on full-attention models but
    not here, each `attention_mask` as seen in the sliding layer's mask: rejected proposals left as masked holes
    (right positions), where the model's window counts columns, so holes take the place of the row's tokens; an
    uncached loop handing its own 4-D mask, which the sliding layers receive unchanged (no window). The loop
    that shows its padding is `attention_mask` too; the 2-D-mask loop and `model.generate` are exact."""
    args = [arg for engine in SLIDING for arg in ("--engine", f"observed_engines:{engine}")]
    result = audit(*args, "--pair", "tiny-gemma3", *SETTINGS, out=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    for run in runs(tmp_path):
        fact = SLIDING[run["engine"].split(":")[1]]
        structural = [d for d in run["divergences"] if d["kind"] == "structural"]
        if fact is None:
            assert run["equivalent"] and not run["divergences"] and not run["failures"], run["engine"]
            continue
        classes = [d["diagnosis"]["class"] for d in structural]
        assert structural and classes.count("attention_mask") >= 0.9 * len(structural), (run["engine"], classes)
        observed = [d["diagnosis"]["evidence"] for d in structural if seen(d)]
        facts = (fact, "padding visible") if fact == "padding column(s)" else (fact,)
        assert observed and any(f in e for e in observed for f in facts), (run["engine"], observed[:1])

CACHE_AND_PAD = {"rows_not_cropped": "kv_cache", "pad_id_masked": "pad_as_content", "padding_shown_late": "attention_mask",
                 "rows": None, "loop": None}


def test_a_cache_not_cropped_and_a_pad_id_masked_are_named(tmp_path: Path) -> None:
    """A speculative engine with one cache per row that never crops the target's at a rejection (later queries
    read the rejected proposals) is `kv_cache`, seen in the observation, or `unknown`; a loop whose mask hides
    every pad id, the prompts' own among them (the adversarial prompts hold some), is `pad_as_content`; a loop
    that shows its padding from the third new token on is `attention_mask`, confirmed by a replay that computes
    the padding as the engine's attention did (reading nothing: its mask row was empty); their twins exact."""
    args = [arg for engine in CACHE_AND_PAD for arg in ("--engine", f"observed_engines:{engine}")]
    result = audit(*args, "--pair", "tiny-gpt2", "--batch-size", "4", "--num-prompts", "8", "--max-new-tokens", "12",
                   out=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    for run in runs(tmp_path):
        expected = CACHE_AND_PAD[run["engine"].split(":")[1]]
        structural = [d for d in run["divergences"] if d["kind"] == "structural"]
        if expected is None:
            assert run["equivalent"] and not run["divergences"] and not run["failures"], run["engine"]
            continue
        classes = [d["diagnosis"]["class"] for d in structural]
        # a token equal to the one before it, in a speculating engine that records no logits, is left `unknown`
        # (a doubled token looks alike): never another class
        assert structural and classes.count(expected) >= 0.8 * len(structural), (run["engine"], classes)
        assert set(classes) <= {expected, "unknown"}, (run["engine"], classes)
        if expected == "kv_cache":
            observed = [d["diagnosis"]["evidence"] for d in structural if d["diagnosis"]["class"] == expected
                        and seen(d)]
            assert observed and any(f in observed[0] for f in ("cached column(s) not in the row's sequence",
                                                              "extra entry")), observed[:1]
        if expected == "attention_mask":  # the padding seen read (or computed reading nothing, replayed so)
            confirmed = [d for d in structural if "padding visible" in d["diagnosis"]["evidence"]]
            assert len(confirmed) >= 0.9 * len(structural), [d["diagnosis"]["evidence"][:200] for d in structural]



def test_a_cache_not_cropped_is_named_on_nine_of_ten_at_the_measured_size(tmp_path: Path) -> None:
    """The per-row engine that never crops its target cache, at the size its rate was measured at (16 prompts,
    adversarial ones among them: duplicates decoded row by row, a draft proposing the pad id): at least 90% of
    its structural divergences `kv_cache`, the rest `unknown` (a repeated token whose pass read stale columns:
    a token emitted twice looks alike), never another class."""
    result = audit("--engine", "observed_engines:rows_not_cropped", "--pair", "tiny-gpt2", "--batch-size", "4",
                   "--num-prompts", "16", "--max-new-tokens", "24", out=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    (run,) = runs(tmp_path)
    classes = [d["diagnosis"]["class"] for d in run["divergences"] if d["kind"] == "structural"]
    assert classes and classes.count("kv_cache") >= 0.9 * len(classes), classes
    assert set(classes) <= {"kv_cache", "unknown"}, classes

def test_quick_diagnosis_observes_the_run_itself_and_reruns_nothing(tmp_path: Path) -> None:
    """The observation is of the audited call itself: a quick diagnosis (no re-run of the engine) still reads
    what the engine fed the target, and names the position bug by it."""
    result = audit("--engine", "observed_engines:loop_padded_positions", "--pair", "tiny-gpt2", *SETTINGS,
                   "--diagnosis", "quick", out=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    (run,) = runs(tmp_path)
    assert run["timing"]["reruns"] == 0.0
    classes = [d["diagnosis"]["class"] for d in run["divergences"] if d["kind"] == "structural"]
    assert classes and set(classes) == {"position_ids"}, classes
    named = [d["diagnosis"]["named_by"] for d in run["divergences"] if d["kind"] == "structural"]
    assert all(by in ("a reproducing replay", PROVENANCE) for by in named), named


def _log(speculated: bool) -> ProvenanceLog:
    """One target call of one row: a prefill (one token onto an empty cache), or a verification (two tokens onto
    a cache that held one)."""
    tokens, columns = ((4, 5), (1, 2)) if speculated else ((4,), (0,))
    width = columns[-1] + 1
    log = ProvenanceLog(pad_token_id=None)
    log.add(CallRecord(0, (RowFeed(tokens, columns, columns, tuple(range(width)), np.ones((len(tokens), width), bool),
                                   (3,) * len(tokens), (1.0,) * len(tokens)),)))
    return log


def _reconciled(log: ProvenanceLog | str, reading: Reading | None, found: Cause | None) -> Cause | None:
    diagnoser = Diagnoser(RunFacts(prompts=[[1]], references=[[2]], outputs=[[3]], max_new_tokens=1,
                                   eos_token_id=None, pad_token_id=None))
    diagnoser._run_observation, diagnoser._observed = log, reading
    return diagnoser._reconcile(found, [])


def test_a_class_the_observation_contradicts_becomes_unknown() -> None:
    """Only what was seen overrules a class the later checks named: queries with the row's exact context that
    chose the reference's token refute an input class; an engine seen never verifying proposals, or a target query
    that chose the engine's token, refutes `acceptance_rule`. Nothing seen, or a fact left to the checks, overrules
    nothing."""
    right = Reading("acceptance_rule", "3 queries read the row's exact context and chose the reference's token",
                    CHOSE_RIGHT)
    named = Cause("position_ids", "a replay with shifted positions", "a reproducing replay", "")
    assert _reconciled(_log(True), right, named).cls == "unknown"
    assert "contradicts" in _reconciled(_log(True), right, named).evidence
    missing = Reading("kv_cache", "column 3: missing entry", MISSING_ENTRY)
    assert _reconciled(_log(True), missing, named).cls == "position_ids"
    assert _reconciled(_log(True), Reading("unknown", "no query chose it"), named).cls == "position_ids"
    assert _reconciled("the run was not watched", right, named).cls == "position_ids"
    pad = Cause("pad_as_content", "the reference's next token is the pad id", "the outputs", "")
    assert _reconciled(_log(True), right._replace(cls="pad_as_content"), pad).cls == "pad_as_content"
    kept = Cause("acceptance_rule", "the engine's token is the draft's own choice", DRAFT_CHOICE, "")
    assert _reconciled(_log(False), right, kept).cls == "unknown"  # an engine that never verified did not speculate
    assert _reconciled(_log(True), right, kept).cls == "acceptance_rule"
    assert _reconciled(_log(True), missing, kept).cls == "unknown"  # the target chose the engine's token
    # a replay that reproduces a doubled bonus explains the wrong input seen after it: not overruled
    doubled = Cause("acceptance_rule", "a replay with the bonus token emitted twice", "a reproducing replay", "")
    assert _reconciled(_log(True), missing, doubled).cls == "acceptance_rule"
    drafted = _log(False)
    drafted.draft_calls = 2  # an engine that ran its draft model speculated, whatever its target calls were
    assert _reconciled(drafted, right, kept).cls == "acceptance_rule"


def test_the_hooks_cover_the_engines_own_call_alone() -> None:
    """`RunContext.rerun(..., around=)` enters the context around the engine's generate call only: a caller's
    reference decoding for a scripted drafter, before it, is not observed; a callable without `around` is
    refused one, and the observation says it was not made."""
    import contextlib

    from specaudit.equivalence.diagnosis.observe import observe_run
    from specaudit.equivalence.run_context import RunContext, wrapped

    events: list[str] = []

    class Engine:
        def generate(self, prompts, max_new_tokens, eos_token_id):
            events.append("generate")
            return [[5] for _ in prompts]

    def reruns(indices, pad_token_id, around=None):
        events.append("reference decoding")
        return wrapped(Engine().generate, around)([[1]] * len(indices), 1, None)

    @contextlib.contextmanager
    def around():
        events.append("enter")
        yield
        events.append("exit")

    run = RunContext(None, [[1], [2]], 1, None, "float64", reruns=reruns)
    assert run.confines_reruns
    assert run.rerun([0, 1], None, around=around) == [[5], [5]]
    assert events == ["reference decoding", "enter", "generate", "exit"]
    plain = RunContext(None, [[1]], 1, None, "float64", reruns=lambda indices, pad_token_id: [[5] for _ in indices])
    assert not plain.confines_reruns
    with pytest.raises(ValueError):
        plain.rerun([0], None, around=around)
    from specaudit.testing import models

    plain.pair = models.pair("tiny-gpt2")
    assert "takes no `around`" in observe_run(plain, [[5]], None)


@pytest.mark.parametrize("pair", ["tiny-lfm2", "tiny-qwen3-next", "tiny-bamba"])
def test_a_recurrent_state_not_rolled_back_is_seen(pair: str, tmp_path: Path) -> None:
    """On hybrids (short convolutions, gated delta-net, Mamba-2 beside attention) each row's recurrent state is
    fingerprinted as every call finds and leaves it, so the state a query read carries the history of the call
    that left it: an engine that crops only the attention layers at a rejection is named `recurrent_state` by that
    provenance (the state after every token fed, the rejected ones kept); its twin, which restores a copy of the
    cache and feeds it the kept tokens, is exact. The cache's own `crop` rolls back the convolution windows and not
    an SSM state: exact where the state is a convolution window alone, else the SSM state is named."""
    engines = ["state_not_rolled_back", "state_rolled_back", "state_cropped"]
    result = audit(*[arg for engine in engines for arg in ("--engine", f"observed_engines:{engine}")],
                   "--pair", pair, *SETTINGS, out=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    for run in runs(tmp_path):
        variant = run["engine"].split(":")[1]
        if variant == "state_rolled_back" or (variant == "state_cropped" and pair == "tiny-lfm2"):
            assert run["equivalent"] and not run["divergences"] and not run["failures"], variant
            continue
        structural = [d for d in run["divergences"] if d["kind"] == "structural"]
        assert structural, variant
        named = [d for d in structural if d["diagnosis"]["class"] == "recurrent_state"]
        assert len(named) >= 0.9 * len(structural), (variant, [d["diagnosis"]["class"] for d in structural])
        evidence = named[0]["diagnosis"]["evidence"]
        assert named[0]["diagnosis"]["named_by"] == PROVENANCE, named[0]["diagnosis"]
        assert "the recurrent state it read is not its row's" in evidence and "the rejected ones kept" in evidence, evidence
        assert variant != "state_cropped" or "its SSM state" in evidence, evidence


def test_which_targets_are_observed() -> None:
    """Attention caches per layer (full, or sliding windows beside full ones) and recurrent states beside full
    attention are observed; a sliding-window target's window is read from its config."""
    from specaudit.equivalence.diagnosis.anatomy import observable, sliding_window
    from specaudit.testing import models

    for pair in ("tiny-lfm2", "tiny-qwen3-next", "tiny-bamba", "tiny-gpt2"):
        assert observable(models.pair(pair).target) is None, pair
    gemma = models.pair("tiny-gemma3").target
    assert observable(gemma) is None and sliding_window(gemma) == gemma.config.sliding_window
    assert sliding_window(models.pair("tiny-gpt2").target) is None


def test_padding_the_model_is_not_told_of_enters_the_state(tmp_path: Path) -> None:
    """On a hybrid, the recurrent layers zero only the padding a 2-D mask marks: an uncached loop whose 4-D mask is
    right for attention feeds its left padding into every row's recurrent state (`attention_mask`: the state the
    producing query read holds the padding, by the provenance of the state); the padded loop handing the model its
    2-D mask is exact."""
    result = audit("--engine", "observed_engines:recompute", "--engine", "observed_engines:loop", "--pair", "tiny-lfm2",
                   *SETTINGS, out=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    for run in runs(tmp_path):
        if run["engine"].endswith(":loop"):
            assert run["equivalent"] and not run["divergences"] and not run["failures"]
            continue
        structural = [d for d in run["divergences"] if d["kind"] == "structural"]
        assert structural
        named = [d for d in structural if d["diagnosis"]["class"] == "attention_mask"]
        assert len(named) >= 0.9 * len(structural), [d["diagnosis"]["class"] for d in structural]
        evidence = named[0]["diagnosis"]["evidence"]
        assert "padding in the state" in evidence and "no 2-D mask marks it" in evidence, evidence
        assert named[0]["diagnosis"]["named_by"] == PROVENANCE, named[0]["diagnosis"]
