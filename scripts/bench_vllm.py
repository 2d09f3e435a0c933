"""vLLM as the bench's anchor: the `bench` pair served by vLLM's CPU build, plain and with draft-model
speculation, timed by `specaudit bench` beside the built-in engines on the same requests.

    python scripts/bench_vllm.py --out reports/bench-vllm/run [bench options ...]

1. Writes the `bench` pair (engines/models/bench_pair.py: the 316M Qwen3-style target and its 11M
   draft, seeded) as two Hugging Face folders in float32 with the byte-level tokenizer of the
   server tests, cached under ~/.cache/specaudit/vllm-models/bench-<key>/.
2. Starts two vLLM servers of the target on 127.0.0.1 (scripts/vllm.sh's cached venv, as
   tests/vllm_models.py does): `plain`, and `draft` with
   `--speculative-config {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": K}`,
   both float32, `--max-num-seqs` = the largest batch size, prefix caching off (the built-in engines
   cache no prefixes, and a repeated prompt would find its twin's blocks).
3. Runs `specaudit bench --engine vllm:DRAFT_URL --plain-engine vllm:PLAIN_URL` plus the engines
   and options given after `--`, then stops both servers however the run ends, and writes
   OUT/servers.json (the server commands, start-up seconds) and OUT/server-logs/. servers.json also
   gives each server's CPU seconds over the whole bench (its process group's utime + stime from
   /proc, warm-up included) and the tokens it generated (`vllm:generation_tokens_total`): a CPU-clock
   view of the servers beside the bench's client wall clock.

Arguments before `--`: --out DIR (required), --draft-tokens K (4), --max-num-seqs N (8),
--max-model-len N (1024), --eager (vLLM's --enforce-eager; default: vLLM's own compilation),
--no-preload (by default the servers run with LD_PRELOAD of tcmalloc, when installed, and the
venv's Intel OpenMP `libiomp5.so`, as vLLM's CPU guide asks: without them vLLM warns that
speculative decoding on the CPU "will cause significant performance loss"; Debian:
`apt-get install libtcmalloc-minimal4`).
Arguments after `--` go to `specaudit bench` as they are (--engine, --batch-size, --num-prompts, ...).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import vllm_models as vm  # noqa: E402 (tests/ holds the server helpers)
from llamacpp_models import byte_tokenizer_files  # noqa: E402

FORMAT = "1"  # bump when the way the folders are written changes


def bench_pair_folders() -> tuple[Path, Path]:
    """(target, draft) HF folders of the `bench` pair in float32, written once and cached."""
    import torch
    import transformers

    from specaudit.engines.models import bench_pair

    digest = hashlib.sha256()
    for part in (FORMAT, json.dumps([bench_pair.TARGET_SHAPE, bench_pair.DRAFT_SHAPE, bench_pair.BENCH_SEED,
                                     bench_pair.MATRIX_STD, bench_pair.EMBEDDING_STD, bench_pair.BENCH_VOCAB_SIZE]),
                 json.dumps(byte_tokenizer_files()), torch.__version__, transformers.__version__):
        digest.update(part.encode() + b"\0")
    folder = vm.CACHE_ROOT / "vllm-models" / f"bench-{digest.hexdigest()[:16]}"
    target, draft = folder / "target", folder / "draft"
    if all((role / "model.safetensors").is_file() for role in (target, draft)):
        return target, draft
    folder.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + "."))
    try:
        pair = bench_pair.load_bench_pair("float32")
        for role, model in (("target", pair.target), ("draft", pair.draft)):
            model.save_pretrained(stage / role, safe_serialization=True)
            for name, text in byte_tokenizer_files().items():
                (stage / role / name).write_text(text)
        shutil.rmtree(folder, ignore_errors=True)
        stage.rename(folder)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return target, draft


TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")


def preload(python: Path) -> str:
    """LD_PRELOAD for vLLM's CPU worker: tcmalloc (if installed) and the venv's Intel OpenMP."""
    found = [next((lib for lib in TCMALLOC if Path(lib).is_file()), None), python.parent.parent / "lib" / "libiomp5.so"]
    return ":".join(str(lib) for lib in found if lib is not None and Path(lib).is_file())


def group_cpu_seconds(group: int) -> float:
    """utime + stime of every live process in the process group `group`: a server started with
    `start_new_session`, its engine-core and worker children included."""
    ticks = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()  # after the command name
        except OSError:  # the process ended
            continue
        if int(fields[2]) == group:  # field 5, pgrp
            ticks += int(fields[11]) + int(fields[12])  # fields 14 and 15, utime and stime
    return ticks / os.sysconf("SC_CLK_TCK")


def server_cpu(server: vm.VLLMServer) -> dict[str, float | None]:
    try:
        generated = server.metrics().get("generation_tokens_total", 0.0)
    except OSError:  # the server is gone
        generated = None
    return {"cpu_seconds": group_cpu_seconds(server.process.pid), "generation_tokens": generated}


def main(argv: list[str]) -> int:
    split = argv.index("--") if "--" in argv else len(argv)
    ours, bench_args = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--no-preload", action="store_true")
    args = parser.parse_args(ours)
    # a SIGTERM (timeout, kill) unwinds through the `finally` below, so the servers are stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from specaudit.cli import main as specaudit

    target, draft = bench_pair_folders()
    python = vm.vllm_python()
    shared = ["--dtype", "float32", "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
              "--no-enable-prefix-caching"]
    speculative = ["--speculative-config", json.dumps({"method": "draft_model", "model": str(draft),
                                                       "num_speculative_tokens": args.draft_tokens})]
    logs = args.out / "server-logs"
    logs.mkdir(parents=True, exist_ok=True)
    servers = {name: vm.VLLMServer(python, target, shared + extra, logs / f"{name}.log", startup_timeout_s=1200)
               for name, extra in (("plain", []), ("draft", speculative))}
    for server in servers.values():
        if not args.eager:
            server.command.remove("--enforce-eager")
    record = {"vllm_python": str(python), "target": str(target), "draft": str(draft), "servers": {}}
    if not args.no_preload:
        os.environ["LD_PRELOAD"] = record["LD_PRELOAD"] = preload(python)  # the servers inherit it (vm.server_env)
    try:
        started = time.monotonic()
        for server in servers.values():
            server.start()
        for server in servers.values():
            server.wait_healthy()
        print(f"servers healthy after {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        before = {name: server_cpu(server) for name, server in servers.items()}
        for name, server in servers.items():
            record["servers"][name] = {"url": server.url, "command": server.command, "healthy_after_s": server.start_s}
        (args.out / "servers.json").write_text(json.dumps(record, indent=1) + "\n")
        command = ["bench", "--engine", f"vllm:{servers['draft'].url}", "--plain-engine", f"vllm:{servers['plain'].url}",
                   "--draft-tokens", str(args.draft_tokens), "--out", str(args.out), *bench_args]
        print("specaudit " + " ".join(command), file=sys.stderr, flush=True)
        status = specaudit(command)
        for name, server in servers.items():
            record["servers"][name]["alive_after_bench"] = server.alive()
            after = server_cpu(server)
            seconds = after["cpu_seconds"] - before[name]["cpu_seconds"]
            tokens = (after["generation_tokens"] - before[name]["generation_tokens"]
                      if after["generation_tokens"] is not None else None)
            record["servers"][name]["whole_bench"] = {
                "what": "the server's process group (API server, engine core, workers), utime + stime from /proc, "
                        "and vllm:generation_tokens_total, from healthy to the end of the bench, warm-up included",
                "server_cpu_seconds": seconds, "generated_tokens": tokens,
                "tokens_per_server_cpu_second": tokens / seconds if seconds and tokens is not None else None}
    finally:
        for server in servers.values():
            server.stop()
    (args.out / "servers.json").write_text(json.dumps(record, indent=1) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
