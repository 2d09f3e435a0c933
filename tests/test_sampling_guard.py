"""The sampled audit (`specaudit audit --temperature`) behind the greedy audit's guard, on the device and
dtype it is given: engines that hang, return ids outside the vocabulary, too few outputs or floats are
failed runs with a one-line reason while the others are judged (exit 1); `--timeout` stops a hang;
`--device` and `--dtype` are honored and recorded, or refused (exit 2) with every option only the greedy
audit uses; below float64 each test is held against the rounding allowance, which keeps the
false-positive rate where a test without it would not."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from cli_run import audit, usage_error
from sampled_failing_engines import RELEASE
from specaudit import read_report
from specaudit.engines.adapters.recorded import write_recording
from specaudit.engines.models.zoo import builtin_prompts
from specaudit.equivalence.sampling import stats
from specaudit.equivalence.sampling.audit import _hold_against_rounding

# few samples: these tests are about guarding, not statistics
SMALL = ("--pair", "tiny-llama", "--temperature", "0.7", "--top-k", "8", "--samples", "20", "--num-prompts", "1",
         "--max-new-tokens", "3", "--draft-tokens", "2", "--seed", "1")


def _written(out: Path) -> dict:
    return json.loads((out / "audit.json").read_text())


def _reports(out: Path) -> dict:
    """Each sampled run's report by engine, as `specaudit.read_report(out).sampled` gives it."""
    return read_report(out).sampled


@pytest.fixture
def release_hangs():
    RELEASE.clear()
    yield
    RELEASE.set()  # the abandoned thread returns and ends


def test_failing_sampled_engines_are_failed_runs_and_the_others_are_judged(tmp_path: Path, release_hangs) -> None:
    failing = {"hangs": "did not return within 2 s (--timeout)",
               "out_of_vocabulary": "token id 262 is outside the vocabulary (0..258)",
               "one_output": "returned 1 outputs for 8 prompts",  # the first chunk of the draw (--batch-size)
               "float_tokens": "is not an integer token id",
               "one_token_too_many": "output 0 has 4 tokens, more than max_new_tokens 3",
               "goes_on_after_eos": "output 0 goes on after EOS",
               "out_of_memory": "out of memory at batch size 8 on cpu: try a smaller --batch-size"}
    engines = [arg for name in failing for arg in ("--engine", f"sampled_failing_engines:{name}")]
    result = audit(*engines, "--engine", "sampled-spec", "--timeout", "2", *SMALL, out=tmp_path)
    assert result.returncode == 1, result
    assert "Traceback" not in result.stdout + result.stderr
    written = _written(tmp_path)
    assert written["complete"] and all(run["mode"] == "sampled" for run in written["runs"])
    assert [run["engine"] for run in written["runs"]] == [*engines[1::2], "sampled-spec"]
    runs = _reports(tmp_path)
    failed_lines = [line for line in result.stderr.splitlines() if line.startswith("failed: ")]
    assert len(failed_lines) == len(failing), result.stderr
    for name, reason in failing.items():
        run = runs[f"sampled_failing_engines:{name}"]
        assert run["failed"] and run["verdict"] == "run failed"
        assert reason in run["error"] and "\n" not in run["error"], run["error"]
        assert any(line.startswith(f"failed: sampled_failing_engines:{name} tiny-llama B=8 float64: ") and reason in line
                   for line in failed_lines), failed_lines
    # the hang was given up at the time-out, not waited for
    assert 2 <= runs["sampled_failing_engines:hangs"]["seconds"] < 5
    judged = runs["sampled-spec"]
    assert judged["verdict"] == "no departure found" and judged["samples"] == 20
    assert judged["seeds"]["checked"] and judged["seeds"]["alone_equals_batch"]  # seeds= passes the guard
    # the reports beside audit.json: each engine's verdict, the failures' reasons, the judged one's PIT bars
    markdown, html = (tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text()
    assert "NOT shown to sample the target's distribution" in markdown
    for name, reason in failing.items():
        assert f"sampled_failing_engines:{name}: the run failed: " in markdown and reason in markdown
    assert "sampled-spec: no departure found in 20 samples (60 tokens)" in markdown
    drawn = sum(count > 0 for count in judged["pit_histogram"])  # an empty bin has no bar
    pit = (tmp_path / "charts" / "sampled-pit.svg").read_text()
    assert sum(judged["pit_histogram"]) == 60 and pit.count('id="bar-sampled-spec-') == drawn > 5
    assert html.count("<svg") == 2  # the PIT histogram and the departure per position, embedded
    assert "charts/sampled-pit.svg" in markdown and (tmp_path / "charts" / "sampled-pit.svg").is_file()
    assert "charts/sampled-positions.svg" in markdown and (tmp_path / "charts" / "sampled-positions.svg").is_file()


def test_a_recording_with_ids_outside_the_vocabulary_is_a_failed_run(tmp_path: Path) -> None:
    recording = tmp_path / "bad.jsonl"
    prompt = builtin_prompts()[0]
    write_recording(recording, [prompt] * 20, [[5, 7, 300]] * 20)
    result = audit("--engine", f"recorded:{recording}", *SMALL, out=tmp_path / "out")
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr
    run = _reports(tmp_path / "out")[f"recorded:{recording}"]
    assert run["failed"] and "token id 300 is outside the vocabulary" in run["error"]


def test_device_and_dtype_are_honored_and_recorded(tmp_path: Path) -> None:
    result = audit("--engine", "sampled_failing_engines:says_what_it_got", "--dtype", "bfloat16", *SMALL, out=tmp_path)
    assert result.returncode == 0, result
    written = _written(tmp_path)
    assert (written["config"]["device"], written["config"]["dtypes"]) == ("cpu", ["bfloat16"])
    assert [(run["device"], run["dtype"]) for run in written["runs"]] == [("cpu", "bfloat16")]
    assert written["config"]["teacher_forcing"] == {"device": "cpu", "dtype": "float64"}
    assert written["machine"]["torch"] == torch.__version__ and written["machine"]["transformers"]
    assert written["machine"]["device"] == "cpu"
    run = _reports(tmp_path)["sampled_failing_engines:says_what_it_got"]
    assert run["engine"] == {"target_dtype": "torch.bfloat16", "target_device": "cpu"}  # the engine got the pair so
    assert run["rounding"]["dtype"] == "bfloat16" and run["rounding"]["allowance_tv_max"] > 0
    assert all(test["rounding_tv"] >= 0 for test in run["tests"])


def test_float64_on_the_cpu_takes_no_rounding_allowance(tmp_path: Path) -> None:
    assert audit("--engine", "sampled-spec", *SMALL, out=tmp_path).returncode == 0
    run = _reports(tmp_path)["sampled-spec"]
    assert run["rounding"] is None and all(test["rounding_tv"] == 0 for test in run["tests"])


@pytest.mark.parametrize("device, fragment", [("cuda:7", "--device cuda:7"), ("nonsense", "unknown device 'nonsense'")])
def test_a_device_that_cannot_run_is_a_usage_error(tmp_path: Path, device: str, fragment: str) -> None:
    if device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    usage_error(audit("--engine", "sampled-spec", "--device", device, *SMALL, out=tmp_path), fragment)


@pytest.mark.parametrize("option", [
    ("--engine-dtype", "bfloat16"), ("--logit-tolerance", "0.1"), ("--plain-engine", "sampled-reference"),
    ("--require-speculation",), ("--pad-token-id", "0"), ("--diagnosis", "quick"), ("--diagnosis-budget", "5"),
    ("--stop", "x"), ("--stop-token-id", "3"), ("--logprobs", "2"),
])
def test_options_only_the_greedy_audit_uses_are_refused(tmp_path: Path, option: tuple[str, ...]) -> None:
    line = usage_error(audit("--engine", "sampled-spec", *option, *SMALL, out=tmp_path), option[0], "drop it")
    assert "sampled audit" in line
    assert not (tmp_path / "audit.json").exists()


@pytest.mark.parametrize("option, fragment", [(("--batch-size", "1", "4"), "once per batch size"),
                                              (("--dtype", "float32", "bfloat16"), "once per dtype"),
                                              (("--alpha", "1.5"), "between 0 and 1")])
def test_several_batch_sizes_or_dtypes_or_a_bad_alpha_are_refused(tmp_path: Path, option: tuple[str, ...],
                                                                   fragment: str) -> None:
    usage_error(audit("--engine", "sampled-spec", *option, *SMALL, out=tmp_path), option[0], fragment)


def test_a_factory_that_raises_is_a_usage_error(tmp_path: Path) -> None:
    usage_error(audit("--engine", "sampled_failing_engines:raises_when_built", *SMALL, out=tmp_path),
                "raises_when_built", "planted failure in the factory")


def _worst_case_pit(n: int, allowance: float, generator: torch.Generator) -> torch.Tensor:
    """n u's whose law departs from uniform by TV `allowance`, all of it moved from bin 19 to bin 0 of 20:
    the departure with the largest chi-square noncentrality (stats.py) that rounding of that size makes."""
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    moved = (u >= 0.95) & (torch.rand(n, generator=generator, dtype=torch.float64) < allowance / 0.05)
    return torch.where(moved, u - 0.95, u)


def test_the_rounding_allowance_keeps_the_false_positive_rate(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(3)
    allowance, n, alpha, repeats = 0.03, 4000, 0.05, 200
    held = bare = ks_held = 0
    for _ in range(repeats):
        u = _worst_case_pit(n, allowance, generator)
        test = stats.chi_square_uniform(u, 20)
        bare += test["p_value"] < alpha
        held += _hold_against_rounding(dict(test), allowance)["p_value"] < alpha
        ks_held += _hold_against_rounding(stats.ks_uniform(u), allowance)["p_value"] < alpha
    assert bare > repeats / 2  # without the allowance, rounding of this size is rejected most of the time
    assert held <= alpha * repeats * 1.5 and ks_held <= alpha * repeats * 1.5, (held, ks_held)


class _FixedLogits(torch.nn.Module):
    """A model whose logits at every position are `logits` [V] in its own dtype (rounded where it is below
    float64), whatever the ids: the premise of a near-tie built by hand, not found in one machine's rounding."""

    def __init__(self, logits: list[float], dtype: torch.dtype) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.tensor(logits, dtype=torch.float64).to(dtype), requires_grad=False)

    @property
    def device(self) -> torch.device:
        return self.table.device

    def forward(self, input_ids: torch.Tensor):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.table.expand(*input_ids.shape, -1))


def test_a_token_cut_by_less_than_the_rounding_is_no_departure_and_one_cut_by_more_is() -> None:
    """Top-k 2 with the second and third logits 0.004 apart: in bfloat16 (steps of 2^-7 near 1) the second rounds
    up to 1.0078, so the audit's own pass in the run's dtype cuts the third as float64 does, while an engine that
    rounds otherwise (another batch shape) may keep it. Kept by the processing once the logits move in its
    favour by twice the measured rounding, it is a rounding cut, not a token the target never gives. The fourth
    token, 0.5 below, is beyond any rounding: a departure."""
    from specaudit.engines.sampling.process import SamplingParams
    from specaudit.equivalence.sampling.audit import audit_samples

    logits = [2.0, 1.004, 1.0, -0.5]
    exact, rounded = _FixedLogits(logits, torch.float64), _FixedLogits(logits, torch.bfloat16)
    params = SamplingParams(temperature=1.0, top_k=2)
    prompt = [0]
    near = [(prompt, [0, 1, 2])] + [(prompt, [0, 1, 0])] * 30
    report = audit_samples(exact, near, params, run_model=rounded)
    assert report["impossible_count"] == 0 and report["rounding"]["cut_tokens"] == 1, report["impossible_tokens"]
    far = [(prompt, [0, 3, 0])] + [(prompt, [0, 1, 0])] * 30
    report = audit_samples(exact, far, params, run_model=rounded)
    assert report["impossible_count"] == 1 and report["departs"] and report["p_value"] == 0.0
    assert audit_samples(exact, near, params)["impossible_count"] == 1  # float64 on the CPU: no allowance at all

class _Counted:
    def __init__(self) -> None:
        self.updates: list[int] = []

    def update(self, n: int) -> None:
        self.updates.append(n)


def test_the_draw_in_chunks_gives_the_tokens_of_one_call_and_moves_the_bar() -> None:
    from specaudit.engines.models.zoo import load_pair
    from specaudit.engines.sampling.process import SamplingParams
    from specaudit.engines.registry import make_engine
    from specaudit.equivalence.sampling.run import draw, spread

    pair = load_pair("tiny-llama")
    engine = make_engine("sampled-spec", pair.target, pair.draft, sampling=SamplingParams(0.7, 8, 1.0), seed=4,
                         draft_tokens=2, batch_size=8)
    requests = spread(builtin_prompts()[:2], 13)
    whole, whole_offsets, _ = draw(engine, requests, 3, pair.eos_token_id, seed=4)
    bar = _Counted()
    chunked, chunked_offsets, _ = draw(engine, requests, 3, pair.eos_token_id, seed=4, chunk=5, progress=bar)
    assert chunked == whole and chunked_offsets == whole_offsets
    assert bar.updates == [5, 5, 3]


def test_the_progress_bar_counts_samples_on_stderr(tmp_path: Path) -> None:
    from cli_run import cli

    result = cli("audit", "--engine", "sampled-spec", *SMALL, "--out", str(tmp_path))
    assert result.returncode == 0, result
    shown = [int(done) for done in re.findall(r"(\d+)/20 \[", result.stderr)]
    assert shown == [0, 8, 16, 20] and "sample/s" in result.stderr, result.stderr  # chunks of --batch-size 8


def test_ctrl_c_keeps_the_finished_engines_without_a_traceback(tmp_path: Path) -> None:
    result = audit("--engine", "sampled-spec", "--engine", "sample_engines:make_interrupting", *SMALL, out=tmp_path)
    assert result.returncode == 130 and "Traceback" not in result.stdout + result.stderr
    assert "interrupted: the finished runs are kept in audit.json" in result.stderr
    assert [run["engine"] for run in _written(tmp_path)["runs"]] == ["sampled-spec"]
