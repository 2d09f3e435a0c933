"""The diagnosis each planted fault must get: the class that names what its fix changes.

A fault that makes a row's output depend on the other rows of its batch (a cache trimmed to
another row's acceptance, a cache taken from the wrong row) is `cross_row`; a row's own cache
holding wrong, extra or missing entries of its own tokens is `kv_cache`.
"""

from __future__ import annotations

EXPECTED_CLASS: dict[str, str] = {
    "position_ids_count_padding": "position_ids",
    "position_ids_from_one": "position_ids",
    "attention_mask_blind_to_padding": "attention_mask",
    "target_cache_not_trimmed": "kv_cache",  # the row's cache keeps its rejected slots
    "draft_cache_not_trimmed": "draft_cache",
    "draft_fill_pass_skipped": "draft_cache",
    "first_rejected_draft_accepted": "acceptance_rule",
    "bonus_token_dropped": "acceptance_rule",
    "bonus_token_doubled": "acceptance_rule",
    "cache_trimmed_to_smallest_acceptance": "cross_row",  # each row cut to another row's acceptance
    "finished_rows_dropped_by_position": "cross_row",  # a row inherits a finished row's cache
    "repad_without_unpad": "kv_cache",  # pad slots left inside the row's cache
    "pad_token_treated_as_padding": "pad_as_content",
    "overshoot_max_new_tokens": "stop_length",
    "tokens_after_eos": "stop_eos",
    "group_stacks_different_lengths": "kv_cache",  # each row cut out of the group cache at wrong columns
    "group_results_to_wrong_rows": "cross_row",  # a sequence takes its neighbour's cache
    # hybrid models: a state kept, advanced, zeroed, crossed, padded or stale at the rollback
    "recurrent_state_not_rolled_back": "recurrent_state",
    "recurrent_state_advanced_by_rejected": "recurrent_state",
    "conv_state_reset_mid_sequence": "recurrent_state",
    "recurrent_state_from_another_row": "recurrent_state",
    "pad_tokens_fed_into_state": "recurrent_state",  # padding after a shorter row's drafts kept in its state
    "state_stale_after_zero_draft_step": "recurrent_state",  # a rollback from an earlier pass's states
    "attention_cache_cut_at_pass_end": "kv_cache",  # on a hybrid target: the attention cache only, states right
}

# Faults whose rows' own caches go wrong because of the other rows: the provenance of what a query read sees the
# row's own cache (an accepted entry missing, the tokens after it one index off, an entry twice) before the re-runs
# alone and in the batch show the other rows behind it. Each class here is a fact about that divergence, and the
# fault's own class must still be named on its minimal example (a gap: the provenance does not yet follow a
# row's wrong count back to the row it came from).
ALSO_SEEN: dict[str, frozenset[str]] = {
    "cache_trimmed_to_smallest_acceptance": frozenset({"kv_cache", "position_ids"}),
}

# Faults that change no output in exact arithmetic on a pair: below float64 they are rounding only, so
# an audit in bfloat16 must rule every flip they cause numerical (the float64 audit sees them in logits).
INVISIBLE_BELOW_FLOAT64: dict[tuple[str, str], str] = {
    ("position_ids_from_one", "tiny-llama"): "RoPE attention depends on position differences only: a constant "
                                            "offset moves no logit in exact arithmetic (about 1e-8 in float64, "
                                            "where the audit's logit check catches it)",
}
