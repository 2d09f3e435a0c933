"""The draft check of the diagnosis below float64 (`equivalence/diagnosis/checks.draft_token_kept`): an
engine that keeps its draft's tokens, recorded on another device, keeps the choices of a draft that rounds
differently, so at the draft's near-ties the audit-dtype draft chooses another token. The check then asks
the float64 draft, with the band the draft-fidelity check uses (`Diagnoser._draft_chose`).

Data: the DSD recording of `tests/data/gpu-h100-bf16/` (its outputs are its bfloat16 draft's greedy
decoding on an H100). On prompt 3 at new token 3 the CPU's bfloat16 draft chooses another token than the
H100's, and the float64 draft puts both at the same logit (measured: float64 gap 0.0). Cost: loading tiny-llama
and a float64 copy of its draft, then a few passes over 8 tokens (22.7 s for the file on 2 busy cores).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specaudit.engines.models.zoo import load_pair
from specaudit.equivalence.diagnosis import checks
from specaudit.equivalence.diagnosis.core import Diagnoser
from specaudit.equivalence.rulings import Ruler

DATA = Path(__file__).resolve().parent / "data" / "gpu-h100-bf16"
PROMPT, POSITION = 3, 3


@pytest.fixture(scope="module")
def setting():
    pair = load_pair("tiny-llama", dtype="bfloat16")
    line = json.loads((DATA / "tiny-llama-dsd-b8-bf16-cuda.jsonl").read_text().splitlines()[PROMPT])
    prompt, output = line["prompt_ids"], line["output_ids"]
    diagnoser = Diagnoser(prompts=[prompt], references=[[]], outputs=[output], max_new_tokens=48,
                          eos_token_id=None, pad_token_id=None, target=pair.target, draft=pair.draft,
                          ruler=Ruler("bfloat16", pair.target, pair.target))  # its dtype: below float64
    return pair, prompt, output, diagnoser


def _draft_choice(draft, sequence: list[int]) -> int:
    with torch.no_grad():
        return int(draft(input_ids=torch.tensor([sequence])).logits[0, -1].argmax())


def test_a_draft_near_tie_flipped_by_rounding_is_still_the_drafts_choice(setting) -> None:
    pair, prompt, output, diagnoser = setting
    prefix = prompt + output[:POSITION]
    choice = _draft_choice(pair.draft, prefix)
    assert choice != output[POSITION]  # the CPU's bfloat16 draft chooses otherwise at this near-tie
    reference = output[:POSITION] + [next(t for t in range(3, 250) if t not in (choice, output[POSITION]))]
    assert checks.draft_token_kept(prompt, reference, output, POSITION, pair.draft, None) is None
    found = checks.draft_token_kept(prompt, reference, output, POSITION, pair.draft, None, diagnoser._draft_chose)
    assert found is not None and found.cls == "acceptance_rule"


def test_a_token_far_below_the_drafts_top_is_not_its_choice(setting) -> None:
    pair, prompt, output, diagnoser = setting
    prefix = prompt + output[:POSITION]
    with torch.no_grad():
        logits = pair.draft(input_ids=torch.tensor([prefix])).logits[0, -1]
    worst = int(logits.argmin())
    assert not diagnoser._draft_chose(prefix, int(logits.argmax()), worst)
    engine = output[:POSITION] + [worst]
    reference = output[:POSITION] + [int(logits.argmax())]
    assert checks.draft_token_kept(prompt, reference, engine, POSITION, pair.draft, None,
                                   diagnoser._draft_chose) is None
