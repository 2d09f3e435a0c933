"""Issue 58, "what it must show": `specaudit audit` promises the same through each of its four doors.

The doors: greedy (an engine against the in-process reference, `--pair`), served reference
(`--reference ENGINE`, no weights), sampled (`--temperature` with `--pair`/`--target`) and sampled served
(`--temperature 1 --reference vllm:URL`). Everything here goes through the command line and `audit.json`:

1. a hung server with `--timeout 5` ends the audit in exit 1 within the timeout plus a margin, by itself,
   with the failed run recorded and no traceback; a hung served reference ends it with one line naming it.
   These run the command in a child process (`python -m specaudit audit`) under a wall-clock limit and kill
   its process group however the test ends: the failure they catch is a process that never exits;
2. a recording is audited on its own prompts (not the built-in set) through every door;
3. a served audit writes report.html (rendered in headless Chromium) and its divergences carry the greedy
   schema's `diagnosis`, its band the greedy schema's `noise_band`.

The limit of part 1: `--timeout` + the time a complete audit of a recording takes on this machine through
the same command (`loading_s`: starting Python, importing torch and transformers, building tiny-llama and
decoding its reference; measured once per session, about 6-12 s on 2 shared cores) + a slack of as much
again (at least 10 s). A process held by an abandoned request (the HTTP client's 300 s socket timeout) or a
door that ignores `--timeout` runs far past it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from cli_run import audit
from fake_server import FakeServer
from hung_server import HungServer
from served_lm import EOS as TOY_EOS
from served_lm import ToyLM, server_answer, vllm_answer
from specaudit.engines.models import zoo

TIMEOUT_S = 5
AUDIT_COMMAND = (sys.executable, "-m", "specaudit", "audit")
HUNG_OPTIONS = ("--timeout", str(TIMEOUT_S), "--no-progress", "--no-adversarial", "--num-prompts", "2",
                "--max-new-tokens", "4")


# ---- the command in a child process, under a wall-clock limit ---------------------------------------------

@dataclass
class Ended:
    exited: bool  # it exited by itself before the wall-clock limit (else it was killed there)
    returncode: int | None
    seconds: float
    stdout: str
    stderr: str

    def __str__(self) -> str:
        how = f"exit {self.returncode}" if self.exited else "still running: killed"
        return (f"{how} after {self.seconds:.1f} s\n--- stdout (end) ---\n{self.stdout[-2500:]}\n"
                f"--- stderr (end) ---\n{self.stderr[-2500:]}")


def run_audit_process(args: list[str], out: Path, wall_s: float) -> Ended:
    """`python -m specaudit audit ARGS --out OUT` in its own process group, killed at `wall_s` and whenever the
    test ends before it does."""
    command = [*AUDIT_COMMAND, *args, "--out", str(out)]
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    exited = False
    try:
        try:
            stdout, stderr = process.communicate(timeout=wall_s)
            exited = True
        except subprocess.TimeoutExpired:
            pass
    finally:
        seconds = time.monotonic() - started
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not exited:
            stdout, stderr = process.communicate()
    return Ended(exited, process.returncode if exited else None, seconds, stdout, stderr)


def _tiny_llama_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts of byte ids (3..249) that the built-in prompt set does not hold."""
    rng = random.Random(seed)
    builtin = {tuple(p) for p in zoo.builtin_prompts()}
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(4, 10))] for _ in range(count)]
    assert not builtin & {tuple(p) for p in prompts}
    return prompts


def _write_lines(path: Path, prompts: list[list[int]], outputs: list[list[int]], **extra: Any) -> Path:
    """A recording (`recorded:FILE`): one JSON line per prompt and output, in the documented format."""
    path.write_text("".join(json.dumps({"prompt_ids": [int(t) for t in p], "output_ids": [int(t) for t in o],
                                        **extra}) + "\n" for p, o in zip(prompts, outputs, strict=True)))
    return path


@pytest.fixture(scope="session")
def greedy_recording(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """tiny-llama's greedy outputs (the project's reference decoder, float64) on 3 prompts outside the built-in
    set, 8 new tokens each."""
    from specaudit.engines.reference import ReferenceDecoder

    pair = zoo.load_pair("tiny-llama")
    prompts = _tiny_llama_prompts(3, seed=58)
    outputs = ReferenceDecoder(pair.target).generate(prompts, 8, pair.eos_token_id)
    path = _write_lines(tmp_path_factory.mktemp("greedy") / "greedy.jsonl", prompts, outputs)
    return path, prompts


@pytest.fixture(scope="session")
def loading_s(greedy_recording, tmp_path_factory) -> float:
    """Seconds a complete greedy audit of a 3-prompt recording takes through `python -m specaudit audit` here:
    what a hung run costs besides its `--timeout`."""
    path, _ = greedy_recording
    ended = run_audit_process(["--engine", f"recorded:{path}", "--pair", "tiny-llama", "--max-new-tokens", "8",
                               "--no-progress"], tmp_path_factory.mktemp("loading") / "out", wall_s=300)
    assert ended.exited and ended.returncode == 0, str(ended)
    return ended.seconds


def _limit(loading: float) -> float:
    return TIMEOUT_S + loading + max(10.0, loading)


# ---- 1. a hung server on every door -----------------------------------------------------------------------

def _toy_prompts_file(folder: Path, count: int = 2) -> Path:
    rng = random.Random(52)
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input_ids": [rng.randrange(0, 250) for _ in range(rng.randrange(3, 9))]})
                            + "\n" for _ in range(count)))
    return path


def _toy_greedy_recording(folder: Path, prompts: list[list[int]], max_new: int, lm: ToyLM | None = None,
                          top: int = 0) -> tuple[Path, list[list[int]], list[list[dict[int, float]]]]:
    """The toy model's greedy outputs on `prompts` as a recording (with the top `top` log-probabilities)."""
    lm = lm or ToyLM()
    outputs, tops = [], []
    for prompt in prompts:
        tokens, entries = [], []
        for _ in range(max_new):
            lps = lm.logprobs(prompt + tokens)
            order = sorted(range(len(lps)), key=lambda t: -lps[t])
            entries.append({t: lps[t] for t in order[:top]})
            tokens.append(order[0])
            if tokens[-1] == TOY_EOS:
                break
        outputs.append(tokens)
        tops.append(entries)
    path = folder / "reference.jsonl"
    with path.open("w") as handle:
        for prompt, output, entries in zip(prompts, outputs, tops):
            line: dict[str, Any] = {"prompt_ids": prompt, "output_ids": output}
            if top:
                line["top_logprobs"] = [{str(k): v for k, v in e.items()} for e in entries]
            handle.write(json.dumps(line) + "\n")
    return path, outputs, tops


def _prompts_of(path: Path) -> list[list[int]]:
    return [json.loads(line)["input_ids"] for line in path.read_text().splitlines()]


def _audit_json(out: Path) -> dict[str, Any]:
    path = out / "audit.json"
    assert path.is_file(), f"no audit.json in {out}"
    return json.loads(path.read_text())


def _errors(node: Any) -> Iterator[str]:
    """Every non-empty `error` anywhere in audit.json."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "error" and isinstance(value, str) and value:
                yield value
            else:
                yield from _errors(value)
    elif isinstance(node, list):
        for value in node:
            yield from _errors(value)


def _assert_ended_in_time(ended: Ended, limit: float, loading: float) -> None:
    assert ended.exited, (f"the audit did not exit within {limit:.0f} s (--timeout {TIMEOUT_S} + loading "
                          f"{loading:.1f} s + slack):\n{ended}")
    assert ended.returncode == 1, str(ended)
    assert ended.seconds <= limit, str(ended)
    assert "Traceback" not in ended.stderr + ended.stdout, str(ended)


def _assert_hung_engine_recorded(out: Path, engine: str, ended: Ended) -> None:
    data = _audit_json(out)
    assert data["complete"], "audit.json does not say the audit finished"
    runs = [run for run in data["runs"] if run["engine"] == engine]
    assert runs, f"no run of {engine} in audit.json: {[run['engine'] for run in data['runs']]}"
    for run in runs:
        assert run.get("failed") is True and not run["equivalent"], run
        error = run.get("error") or ""
        assert error and "\n" not in error, run
        assert "timeout" in error.lower(), f"the failed run's error does not say it timed out: {error}"


def _assert_hung_reference_one_line(out: Path, reference: str, ended: Ended) -> None:
    """The one line is on stderr (where a failed run's line and a usage error go), names the reference by its URL
    and says it is the reference; audit.json records the failure in an `error` that names it too (wherever the
    schema keeps the reference's failure)."""
    lines = [line for line in ended.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"a hung reference should end the audit with one line on stderr:\n{ended}"
    assert reference in lines[0] and "reference" in lines[0], lines[0]
    data = _audit_json(out)
    assert data["complete"], "audit.json does not say the audit finished"
    named = [error for error in _errors(data) if reference in error]
    assert named, f"no error in audit.json names the reference {reference}: {list(_errors(data))}"
    assert all("\n" not in error for error in named)


def test_greedy_door_a_hung_server_is_a_failed_run_and_the_process_exits(tmp_path, loading_s):
    limit = _limit(loading_s)
    with HungServer() as server:
        engine = f"vllm:{server.url}"
        ended = run_audit_process(["--engine", engine, "--pair", "tiny-llama", *HUNG_OPTIONS], tmp_path / "out",
                                  wall_s=limit)
        assert server.held, "the hung server was never asked for a completion"
    _assert_ended_in_time(ended, limit, loading_s)
    _assert_hung_engine_recorded(tmp_path / "out", engine, ended)


def test_served_door_a_hung_engine_is_a_failed_run_and_the_process_exits(tmp_path, loading_s):
    prompts = _prompts_of(_toy_prompts_file(tmp_path))
    reference, _, _ = _toy_greedy_recording(tmp_path, prompts, 4)
    limit = _limit(loading_s)
    with HungServer() as server:
        engine = f"vllm:{server.url}"
        ended = run_audit_process(["--engine", engine, "--reference", f"recorded:{reference}", "--eos-token-id",
                                   str(TOY_EOS), *HUNG_OPTIONS], tmp_path / "out", wall_s=limit)
        assert server.held, "the hung server was never asked for a completion"
    _assert_ended_in_time(ended, limit, loading_s)
    _assert_hung_engine_recorded(tmp_path / "out", engine, ended)


def test_served_door_a_hung_reference_ends_the_audit_in_one_line(tmp_path, loading_s):
    prompts = _prompts_of(_toy_prompts_file(tmp_path))
    engine, _, _ = _toy_greedy_recording(tmp_path, prompts, 4)
    limit = _limit(loading_s)
    with HungServer() as server:
        ended = run_audit_process(["--engine", f"recorded:{engine}", "--reference", f"vllm:{server.url}",
                                   "--eos-token-id", str(TOY_EOS), *HUNG_OPTIONS], tmp_path / "out", wall_s=limit)
        assert server.held, "the hung reference was never asked for a completion"
    _assert_ended_in_time(ended, limit, loading_s)
    _assert_hung_reference_one_line(tmp_path / "out", server.url, ended)


def test_sampled_door_a_hung_server_is_a_failed_run_and_the_process_exits(tmp_path, loading_s):
    limit = _limit(loading_s)
    with HungServer() as server:
        engine = f"vllm:{server.url}"
        ended = run_audit_process(["--temperature", "1", "--samples", "4", "--pair", "tiny-llama", "--engine", engine,
                                   *HUNG_OPTIONS], tmp_path / "out", wall_s=limit)
        assert server.held, "the hung server was never asked for a completion"
    _assert_ended_in_time(ended, limit, loading_s)
    _assert_hung_engine_recorded(tmp_path / "out", engine, ended)


def test_sampled_served_door_a_hung_engine_is_a_failed_run_and_the_process_exits(tmp_path, loading_s):
    prompts = _toy_prompts_file(tmp_path)
    limit = _limit(loading_s)
    with HungServer() as server, FakeServer(server_answer(ToyLM())) as plain:
        engine = f"vllm:{server.url}"
        ended = run_audit_process(["--temperature", "1", "--samples", "4", "--engine", engine, "--reference",
                                   f"vllm:{plain.url}", "--prompts", str(prompts), "--eos-token-id", str(TOY_EOS),
                                   *HUNG_OPTIONS], tmp_path / "out", wall_s=limit)
        assert server.held, "the hung server was never asked for a completion"
    _assert_ended_in_time(ended, limit, loading_s)
    _assert_hung_engine_recorded(tmp_path / "out", engine, ended)


def test_sampled_served_door_a_hung_reference_ends_the_audit_in_one_line(tmp_path, loading_s):
    prompts = _toy_prompts_file(tmp_path)
    limit = _limit(loading_s)
    with HungServer() as server, FakeServer(server_answer(ToyLM())) as spec:
        ended = run_audit_process(["--temperature", "1", "--samples", "4", "--engine", f"vllm:{spec.url}",
                                   "--reference", f"vllm:{server.url}", "--prompts", str(prompts), "--eos-token-id",
                                   str(TOY_EOS), *HUNG_OPTIONS], tmp_path / "out", wall_s=limit)
        assert server.held, "the hung reference was never asked"
    _assert_ended_in_time(ended, limit, loading_s)
    _assert_hung_reference_one_line(tmp_path / "out", server.url, ended)


# ---- 2. a recording is audited on its own prompts through every door --------------------------------------

def _one_run(out: Path) -> dict[str, Any]:
    data = _audit_json(out)
    assert len(data["runs"]) == 1, [run["engine"] for run in data["runs"]]
    return data["runs"][0]


def test_greedy_door_audits_a_recording_on_its_own_prompts(tmp_path, greedy_recording):
    path, prompts = greedy_recording
    result = audit("--engine", f"recorded:{path}", "--pair", "tiny-llama", "--max-new-tokens", "8", out=tmp_path)
    assert result.returncode == 0, result
    run = _one_run(tmp_path)
    assert not run.get("error"), run["error"]
    # the file's 3 prompts, none of them built in, and nothing else (no built-in or adversarial prompt)
    assert run["num_prompts"] == len(prompts) == len(path.read_text().splitlines())
    assert run["exact_matches"] == len(prompts) and len(run["prompts"]) == len(prompts)


def test_served_door_audits_recordings_on_their_own_prompts(tmp_path):
    prompts = [[11, 200, 7, 93], [5, 5, 140], [249, 0, 18, 60, 2]]  # no prompts file, no tokenizer: the file's
    reference, _, _ = _toy_greedy_recording(tmp_path, prompts, 6, top=3)
    engine = tmp_path / "engine.jsonl"
    engine.write_text(reference.read_text())
    result = audit("--engine", f"recorded:{engine}", "--reference", f"recorded:{reference}", "--eos-token-id",
                   str(TOY_EOS), "--max-new-tokens", "6", out=tmp_path / "out")
    assert result.returncode == 0, result
    data = _audit_json(tmp_path / "out")
    run = _one_run(tmp_path / "out")
    assert not run.get("error"), run["error"]
    assert data["num_prompts"] == run["num_prompts"] == len(prompts)
    assert run["exact_matches"] == len(prompts)


def _sample(model: torch.nn.Module, prompt: list[int], max_new: int, eos: int, generator: torch.Generator
            ) -> list[int]:
    """One sample of `model` at temperature 1 (float64 softmax of its last logits), up to EOS (kept)."""
    tokens: list[int] = []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1].to(torch.float64)
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
            tokens.append(token)
            if token == eos:
                break
    return tokens


def _sampled_recording(path: Path, model: torch.nn.Module, prompts: list[list[int]], per_prompt: int, max_new: int,
                       eos: int) -> Path:
    """`per_prompt` samples of each prompt, one line each, the prompt repeated: the sampled door's recording."""
    generator = torch.Generator().manual_seed(58)
    lines = [(prompt, _sample(model, prompt, max_new, eos, generator)) for _ in range(per_prompt) for prompt in prompts]
    return _write_lines(path, [p for p, _ in lines], [o for _, o in lines])


def _assert_sampled_on_the_files_prompts(result, out: Path, prompts: list[list[int]], lines: int) -> None:
    assert result.returncode in (0, 1), result  # by its statistics; never bad usage
    assert "built-in prompt set" not in result.stderr, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    data = _audit_json(out)
    run = _one_run(out)
    assert run["mode"] == "sampled" and not run.get("failed") and not run.get("error"), run.get("error")
    assert run["num_prompts"] == len(prompts), "the run's prompts are not the recording's"
    assert data["config"]["num_prompts"] == len(prompts)
    assert run["sampled"]["samples"] == lines


def test_sampled_door_audits_a_recording_on_its_own_prompts(tmp_path):
    pair = zoo.load_pair("tiny-llama")
    prompts = _tiny_llama_prompts(3, seed=59)
    path = _sampled_recording(tmp_path / "samples.jsonl", pair.target, prompts, per_prompt=10, max_new=4,
                              eos=pair.eos_token_id)
    result = audit("--temperature", "1", "--engine", f"recorded:{path}", "--pair", "tiny-llama", "--samples", "30",
                   "--max-new-tokens", "4", out=tmp_path / "out")
    _assert_sampled_on_the_files_prompts(result, tmp_path / "out", prompts, 30)


SMALL_VOCAB = 48  # below the byte ids of the built-in prompts (97 is "a")


@pytest.fixture(scope="session")
def small_vocab_target(tmp_path_factory) -> Path:
    """A tiny Llama of 48 token ids (pad 0, BOS 1, EOS 2), seeded, saved as safetensors without a tokenizer: a
    user's model whose vocabulary the built-in prompts do not fit."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=SMALL_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(48)
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    folder = tmp_path_factory.mktemp("small-vocab") / "target"
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def test_sampled_door_audits_a_recording_on_its_own_prompts_for_a_small_vocabulary(tmp_path, small_vocab_target):
    """The regression of issue 58: the sampled door read the built-in prompt set instead of the recording's and
    ended in exit 2 ("the built-in prompt set, prompt 1: token id 97 is outside the model's vocabulary (0..47)")."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(small_vocab_target, dtype=torch.float64).eval()
    prompts = [[1, 17, 30, 5], [1, 44, 9], [1, 23, 23, 40, 12]]
    path = _sampled_recording(tmp_path / "samples.jsonl", model, prompts, per_prompt=10, max_new=4, eos=2)
    result = audit("--temperature", "1", "--engine", f"recorded:{path}", "--target", str(small_vocab_target),
                   "--samples", "30", "--max-new-tokens", "4", out=tmp_path / "out")
    _assert_sampled_on_the_files_prompts(result, tmp_path / "out", prompts, 30)


def test_sampled_served_door_audits_a_recording_on_its_own_prompts(tmp_path):
    """`--temperature 1 --engine recorded:FILE --reference vllm:URL`: the recording's samples (the toy model's,
    drawn at temperature 1) teacher-forced through the reference on the file's own prompts."""
    lm = ToyLM()
    prompts = [[11, 200, 7, 93], [5, 5, 140], [249, 0, 18, 60, 2]]
    lines = []
    for i in range(30):
        answer = vllm_answer(lm, {"prompt": prompts[i % 3], "max_tokens": 6, "temperature": 1.0, "seed": 1000 + i,
                                  "stop_token_ids": [TOY_EOS]})
        lines.append((prompts[i % 3], answer["choices"][0]["token_ids"]))
    path = _write_lines(tmp_path / "samples.jsonl", [p for p, _ in lines], [o for _, o in lines])
    with FakeServer(server_answer(lm)) as plain:
        result = audit("--temperature", "1", "--engine", f"recorded:{path}", "--reference", f"vllm:{plain.url}",
                       "--eos-token-id", str(TOY_EOS), "--samples", "30", "--max-new-tokens", "6",
                       out=tmp_path / "out")
    _assert_sampled_on_the_files_prompts(result, tmp_path / "out", prompts, 30)
    forced = [body["prompt"] for _, body in plain.requests if body.get("prompt_logprobs")]
    assert forced, "nothing was teacher-forced through the reference"
    assert all(any(p == prompt[: len(p)] for p in prompts) for prompt in forced)
    assert all(any(prompt[: len(p)] == p for prompt in forced) for p in prompts)


# ---- 3. the served audit's report and divergences ---------------------------------------------------------

SERVED_MAX_NEW = 12


@pytest.fixture
def served_audit_out(tmp_path) -> Path:
    """A served-reference audit of two recordings of the toy model: the engine's differs from the reference's at
    prompt 2, new token 5, where it took the reference's third most likely token (a structural flip that only
    the weights could name)."""
    prompts = [[17, 3, 101, 40], [250, 12, 9], [66, 66, 7, 130, 8], [1, 2, 3]]
    reference, outputs, tops = _toy_greedy_recording(tmp_path, prompts, SERVED_MAX_NEW, top=3)
    assert len(outputs[2]) > 6, "the premise: prompt 2's reference output reaches new token 5"
    altered = [list(o) for o in outputs]
    altered[2][5] = sorted(tops[2][5], key=lambda t: -tops[2][5][t])[2]
    altered[2] = altered[2][:6]
    engine = _write_lines(tmp_path / "engine.jsonl", prompts, altered)
    out = tmp_path / "out"
    result = audit("--engine", f"recorded:{engine}", "--reference", f"recorded:{reference}", "--eos-token-id",
                   str(TOY_EOS), "--max-new-tokens", str(SERVED_MAX_NEW), out=out)
    assert result.returncode == 1, result
    return out


def test_a_served_audit_writes_report_html_and_its_divergences_have_the_greedy_diagnosis(served_audit_out):
    out = served_audit_out
    assert (out / "report.md").is_file() and (out / "report.html").is_file()
    run = _one_run(out)
    assert run["divergences"], "the planted flip is not in audit.json"
    for divergence in run["divergences"]:
        assert divergence["kind"] in ("structural", "numerical"), divergence
        diagnosis = divergence.get("diagnosis")
        assert isinstance(diagnosis, dict), f"no diagnosis (the greedy schema's) in {divergence}"
        assert {"class", "evidence", "named_by"} <= set(diagnosis), diagnosis
        assert isinstance(diagnosis.get("needs_weights"), bool), f"a served ruling says needs_weights: {diagnosis}"
    [flip] = [d for d in run["divergences"] if d["kind"] == "structural"]
    assert (flip["prompt_index"], flip["position"]) == (2, 5)
    assert flip["diagnosis"]["needs_weights"] is True  # no weights in the process: the cause cannot be named
    # one name for the noise band: the greedy schema's
    assert "noise_band" in run and "band" not in run, sorted(run)
    html = (out / "report.html").read_text(encoding="utf-8")
    assert "engine.jsonl" in html and "reference.jsonl" in html
    assert "determinism" in html.lower(), "the served audit's determinism line is not in report.html"


@pytest.mark.browser
def test_served_report_renders_in_headless_chromium(served_audit_out, tmp_path):
    from html import unescape as unescape_html
    import re

    import numpy as np

    from test_report import LAYOUT_PROBE, _png_pixels, _run_chromium

    html_path = served_audit_out / "report.html"
    assert html_path.is_file(), "the served audit wrote no report.html"
    html = html_path.read_text(encoding="utf-8")
    for external in ("<script", "<link", "src=", "@import"):
        assert external not in html, f"report.html is not self-contained: found {external!r}"
    probe_path = served_audit_out / "layout-probe.html"
    probe_path.write_text(html.replace("</body>", LAYOUT_PROBE + "</body>"), encoding="utf-8")
    dumped = _run_chromium(tmp_path / "profile", "--dump-dom", probe_path.as_uri()).stdout
    match = re.search(r'<pre id="layout-probe">(.*?)</pre>', dumped, re.S)
    assert match, "the layout probe did not run"
    layout = json.loads(unescape_html(match.group(1)))
    assert layout["scripts"] == 1, "report.html put a script element into the page"
    for chart in layout["charts"]:
        size = f"{chart['width']}x{chart['height']}"
        assert chart["width"] > 300 and chart["height"] > 100, f"{chart['label']} laid out at {size}"
    text = unescape_html(re.sub(r"<[^>]+>", " ", dumped))
    assert "engine.jsonl" in text and "structural" in text.lower() and "determinism" in text.lower()
    screenshot = tmp_path / "report.png"
    _run_chromium(tmp_path / "profile", f"--screenshot={screenshot}", html_path.as_uri(), window="1280,1400")
    pixels = _png_pixels(screenshot.read_bytes())[..., :3].reshape(-1, 3)
    colors, counts = np.unique(pixels, axis=0, return_counts=True)
    assert len(colors) > 20 and counts.max() < 0.98 * len(pixels), "the screenshot is blank"
