"""The search as one pytest test (equivalence/plugin/search.py): `--specaudit-engine vllm:URL --specaudit-target
DIR` against a fake vLLM that decodes with the table model of tests/wild_models.py, run by pytester as a user's CI
runs it (in a process of its own). A planted stop-string bug (a stop completed inside a burst keeps the burst's tail, vllm #47616) fails the
test with the shrunk requests, the bundle and the commands that replay it; the correct server passes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from fake_server import FakeServer
from request_server import vllm_answer
from transformers import AutoModelForCausalLM, AutoTokenizer

import wild_models as wm

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def table():
    pair = wm.table_pair()
    model = AutoModelForCausalLM.from_pretrained(str(pair.target), torch_dtype=torch.float64).eval()
    return pair.target, model, AutoTokenizer.from_pretrained(str(pair.target))


def _run(pytester: pytest.Pytester, url: str, target: Path, out: Path, *extra: str) -> pytest.RunResult:
    pytester.makepyfile(test_own="def test_own():\n    assert True\n")
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "--specaudit-engine", f"vllm:{url}",
                              f"--specaudit-target={target}", "--specaudit-search-budget", "25", "--specaudit-max-new-tokens", "12",
                              "--specaudit-seed", "1", "--specaudit-out", str(out), *extra)


def test_a_planted_stop_bug_fails_the_search_test_with_its_reproducer(pytester, table, tmp_path):
    target, model, tokenizer = table
    with FakeServer(vllm_answer(model, tokenizer, wm.EOS, "stop_tail")) as server:
        result = _run(pytester, server.url, target, tmp_path / "out")
    result.assert_outcomes(passed=1, failed=1)
    text = result.stdout.str()
    assert re.search(r"finding \d: stop_string after \d+ examples, shrunk to [123] request", text), text
    result.stdout.fnmatch_lines(["*request 0 (*): prompt_ids [[]*[]] params {*\"stop\"*",
                                 "*replay: specaudit replay *search-*-?.json --engine vllm:http*--target *",
                                 "*the same search again: specaudit audit --engine vllm:http* --search --budget 25 "
                                 "--seed 1 *", "seed: 1 (--specaudit-seed)"])
    bundles = list((tmp_path / "out").glob("*/bundles/search-*.json"))
    assert bundles and all(str(b) in text for b in bundles), text


def test_the_correct_server_passes_the_search_test(pytester, table, tmp_path):
    target, model, tokenizer = table
    with FakeServer(vllm_answer(model, tokenizer, wm.EOS)) as server:
        result = _run(pytester, server.url, target, tmp_path / "out")
    result.assert_outcomes(passed=2)
    (search_md,) = (tmp_path / "out").glob("*/search.md")
    assert "no finding" in search_md.read_text()


def test_a_server_engine_needs_its_weights(pytester):
    pytester.makepyfile(test_own="def test_own():\n    assert True\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--specaudit-engine", "vllm:http://127.0.0.1:9")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--specaudit-target DIR*"])
