"""The rules on outputs alone (equivalence/rulings/outputs.py), each written once: where an output leaves its
reference, whether another output departs alike, and when an output that is another prompt's reference names
`output_order`, the same for the served rulings and the diagnosis's check.

The one-token case: a wrong first token that some other prompt's reference also is (every reference is one
token at max_new_tokens 1) is a flipped choice, not an answer to another prompt: neither the served ruling nor
the diagnosis names `output_order` for it, and both do for a two-token output."""

from __future__ import annotations

from specaudit.engines.registry import takes_request_params
from specaudit.equivalence.diagnosis import checks
from specaudit.equivalence.records import Divergence
from specaudit.equivalence.rulings import served
from specaudit.equivalence.rulings.outputs import departs_at, first_divergence, other_references_matched, token_at


def test_first_divergence_and_the_token_there() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # a shorter output differs where it ends
    assert first_divergence([1, 2], (1, 2, 3)) == 2  # any sequence of ids
    assert (token_at([4, 5], 1), token_at([4, 5], 2), token_at([4, 5], None)) == (5, None, None)


def test_another_output_departs_alike_only_at_the_same_position_with_the_same_token() -> None:
    reference = [1, 2, 3, 4]
    assert departs_at(reference, [1, 2, 9, 9], 2, 9)
    assert not departs_at(reference, [1, 2, 8], 2, 9)  # another token there
    assert not departs_at(reference, [1, 9, 9], 2, 9)  # departs earlier
    assert departs_at(reference, [1, 2], 2, None)  # ends there too
    assert not departs_at(reference, reference, 2, 9)  # does not depart at all


def _served(index: int, references: list[list[int]], output: list[int]) -> Divergence | None:
    return served.rule(index, [1, 2], references[index], output, eos_token_id=None, reference_lps=None,
                       band=served.ServedBand(0.0), all_references=references)


def test_a_one_token_output_equal_to_another_prompts_reference_is_not_output_order() -> None:
    references = [[5], [7], [9]]
    outputs = [[7], [7], [9]]
    assert other_references_matched(0, references, outputs[0]) == []
    assert checks.output_order(0, references, outputs) is None
    ruling = _served(0, references, outputs[0])
    assert ruling is not None and ruling.decided_by != "output-match" and ruling.diagnosis_class != "output_order"


def test_one_token_past_the_split_is_not_output_order_either() -> None:
    # the last token flipped to the other prompt's, or the output cut short where the other's ends
    assert other_references_matched(0, [[1, 2, 3], [1, 2, 4]], [1, 2, 4]) == []
    assert other_references_matched(0, [[1, 2, 3], [1, 2]], [1, 2]) == []


def test_a_two_token_output_that_is_another_prompts_reference_is_output_order_in_both() -> None:
    references = [[5, 6], [7, 8], [9, 10]]
    outputs = [[7, 8], [5, 6], [9, 10]]
    assert other_references_matched(0, references, outputs[0]) == [1]
    found = checks.output_order(0, references, outputs)
    assert found is not None and found.cls == "output_order" and "prompt 1" in found.evidence
    ruling = _served(0, references, outputs[0])
    assert ruling is not None and (ruling.decided_by, ruling.diagnosis_class) == ("output-match", "output_order")
    assert other_references_matched(2, references, outputs[2]) == []  # its own reference


def test_request_parameters_taken_and_sampled_through() -> None:
    assert takes_request_params("hf-assisted") and not takes_request_params("hf-assisted", sampled=True)
    assert takes_request_params("eqspec") and takes_request_params("eqspec", sampled=True)
    assert not takes_request_params("no.such.module:Engine")
    assert not takes_request_params("no.such.module:Engine", sampled=True)


def test_a_served_divergence_has_the_one_context_window() -> None:
    # the same window as an in-process divergence: 16 tokens of the output before it, 16 of each side
    reference = list(range(100, 140))
    output = reference[:20] + list(range(200, 220))
    ruling = served.rule(0, [1, 2], reference, output, eos_token_id=None, reference_lps=None,
                         band=served.ServedBand(0.0))
    assert isinstance(ruling, Divergence) and ruling.position == 20
    assert ruling.context.common == tuple(reference[4:20])
    assert ruling.context.reference == tuple(reference[20:36]) and ruling.context.engine == tuple(output[20:36])
    assert ruling.diagnosis_class == "unknown" and ruling.diagnosis.needs_weights
