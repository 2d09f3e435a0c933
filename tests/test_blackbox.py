"""Rulings for black-box engines of another precision (equivalence/rulings/).

A fake llama.cpp server serves tiny-llama's float64 greedy outputs, except that on one prompt it
takes the reference's runner-up at the position where the reference's top-2 margin is smallest (a
near-tie flip, as an f16 KV cache would make) and continues greedily from there. Its log-
probabilities are the reference's, perturbed by a known amount. The audit must call the flip
numerical exactly when the band (declared or measured) covers the margin, say which band it used,
and call a flip at a wide margin structural whatever the engine's dtype.
"""

from __future__ import annotations

import pytest
import torch
from fake_server import FakeServer

from specaudit.engines.models import zoo
from specaudit.engines.reference import ReferenceDecoder, greedy_decode
from specaudit.engines.registry import make_engine
from specaudit.equivalence.rulings import band as blackbox
from specaudit.equivalence.audit import Reference, RunSettings, audit_engine
from specaudit.equivalence.compare import replay_logits

MAX_NEW = 16


@pytest.fixture(scope="module")
def setting():
    pair = zoo.load_pair("tiny-llama")
    prompts = zoo.builtin_prompts()[:4]
    reference = Reference(pair, prompts, MAX_NEW, pair.eos_token_id)
    # the smallest top-2 margin anywhere in the reference's outputs
    best = None
    for index, logits in enumerate(reference.logits):
        top = logits.topk(2).values
        margins = top[:, 0] - top[:, 1]
        position = int(margins[:-1].argmin())  # not the last token: something must follow the flip
        if best is None or float(margins[position]) < best[2]:
            best = (index, position, float(margins[position]))
    return pair, prompts, reference, best


def served_outputs(pair, prompts, reference, flip_index, flip_position, flip_rank=1):
    """The reference's outputs, with prompt `flip_index` taking the token of rank `flip_rank` at
    `flip_position` and continuing greedily."""
    outputs = [list(o) for o in reference.outputs]
    logits = reference.logits[flip_index][flip_position]
    flipped = int(logits.topk(flip_rank + 1).indices[flip_rank])
    prefix = outputs[flip_index][:flip_position] + [flipped]
    rest, _ = greedy_decode(pair.target, prompts[flip_index] + prefix, MAX_NEW - len(prefix), pair.eos_token_id)
    outputs[flip_index] = prefix + rest
    return outputs


def llamacpp_server(pair, prompts, outputs, perturbation: float | None):
    """Answers /completion with `outputs`; per-token top-2 log-probabilities from a float64 replay
    along each output, the runner-up's moved by +/- `perturbation` (None: no probabilities, as
    llama.cpp under speculation)."""
    answers = {}
    for prompt, output in zip(prompts, outputs):
        entries = []
        if perturbation is not None:
            logprobs = torch.log_softmax(replay_logits(pair.target, prompt, output).to(torch.float64), dim=-1)
            for position, token in enumerate(output):
                values, ids = logprobs[position].topk(2)
                sign = 1.0 if position % 2 else -1.0
                top = [{"id": int(ids[0]), "logprob": float(values[0])},
                       {"id": int(ids[1]), "logprob": float(values[1]) + sign * perturbation}]
                chosen = float(logprobs[position][token])
                entries.append({"id": token, "logprob": chosen, "top_logprobs": top})
        answers[tuple(prompt)] = {"tokens": output, "stop_type": "limit", "completion_probabilities": entries}
    return FakeServer(lambda path, body: (200, answers[tuple(body["prompt"])]))


def run_audit(pair, prompts, reference, server, **band):
    engine = make_engine(f"llamacpp:{server.url}", None, None, batch_size=2, draft_tokens=4)
    settings = RunSettings(max_new_tokens=MAX_NEW, eos_token_id=pair.eos_token_id, dtype="float64",
                           engine_name="llamacpp", batch_size=2, **band)  # band: engine_dtype or logit_tolerance
    return audit_engine(engine, pair, prompts, settings, reference=reference)


def test_near_tie_flip_is_numerical_within_a_measured_band(setting):
    pair, prompts, reference, (index, position, margin) = setting
    outputs = served_outputs(pair, prompts, reference, index, position)
    with llamacpp_server(pair, prompts, outputs, perturbation=2 * margin) as server:
        run = run_audit(pair, prompts, reference, server)
    (divergence,) = run["divergences"]
    assert (divergence["prompt_index"], divergence["position"]) == (index, position)
    assert divergence["kind"] == "numerical", divergence["evidence"]
    assert run["noise_band"]["source"] == "measured"
    measured = run["noise_band"]["measurement"]["max_gap_deviation"]
    assert measured == pytest.approx(2 * margin, rel=1e-6)
    assert divergence["evidence"]["reference_margin"] == pytest.approx(margin, rel=1e-6)
    assert run["equivalent"]


def test_measured_band_narrower_than_the_margin_is_structural(setting):
    pair, prompts, reference, (index, position, margin) = setting
    outputs = served_outputs(pair, prompts, reference, index, position)
    with llamacpp_server(pair, prompts, outputs, perturbation=margin / 4) as server:
        run = run_audit(pair, prompts, reference, server)
    (divergence,) = run["divergences"]
    assert divergence["kind"] == "structural" and not run["equivalent"]


def test_declared_tolerance_decides_and_is_reported(setting):
    pair, prompts, reference, (index, position, margin) = setting
    outputs = served_outputs(pair, prompts, reference, index, position)
    with llamacpp_server(pair, prompts, outputs, perturbation=None) as server:  # no probabilities
        wide = run_audit(pair, prompts, reference, server, logit_tolerance=2 * margin)
        narrow = run_audit(pair, prompts, reference, server, logit_tolerance=margin / 2)
        assumed = run_audit(pair, prompts, reference, server)
    assert wide["divergences"][0]["kind"] == "numerical"
    assert wide["noise_band"]["source"] == "declared-tolerance" and "--logit-tolerance" in wide["noise_band"]["how"]
    assert narrow["divergences"][0]["kind"] == "structural"
    # no declaration, no probabilities: the audit dtype's (float64) noise, so a real flip is a bug
    assert assumed["noise_band"]["source"] == "audit-dtype" and assumed["divergences"][0]["kind"] == "structural"


def test_flip_far_from_a_tie_is_structural_in_any_declared_dtype(setting):
    pair, prompts, reference, _ = setting
    # the token of rank 5 at the first position of prompt 0: far below the top
    outputs = served_outputs(pair, prompts, reference, 0, 0, flip_rank=5)
    with llamacpp_server(pair, prompts, outputs, perturbation=None) as server:
        run = run_audit(pair, prompts, reference, server, engine_dtype="bfloat16")
    divergence = next(d for d in run["divergences"] if d["prompt_index"] == 0)
    assert divergence["kind"] == "structural"
    assert run["noise_band"]["source"] == "declared-dtype"
    assert divergence["evidence"]["engine_token_gap"] > divergence["evidence"]["noise_band"]


def test_length_mismatch_is_never_a_near_tie():
    band = blackbox.NoiseBand("declared-tolerance", "test", tolerance=1e9)
    kind, evidence = blackbox.rule_on_band(band, torch.zeros(8), reference_token=3, engine_token=None)
    assert kind == "structural" and evidence["decided_by"] == "length"


def test_measure_ignores_positions_after_the_split():
    logits = [torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [5.0, 0.0, 0.0]], dtype=torch.float64)]
    # engine agrees at positions 0 and 1, diverges at 2 (where its numbers are wild)
    engine = [[{0: -0.3, 1: -1.5}, {1: -0.1, 2: -2.0}, {1: 0.0, 0: -50.0}]]
    result = blackbox.measure(engine, outputs=[[0, 1, 1]], reference_outputs=[[0, 1, 0]], reference_logits=logits)
    # gaps: position 0 engine 1.2 vs reference 1.0; position 1 engine 1.9 vs reference 2.0
    assert result["max_gap_deviation"] == pytest.approx(0.2)
    assert result["positions"] == 2 and result["token_pairs"] == 2
