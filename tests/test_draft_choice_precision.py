"""The draft check of the diagnosis below float64 (`equivalence/diagnosis/checks.draft_token_kept`): an
engine that keeps its draft's tokens, run on another device, keeps the choices of a draft that rounds
differently, so at the draft's near-ties the audit-dtype draft chooses another token. The check then asks
the float64 draft, with the band the draft-fidelity check uses (`Diagnoser._draft_chose`).

Which way a near-tie falls in bfloat16 depends on the machine's kernels, so the near-tie is built: drafts
whose logits are set by hand (`tests/table_models.py`), the float64 draft tying two tokens exactly and its
bfloat16 twin preferring one of them by a value exact in bfloat16. The DSD recording of
`tests/data/gpu-h100-bf16/` (its outputs are its bfloat16 draft's greedy decoding on an H100) is checked for
what holds whichever way this CPU's draft rounds there.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specaudit.engines.models.zoo import load_pair
from specaudit.equivalence.diagnosis import checks
from specaudit.equivalence.diagnosis.core import Diagnoser
from specaudit.equivalence.diagnosis.facts import RunFacts
from specaudit.equivalence.rulings import Ruler
from table_models import TableModel

pytestmark = pytest.mark.precision  # what it sees rounds below float64: run under other kernels too

V = 8
PROMPT = [0, 3]
KEPT, OTHER, TARGET_CHOICE = 2, 1, 5  # the engine's kept draft token, the audit draft's choice, the target's
# after token 0 both drafts choose 3; after token 3 the float64 draft ties OTHER and KEPT (4.0 each) and the
# bfloat16 draft prefers OTHER by one bfloat16 step at 4 (4.0 against 3.96875, both exact in bfloat16)
EXACT = {0: [0, 0, 0, 4.0, 0, 0, 0, 0], 3: [0, 4.0, 4.0, 0, 0, 0, 0, 0]}
LOW = {0: [0, 0, 0, 4.0, 0, 0, 0, 0], 3: [0, 4.0, 3.96875, 0, 0, 0, 0, 0]}


def _diagnoser(draft: torch.nn.Module, exact_draft: torch.nn.Module | None, prompt: list[int],
               output: list[int], target: torch.nn.Module | None = None) -> Diagnoser:
    return Diagnoser(RunFacts(prompts=[prompt], references=[[]], outputs=[output], max_new_tokens=len(output) + 8,
                              eos_token_id=None, pad_token_id=None, target=target, draft=draft, replay_draft=exact_draft,
                              ruler=Ruler("bfloat16", target or draft, target or draft)))  # its dtype: below float64


def test_a_draft_near_tie_the_audit_draft_breaks_otherwise_is_still_the_drafts_choice() -> None:
    low, exact = TableModel(LOW, torch.bfloat16, V), TableModel(EXACT, torch.float64, V)
    output, reference = [KEPT], [TARGET_CHOICE]
    diagnoser = _diagnoser(low, exact, PROMPT, output)
    # without the float64 draft: the bfloat16 draft chooses OTHER, so KEPT is not its choice
    assert checks.draft_token_kept(PROMPT, reference, output, 0, low, None) is None
    found = checks.draft_token_kept(PROMPT, reference, output, 0, low, None, diagnoser._draft_chose)
    assert found is not None and found.cls == "acceptance_rule"
    assert f"there it chooses {OTHER}" in found.evidence


def test_a_token_below_the_float64_drafts_top_is_not_its_choice() -> None:
    """The same prefix with the float64 draft's tie opened to one bfloat16 step: a step is 16 times less than the
    band at a top of 4, so still the draft's choice; a token 4.0 below the top is not."""
    low, exact = TableModel(LOW, torch.bfloat16, V), TableModel(LOW, torch.float64, V)
    diagnoser = _diagnoser(low, exact, PROMPT, [KEPT])
    assert diagnoser._draft_chose(PROMPT, OTHER, KEPT)
    assert not diagnoser._draft_chose(PROMPT, OTHER, TARGET_CHOICE)
    assert checks.draft_token_kept(PROMPT, [TARGET_CHOICE], [4], 0, low, None, diagnoser._draft_chose) is None


@pytest.fixture(scope="module")
def recording():
    pair = load_pair("tiny-llama", dtype="bfloat16")
    line = json.loads((DATA / "tiny-llama-dsd-b8-bf16-cuda.jsonl").read_text().splitlines()[RECORDED_PROMPT])
    return pair, line["prompt_ids"], line["output_ids"]


DATA = Path(__file__).resolve().parent / "data" / "gpu-h100-bf16"
RECORDED_PROMPT, RECORDED_POSITION = 3, 3  # the H100's bfloat16 draft chose a token that the float64 draft ties


def test_the_recorded_drafts_near_tie_is_its_choice_whichever_way_this_cpu_rounds(recording) -> None:
    pair, prompt, output = recording
    diagnoser = _diagnoser(pair.draft, None, prompt, output, pair.target)
    prefix = prompt + output[:RECORDED_POSITION]
    with torch.no_grad():
        choice = int(pair.draft(input_ids=torch.tensor([prefix])).logits[0, -1].argmax())
        if choice != output[RECORDED_POSITION]:  # this CPU breaks the tie otherwise than the H100 did
            assert diagnoser._draft_chose(prefix, choice, output[RECORDED_POSITION])
        reference = output[:RECORDED_POSITION] + [next(t for t in range(3, 250)
                                                       if t not in (choice, output[RECORDED_POSITION]))]
        found = checks.draft_token_kept(prompt, reference, output, RECORDED_POSITION, pair.draft, None,
                                        diagnoser._draft_chose)
        assert found is not None and found.cls == "acceptance_rule"
        logits = pair.draft(input_ids=torch.tensor([prefix])).logits[0, -1]
        worst = int(logits.argmin())  # far below the top in any rounding
        assert not diagnoser._draft_chose(prefix, choice, worst)
