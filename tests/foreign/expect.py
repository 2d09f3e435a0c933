"""What the corpus's variants must be diagnosed as, and the audit that checks it (for the
tests/test_foreign_*.py tests and reports/foreign/README.md's table).

`EXPECTED[module][variant]` is the class every structural divergence of that variant is caused by
(None: the correct variant, which must be exact). `EOS_ID` is an EOS id the tiny pairs emit often
enough for the stop variants to show (their own EOS id never comes up in a few tokens).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

EXPECTED: dict[str, dict[str, str | None]] = {
    "padded_loop": {"correct": None, "pos_padded": "position_ids", "pos_from_one": "position_ids",
                    "mask_padding": "attention_mask", "eos_any": "stop_eos", "eos_after": "stop_eos"},
    "generate_spec": {"correct": None, "pos_padded": "position_ids", "mask_padding": "attention_mask",
                      "accept_extra": "acceptance_rule", "overshoot": "stop_length",
                      "eos_after": "stop_eos"},
    "recompute_spec": {"correct": None, "pos_padded": "position_ids", "pos_holes": "position_ids",
                       "mask_holes": "kv_cache", "mask_padding": "attention_mask",
                       "accept_extra": "acceptance_rule"},
    "row_cache_spec": {"correct": None, "no_crop": "kv_cache", "pos_rejected": "position_ids",
                       "accept_extra": "acceptance_rule", "bonus_twice": "acceptance_rule", "overshoot": "stop_length"},
    "server_batcher": {"correct": None, "pos_padded": "position_ids", "mask_padding": "attention_mask",
                       "answer_by_slot": "output_order", "stop_on_any_eos": "stop_eos", "one_more": "stop_length"},
    "generate_chunks": {"correct": None, "pos_padded": "position_ids"},
    "static_cache_spec": {"correct": None, "pos_column": "position_ids", "pos_padded": "position_ids"},
    "right_padded_loop": {"correct": None, "pos_column": "position_ids", "gap_visible": "attention_mask"},
    "mask2d_spec": {"correct": None, "library_positions": "position_ids", "holes_visible": "kv_cache"},
}
# the rejected proposals left in the cache and read (mask_holes, holes_visible) are `kv_cache`: a column the row's
# sequence does not hold there, read (the README's "the target cache holds wrong, extra or missing entries"), by
# the provenance of what each query read; they were `attention_mask` while the mask the engine meant was the guide
# variants the diagnosis does not name yet, and why; their divergences must still never be `cross_row`, and
# each `unknown` must say what would decide it
KNOWN_GAPS: dict[str, str] = {}
EOS_ID = 19  # tiny-gpt2 emits it within a few tokens on most built-in prompts
# the variants whose bug needs more than the plain settings to show: an EOS that comes up (stops, and the
# order rows finish in), or one draft token a step (a step that accepts every draft token, for the bonus bugs)
EXTRA_ARGS: dict[str, tuple[str, ...]] = {
    **{v: ("--eos-token-id", str(EOS_ID)) for v in ("eos_any", "eos_after", "stop_on_any_eos", "answer_by_slot")},
    "bonus_twice": ("--draft-tokens", "1"),
}
SETTINGS = ("--batch-size", "4", "--num-prompts", "8", "--max-new-tokens", "12", "--no-adversarial")


def structural(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [d for d in run["divergences"] if d["kind"] == "structural"]


def classes(run: dict[str, Any]) -> Counter:
    return Counter(d["diagnosis"]["class"] for d in structural(run))


def share_named(run: dict[str, Any], expected: str) -> float:
    found = structural(run)
    return sum(d["diagnosis"]["class"] == expected for d in found) / len(found) if found else 0.0


def audit_module(module: str, pair: str, out: Path) -> list[dict]:
    """The audits of every variant of `tests/foreign/<module>.py` on `pair` (CLI, this process): one per
    set of extra arguments, the correct variant in each."""
    from cli_run import audit, runs

    groups: dict[tuple[str, ...], list[str]] = {}
    for variant in EXPECTED[module]:
        groups.setdefault(EXTRA_ARGS.get(variant, ()), ["correct"])
        if variant != "correct":
            groups[EXTRA_ARGS.get(variant, ())].append(variant)
    found: list[dict] = []
    for n, (extra, variants) in enumerate(groups.items()):
        args = [arg for variant in variants for arg in ("--engine", f"foreign.{module}:{variant}")]
        result = audit(*args, "--pair", pair, *SETTINGS, *extra, out=out / str(n))
        assert result.returncode in (0, 1), result.stdout + result.stderr
        found += runs(out / str(n))
    return found


def problems(run: dict[str, Any], expected: str | None) -> list[str]:
    """What is wrong with the diagnosis of one variant's run: the correct variant must be exact; a buggy one
    must diverge, be named by its cause on at least 90% of its structural divergences and never `cross_row`,
    and every named class says what decided it (`unknown`: what would)."""
    found = structural(run)
    name = run["engine"]
    detail = "; ".join(f"prompt {d['prompt_index']} token {d['position']}: {d['diagnosis']['class']}"
                       for d in found if d["diagnosis"]["class"] != expected)
    if expected is None:
        ok = run["equivalent"] and not run["divergences"] and not run["failures"]
        return [] if ok else [f"{name}: the correct variant is not exact ({detail or run['failures']})"]
    if not found:
        return [f"{name}: no structural divergence"]
    wrong = []
    share = share_named(run, expected)
    if share < 0.9 and name.split(".", 1)[-1] not in KNOWN_GAPS:
        wrong.append(f"{name}: {share:.0%} of {len(found)} named {expected} ({detail})")
    if any(d["diagnosis"]["class"] == "cross_row" for d in found):
        wrong.append(f"{name}: cross_row named ({detail})")
    for d in found:
        diagnosis = d["diagnosis"]
        key = "would_decide" if diagnosis["class"] == "unknown" else "named_by"
        if not diagnosis.get("tried") or not diagnosis.get(key):
            wrong.append(f"{name}: prompt {d['prompt_index']} has no {key} or tried")
    return wrong
