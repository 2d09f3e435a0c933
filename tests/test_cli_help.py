"""`specaudit audit --help`: the common options first, the others in named groups (`--help=GROUP`,
`--help=all`), each option's default shown; and every option of the audit as it was before the grouping."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from cli_run import cli
from specaudit.cli import build_parser

# Every option of `specaudit audit` before its options were grouped for --help, as argparse held it:
# option: (dest, action class, nargs, default, type's name, choices, required). The grouping changes only
# the help; each of these must parse as before.
BEFORE: dict[str, tuple] = {
    '--engine': ('engine', '_AppendAction', None, None, None, None, True),
    '--engine-option': ('engine_option', '_AppendAction', None, [], 'engine_option', None, False),
    '--pair': ('pair', '_AppendAction', None, [], None, None, False),
    '--target': ('target', '_StoreAction', None, None, None, None, False),
    '--draft': ('draft', '_StoreAction', None, None, None, None, False),
    '--trust-remote-code': ('trust_remote_code', '_StoreTrueAction', 0, False, None, None, False),
    '--allow-pickle-weights': ('allow_pickle_weights', '_StoreTrueAction', 0, False, None, None, False),
    '--batch-size': ('batch_size', '_StoreAction', '+', [8], 'positive', None, False),
    '--dtype': ('dtype', '_StoreAction', '+', ['float64'], 'dtype', None, False),
    '--device': ('device', '_StoreAction', None, 'cpu', None, None, False),
    '--no-cuda-graphs': ('no_cuda_graphs', '_StoreTrueAction', 0, False, None, None, False),
    '--prompts': ('prompts', '_StoreAction', None, 'builtin', None, None, False),
    '--num-prompts': ('num_prompts', '_StoreAction', None, None, 'positive', None, False),
    '--max-new-tokens': ('max_new_tokens', '_StoreAction', None, 32, 'positive', None, False),
    '--draft-tokens': ('draft_tokens', '_StoreAction', None, 4, 'positive', None, False),
    '--timeout': ('timeout', '_StoreAction', None, 3600.0, '_seconds', None, False),
    '--eos-token-id': ('eos_token_id', '_StoreAction', None, 'pair', '_eos', None, False),
    '--pad-token-id': ('pad_token_id', '_StoreAction', None, None, '_token_id', None, False),
    '--no-adversarial': ('no_adversarial', '_StoreTrueAction', 0, False, None, None, False),
    '--engine-dtype': ('engine_dtype', '_StoreAction', None, None, None, ('float32', 'bfloat16', 'float16'), False),
    '--logit-tolerance': ('logit_tolerance', '_StoreAction', None, None, '_tolerance', None, False),
    '--require-speculation': ('require_speculation', '_StoreTrueAction', 0, False, None, None, False),
    '--plain-engine': ('plain_engine', '_StoreAction', None, None, None, None, False),
    '--reference': ('reference', '_StoreAction', None, None, None, None, False),
    '--tokenizer': ('tokenizer', '_StoreAction', None, None, None, None, False),
    '--reference-batch-invariant': ('reference_batch_invariant', '_StoreTrueAction', 0, False, None, None, False),
    '--reference-top-logprobs': ('reference_top_logprobs', '_StoreAction', None, 5, 'int', None, False),
    '--no-bundles': ('no_bundles', '_StoreTrueAction', 0, False, None, None, False),
    '--diagnosis': ('diagnosis', '_StoreAction', None, 'full', None, ('quick', 'full'), False),
    '--diagnosis-budget': ('diagnosis_budget', '_StoreAction', None, None, '_seconds', None, False),
    '--stop': ('stop', '_AppendAction', None, [], None, None, False),
    '--stop-token-id': ('stop_token_id', '_AppendAction', None, [], 'int', None, False),
    '--min-tokens': ('min_tokens', '_StoreAction', None, 0, 'int', None, False),
    '--repetition-penalty': ('repetition_penalty', '_StoreAction', None, 1.0, 'float', None, False),
    '--presence-penalty': ('presence_penalty', '_StoreAction', None, 0.0, 'float', None, False),
    '--frequency-penalty': ('frequency_penalty', '_StoreAction', None, 0.0, 'float', None, False),
    '--logit-bias': ('logit_bias', '_AppendAction', None, [], '_logit_bias', None, False),
    '--bad-words': ('bad_words', '_AppendAction', None, [], None, None, False),
    '--min-p': ('min_p', '_StoreAction', None, 0.0, 'float', None, False),
    '--top-k': ('top_k', '_StoreAction', None, 0, 'int', None, False),
    '--logprobs': ('logprobs', '_StoreAction', None, None, 'int', None, False),
    '--json-schema': ('json_schema', '_StoreAction', None, None, None, None, False),
    '--json-object': ('json_object', '_StoreTrueAction', 0, False, None, None, False),
    '--regex': ('regex', '_StoreAction', None, None, None, None, False),
    '--choice': ('choice', '_AppendAction', None, [], None, None, False),
    '--grammar': ('grammar', '_StoreAction', None, None, None, None, False),
    '--grammar-syntax': ('grammar_syntax', '_StoreAction', None, 'auto', None, ('auto', 'ebnf', 'lark'), False),
    '--grammar-backend': ('grammar_backend', '_StoreAction', None, 'xgrammar', None, ('xgrammar', 'llguidance'), False),
    '--no-any-whitespace': ('no_any_whitespace', '_StoreTrueAction', 0, False, None, None, False),
    '--speculation': ('speculation', '_StoreAction', None, None, '_speculation', None, False),
    '--acceptance-baseline': ('acceptance_baseline', '_StoreAction', None, None, '_baseline', None, False),
    '--require-acceptance': ('require_acceptance', '_StoreAction', None, None, '_ratio', None, False),
    '--payoff': ('payoff', '_StoreAction', None, 0, 'positive', None, False),
    '--out': ('out', '_StoreAction', None, None, 'Path', None, True),
    '--no-progress': ('no_progress', '_StoreTrueAction', 0, False, None, None, False),
    '--temperature': ('temperature', '_StoreAction', None, None, '_non_negative', None, False),
    '--top-p': ('top_p', '_StoreAction', None, 1.0, '_probability', None, False),
    '--samples': ('samples', '_StoreAction', None, 400, 'int', None, False),
    '--seed': ('seed', '_StoreAction', None, 0, 'int', None, False),
    '--alpha': ('alpha', '_StoreAction', None, 0.01, 'float', None, False),
}

# a value each type takes (a flag takes none), to show the option is accepted
SAMPLE = {"positive": "2", "dtype": "float32", "_seconds": "5", "_eos": "1,2", "_token_id": "3", "_tolerance": "0.1",
          "int": "3", "float": "0.5", "_logit_bias": "3:-1", "_speculation": "draft:k=2", "_ratio": "0.5",
          "engine_option": "window_size=16", "Path": "elsewhere", "_non_negative": "0.7", "_probability": "0.9",
          None: "something"}
REQUIRED = {"--engine": "eqspec", "--out": "out"}  # the options every audit is given


def audit_parser() -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["audit"]


def options(actions: list[argparse.Action]) -> set[str]:
    return {option for action in actions for option in action.option_strings}


def entries(text: str) -> dict[str, str]:
    """Each option the help lists (a line `  --flag ...` or `  -h, --help[=GROUP]`) with its help text."""
    listed: dict[str, str] = {}
    names: list[str] = []
    for line in text.splitlines():
        if line.startswith("  -"):
            invocation, _, rest = line[2:].partition("  ")
            names = [part.split(" ")[0].split("[")[0] for part in invocation.split(", ")]
            for name in names:
                listed[name] = rest.strip()
        elif line.startswith(" " * 24) and names:  # the help's next line
            for name in names:
                listed[name] += " " + line.strip()
        else:
            names = []
    return listed


def help_text(monkeypatch: pytest.MonkeyPatch, *flag: str) -> str:
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps to the terminal: the line count at 80 columns
    result = cli("audit", *flag)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_every_option_from_before_is_defined_as_before() -> None:
    actions = {option: action for action in audit_parser()._actions for option in action.option_strings}
    for option, (dest, kind, nargs, default, type_name, choices, required) in BEFORE.items():
        assert option in actions, f"{option} is gone"
        action = actions[option]
        now = (action.dest, type(action).__name__, action.nargs, action.default,
               getattr(action.type, "__name__", None) if action.type else None,
               tuple(action.choices) if action.choices else None, action.required)
        assert now == (dest, kind, nargs, default, type_name, choices, required), option


@pytest.mark.parametrize("option", sorted(BEFORE))
def test_every_option_from_before_is_accepted(option: str, tmp_path: Path) -> None:
    dest, kind, _, default, type_name, choices, _ = BEFORE[option]
    if kind == "_StoreTrueAction":
        given: list[str] = [option]
    elif option == "--acceptance-baseline":  # an earlier audit.json with per-position counters
        baseline = tmp_path / "audit.json"
        baseline.write_text(json.dumps({"runs": [{"acceptance": {"observed": {
            "accepted_per_position": [3], "drafts_per_position": [4]}}}]}))
        given = [option, str(baseline)]
    else:
        given = [option, [c for c in choices if c != default][0] if choices else SAMPLE[type_name]]
    required = [word for flag, value in REQUIRED.items() if flag != option for word in (flag, value)]
    args = build_parser().parse_args(["audit", *required, *given])
    assert getattr(args, dest) != default


def test_plain_help_is_the_common_options_and_a_line_per_group(monkeypatch: pytest.MonkeyPatch) -> None:
    text = help_text(monkeypatch, "--help")
    assert len(text.splitlines()) < 80
    for option in ("--engine", "--pair", "--target", "--draft", "--batch-size", "--dtype", "--device", "--prompts",
                   "--num-prompts", "--max-new-tokens", "--draft-tokens", "--timeout", "--out"):
        assert f"\n  {option} " in text
    common = [g for g in audit_parser().help_groups if g.name == "common"][0]
    assert set(entries(text)) == options(common.group._group_actions)  # the other groups are listed only
    listed = text.split("more options")[1].split("examples:")[0]
    groups = [group.name for group in audit_parser().help_groups if group.name != "common"]
    assert len(groups) >= 8
    for name in groups + ["all"]:
        assert f"\n  {name} " in listed
    assert "--help=GROUP" in text
    assert help_text(monkeypatch, "-h") == text == help_text(monkeypatch, "--help=common")


def test_help_all_shows_every_option_with_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    text = help_text(monkeypatch, "--help=all")
    listed = entries(text)
    assert set(listed) == options(audit_parser()._actions)
    for shown in ("--batch-size: batch sizes (default: 8)", "--dtype: (default: float64)",
                  "--timeout: (default: 3600.0)", "--min-tokens: (default: 0)", "--samples: (default: 400)",
                  "--prompts: (default: builtin)", "--device: (default: cpu)", "--seed: (default: 0)",
                  "--presence-penalty: (default: 0.0)"):
        option, _, part = shown.partition(": ")
        assert part in listed[option], (option, listed[option])
    for option, help in listed.items():
        assert help.count("(default:") + help.count("full (default)") <= 1, option  # never said twice
        assert not any(noise in help for noise in ("(default: None)", "(default: False)", "(default: [])")), option
    assert listed["--grammar-syntax"].endswith("(default: auto, Lark unless a line holds ::=, as vLLM reads it)")


def test_every_option_is_in_exactly_one_group() -> None:
    parser = audit_parser()
    grouped = [action for group in parser.help_groups for action in group.group._group_actions]
    assert len(grouped) == len(set(map(id, grouped)))
    assert {id(action) for action in grouped} == {id(action) for action in parser._actions}


@pytest.mark.parametrize("name", ["prompts", "servers", "reference", "requests", "structured", "sampling",
                                  "acceptance", "diagnosis", "precision", "engines", "output"])
def test_help_group_shows_that_group_alone(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = audit_parser()
    (group,) = [g for g in parser.help_groups if g.name == name]
    text = help_text(monkeypatch, f"--help={name}")
    assert set(entries(text)) == options(group.group._group_actions)
    assert help_text(monkeypatch, "--help", name.upper()) == text  # the name as a separate word, any case


def test_an_unknown_help_group_is_one_line_naming_the_groups() -> None:
    result = cli("audit", "--help=nosuch")
    assert result.returncode == 2 and not result.stdout
    assert len(result.stderr.strip().splitlines()) == 1
    assert "unknown help group 'nosuch'" in result.stderr
    for name in ("common", "servers", "reference", "sampling", "all"):
        assert name in result.stderr
