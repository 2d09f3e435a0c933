"""The pytest plugin, run by pytester the way a user's CI runs it."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent
ARGS = ["-p", "no:cacheprovider", "--specaudit-pair", "tiny-gpt2", "--specaudit-batch-size", "4",
        "--specaudit-max-examples", "6", "--specaudit-max-new-tokens", "8",
        "--specaudit-max-prompt-length", "6"]


@pytest.fixture
def user_repo(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.syspathinsert(TESTS)
    pytester.makepyfile(test_own="def test_own():\n    assert True\n")
    return pytester


def _failure_first_line(result: pytest.RunResult) -> str:
    """The first line of the (only) failure's message, under its section header."""
    lines = result.stdout.lines
    header = next(i for i, line in enumerate(lines) if line.startswith("_") and "specaudit[" in line)
    return next(line for line in lines[header + 1:] if line.strip())


def test_correct_user_engine_passes(user_repo: pytest.Pytester) -> None:
    result = user_repo.runpytest("--specaudit-engine", "sample_engines:make_correct", *ARGS)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*specaudit equivalence*", "*sample_engines:make_correct*B=4*1/1 pairs pass*equivalent*"])


def test_row_position_bug_fails_with_location(user_repo: pytest.Pytester) -> None:
    # the search is random: 6 examples once drew no case where row 0 rejects a draft and goes on; it stops at
    # the first failure, so 40 cost no more. The search's finding is the subject: no adversarial prompts
    # (a 500-token prompt and its diagnosis; tests/test_adversarial.py and the next test have them)
    result = user_repo.runpytest("--specaudit-engine", "sample_engines:make_row_zero_position_bug", *ARGS,
                                 "--specaudit-max-examples", "40", "--specaudit-no-adversarial")
    result.assert_outcomes(passed=1, failed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([
        "*structural divergence*",
        "*prompt 0, position *, step *",
        "*shrunk counterexample: DecodingCase(*",
        "*NOT equivalent*",
    ])
    # the message starts with the diagnosis of the shrunk counterexample, then its fix
    assert _failure_first_line(result).startswith("diagnosis: position_ids"), result.stdout.str()
    result.stdout.fnmatch_lines(["fix: Derive each row's position ids*"])


def test_adversarial_prompts_catch_what_the_search_cannot_draw(user_repo: pytest.Pytester) -> None:
    # the engine errs only on prompts over 1000 tokens: longer than any prompt the search draws
    args = [arg if arg != "tiny-gpt2" else "tiny-llama" for arg in ARGS]
    result = user_repo.runpytest("--specaudit-engine", "sample_engines:make_overshoots_long_prompts", *args)
    result.assert_outcomes(passed=1, failed=1)
    first = _failure_first_line(result)
    assert first.startswith("diagnosis: stop_length"), result.stdout.str()
    result.stdout.fnmatch_lines(["*on the adversarial prompts; first: prompt * (longer-than-2048, 2100 tokens*"])


def test_no_engine_adds_no_tests(user_repo: pytest.Pytester) -> None:
    result = user_repo.runpytest(*ARGS)
    result.assert_outcomes(passed=1)
    assert "specaudit equivalence" not in result.stdout.str()


def test_unknown_engine_is_a_usage_error(user_repo: pytest.Pytester) -> None:
    result = user_repo.runpytest("--specaudit-engine", "nowhere.module:factory", *ARGS)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*cannot import*nowhere.module*"])


def test_options_are_grouped_with_defaults(user_repo: pytest.Pytester) -> None:
    result = user_repo.runpytest("--help")
    result.stdout.fnmatch_lines(["specaudit: equivalence of batched speculative decoding:",
                                 "*--specaudit-engine=E*", "*--specaudit-max-examples=N*", "*(default: 25)*"])


LOGGING_ENGINE = '''
import json, os
from specaudit.engines.eqspec import EQSpec

def make(target, draft, *, batch_size, draft_tokens, **options):
    """EQSPEC that writes every call it gets (the examples the search drew) to $DRAWN_LOG."""
    engine = EQSpec(target, draft, batch_size=batch_size, draft_tokens=draft_tokens, **options)
    inner = engine.generate

    def generate(prompts, max_new_tokens, eos_token_id):
        with open(os.environ["DRAWN_LOG"], "a") as log:
            log.write(json.dumps([prompts, max_new_tokens, eos_token_id, batch_size, draft_tokens]) + "\\n")
        return inner(prompts, max_new_tokens, eos_token_id)

    engine.generate = generate
    return engine
'''
SEARCH = ["--specaudit-engine", "logging_engine:make", "--specaudit-pair", "tiny-gpt2", "--specaudit-batch-size", "2",
          "--specaudit-max-examples", "5", "--specaudit-max-new-tokens", "6", "--specaudit-max-prompt-length", "6",
          "--specaudit-no-adversarial"]


def _drawn(repo: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[str, str]:
    """What a run's search drew (the engine's calls, in order) and the run's output."""
    log = repo.path / f"drawn-{len(list(repo.path.glob('drawn-*')))}.jsonl"
    monkeypatch.setenv("DRAWN_LOG", str(log))
    result = repo.runpytest("-p", "no:cacheprovider", *SEARCH, *args)
    result.assert_outcomes(passed=2)  # the repository's own test and the engine's
    return log.read_text(), result.stdout.str()


def test_the_same_seed_draws_the_same_examples(user_repo: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("SPECAUDIT_SEED", raising=False)
    user_repo.makepyfile(logging_engine=LOGGING_ENGINE)
    first, out = _drawn(user_repo, monkeypatch, "--specaudit-seed", "11")
    again, _ = _drawn(user_repo, monkeypatch, "--specaudit-seed", "11")
    other, _ = _drawn(user_repo, monkeypatch, "--specaudit-seed", "12")
    assert first and first == again
    assert other != first
    assert "property search seed: 11" in out
    # with no seed given: a random one, printed; replaying it draws the same examples
    drawn, out = _drawn(user_repo, monkeypatch)
    printed = out.split("property search seed: ")[1].split(" ")[0]
    assert _drawn(user_repo, monkeypatch, "--specaudit-seed", printed)[0] == drawn


def test_ci_runs_draw_from_a_fixed_seed(user_repo: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECAUDIT_SEED", raising=False)
    monkeypatch.setenv("CI", "true")
    user_repo.makepyfile(logging_engine=LOGGING_ENGINE)
    first, out = _drawn(user_repo, monkeypatch)
    assert first == _drawn(user_repo, monkeypatch)[0]
    assert "property search seed: 0 (the fixed seed of CI runs" in out
    monkeypatch.setenv("SPECAUDIT_SEED", "5")
    assert _drawn(user_repo, monkeypatch)[0] == _drawn(user_repo, monkeypatch, "--specaudit-seed", "5")[0]


def test_a_failure_prints_its_seed_and_a_command_that_replays_it(user_repo: pytest.Pytester,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("SPECAUDIT_SEED", raising=False)
    result = user_repo.runpytest("--specaudit-engine", "sample_engines:make_row_zero_position_bug", *ARGS,
                                 "--specaudit-max-examples", "40", "--specaudit-no-adversarial")
    result.assert_outcomes(passed=1, failed=1)
    lines = result.stdout.lines
    seed = next(line for line in lines if line.startswith("seed: "))
    replay = next(line for line in lines if line.startswith("replay: pytest "))
    shrunk = next(line for line in lines if "shrunk counterexample" in line)
    assert seed.split()[1] in replay.split()
    replayed = user_repo.runpytest("-p", "no:cacheprovider", *replay.split()[2:])  # after "replay: pytest"
    replayed.assert_outcomes(failed=1)
    assert shrunk in replayed.stdout.lines  # the same minimal example


SAMPLED = ["--specaudit-temperature", "0.7", "--specaudit-top-k", "8", "--specaudit-no-adversarial",
           "--specaudit-max-examples", "2"]


def test_a_correct_engine_passes_the_sampled_test_beside_the_greedy_one(user_repo: pytest.Pytester) -> None:
    args = [arg if arg != "tiny-gpt2" else "tiny-llama" for arg in ARGS]
    result = user_repo.runpytest("--specaudit-engine", "eqspec", *args, *SAMPLED, "-k", "specaudit-sampled")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*specaudit equivalence*", "*eqspec*sampled 1/1 pairs pass*no departure found*"])


def test_a_biased_sampler_fails_the_sampled_test_with_its_finding_and_seed(user_repo: pytest.Pytester) -> None:
    """The bonus token drawn from the draft: caught at 300 samples (tests/test_sampling_audit.py), the message
    in words, the seed and the command that draws the same samples again."""
    args = [arg if arg != "tiny-gpt2" else "tiny-llama" for arg in ARGS]
    result = user_repo.runpytest("--specaudit-engine", "sample_engines:make_sampled_bonus_from_draft", *args,
                                 *SAMPLED, "-k", "specaudit-sampled", "--specaudit-seed", "3")
    result.assert_outcomes(failed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*departs from the target's distribution*p = *",
                                 "seed: 3 (--specaudit-seed)",
                                 "replay: pytest -k specaudit-sampled --specaudit-engine "
                                 "sample_engines:make_sampled_bonus_from_draft*--specaudit-seed 3*--specaudit-temperature 0.7*",
                                 "*DEPARTS*"])


def test_a_greedy_only_engine_fails_the_sampled_test_in_one_line(user_repo: pytest.Pytester) -> None:
    result = user_repo.runpytest("--specaudit-engine", "bsp", *ARGS, *SAMPLED, "-k", "specaudit-sampled")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*bsp cannot sample*greedily only*"])


def test_a_sampled_setting_out_of_range_is_a_usage_error(user_repo: pytest.Pytester) -> None:
    result = user_repo.runpytest("--specaudit-engine", "eqspec", *ARGS, "--specaudit-temperature", "0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--specaudit-temperature 0*above 0*"])
