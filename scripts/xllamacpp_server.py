"""llama.cpp's HTTP server, prebuilt by PyPI's `xllamacpp`, as a process that takes `llama-server` flags.

`xllamacpp.Server(params)` runs llama.cpp's own C++ server (the one `llama-server` runs: `/completion`,
`/v1/completions`, `/health`, `/metrics`, parallel slots, speculative decoding) inside the Python
process that builds it. This script builds it from the subset of `llama-server`'s command line that
specaudit's docs and tests use, prints the address it listens on, and serves until it is terminated:

    python xllamacpp_server.py -m TARGET.gguf -md DRAFT.gguf --spec-type draft-simple \\
        --spec-draft-n-max 4 --spec-draft-n-min 0 -np 4 -c 16384 -ctk f32 -ctv f32 -fa off \\
        -t 1 -tb 1 -td 1 -tbd 1 --metrics --host 127.0.0.1 --port 8080

Older wheels name the same settings differently: one `speculative.type` instead of a list (`..._DRAFT`
for draft-simple), and before b9093 no `speculative.draft` group (`speculative.mparams_dft`,
`speculative.n_max` / `n_min` / `cpuparams`) and one `hostname` (2026.4.8672 = b8672, 2026.5.9093 =
b9093); `build_params` takes whichever the installed wheel has.

Run it with the Python of a venv that has `xllamacpp` (scripts/llamacpp.sh makes one and wraps this
script as `bin/llama-server`). It imports nothing from specaudit. An unknown flag is an error, never
ignored: a flag that silently does nothing would make an audit of the wrong server.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

SPEC_TYPES = {"none": "COMMON_SPECULATIVE_TYPE_NONE", "draft-simple": "COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE",
              "ngram-simple": "COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE"}
CACHE_TYPES = {"f32": "GGML_TYPE_F32", "f16": "GGML_TYPE_F16", "bf16": "GGML_TYPE_BF16", "q8_0": "GGML_TYPE_Q8_0"}
FLASH_ATTENTION = {"on": "LLAMA_FLASH_ATTN_TYPE_ENABLED", "off": "LLAMA_FLASH_ATTN_TYPE_DISABLED",
                   "auto": "LLAMA_FLASH_ATTN_TYPE_AUTO"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("-m", "--model", required=True, help="target GGUF")
    parser.add_argument("-md", "--model-draft", help="draft GGUF (draft-model speculation)")
    parser.add_argument("--spec-type", choices=sorted(SPEC_TYPES), default="none")
    parser.add_argument("--spec-draft-n-max", type=int, help="most draft tokens per step")
    parser.add_argument("--spec-draft-n-min", type=int, help="fewest draft tokens per step")
    parser.add_argument("-np", "--parallel", type=int, default=1, help="server slots")
    parser.add_argument("-c", "--ctx-size", type=int, default=4096, help="context, split across the slots")
    parser.add_argument("-ctk", "--cache-type-k", choices=sorted(CACHE_TYPES), default="f16")
    parser.add_argument("-ctv", "--cache-type-v", choices=sorted(CACHE_TYPES), default="f16")
    parser.add_argument("-fa", "--flash-attn", choices=sorted(FLASH_ATTENTION), default="auto")
    for flag in ("-t", "-tb", "-td", "-tbd"):
        parser.add_argument(flag, type=int, default=None, dest=flag.lstrip("-"))
    parser.add_argument("--metrics", action="store_true", help="serve /metrics")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args(argv)
    if args.spec_type == "draft-simple" and not args.model_draft:
        parser.error("--spec-type draft-simple needs a draft model (-md)")
    return args


def spec_type(xlc, name: str):
    """The wheel's enum value for `--spec-type NAME` (older wheels: `..._DRAFT`, and NONE is 0)."""
    kinds = xlc.common_speculative_type
    wanted = SPEC_TYPES[name]
    if hasattr(kinds, wanted):
        return getattr(kinds, wanted)
    if name == "draft-simple" and hasattr(kinds, "COMMON_SPECULATIVE_TYPE_DRAFT"):
        return kinds.COMMON_SPECULATIVE_TYPE_DRAFT
    if name == "none":
        return 0
    raise SystemExit(f"--spec-type {name}: xllamacpp {xlc.__version__} has no {wanted}")


def build_params(args: argparse.Namespace):
    import xllamacpp as xlc

    params = xlc.CommonParams()
    # 1. models and speculation
    params.model.path = args.model
    speculative = params.speculative
    draft = getattr(speculative, "draft", speculative)  # the draft's settings: grouped from b9093 on
    kind = spec_type(xlc, args.spec_type)
    if hasattr(speculative, "types"):  # a list of types in newer wheels, one type before
        speculative.types = [kind]
    else:
        speculative.type = kind
    if args.model_draft:
        (draft.mparams if hasattr(draft, "mparams") else speculative.mparams_dft).path = args.model_draft
    if args.spec_draft_n_max is not None:
        draft.n_max = args.spec_draft_n_max
    if args.spec_draft_n_min is not None:
        draft.n_min = args.spec_draft_n_min
    # 2. slots, context, caches, attention
    params.n_parallel = args.parallel
    params.n_ctx = args.ctx_size
    params.cache_type_k = getattr(xlc.ggml_type, CACHE_TYPES[args.cache_type_k])
    params.cache_type_v = getattr(xlc.ggml_type, CACHE_TYPES[args.cache_type_v])
    params.flash_attn_type = getattr(xlc.llama_flash_attn_type, FLASH_ATTENTION[args.flash_attn])
    # 3. threads: target decode, target batch, draft decode, draft batch
    for value, cpu in ((args.t, params.cpuparams), (args.tb, params.cpuparams_batch),
                       (args.td, draft.cpuparams), (args.tbd, draft.cpuparams_batch)):
        if value is not None:
            cpu.n_threads = value
    # 4. HTTP
    params.endpoint_metrics = args.metrics
    if hasattr(params, "hostnames"):
        params.hostnames = [args.host]
    else:
        params.hostname = args.host
    params.port = args.port
    return params


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import xllamacpp as xlc

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server = xlc.Server(build_params(args))
    print(f"xllamacpp {xlc.__version__} listening on {server.listening_address}", flush=True)
    stop.wait()
    del server  # stops the HTTP server and frees the models
    return 0


if __name__ == "__main__":
    sys.exit(main())
