"""Hybrid and recurrent models served by llama.cpp with draft-model speculation: what happens.

For each family of tests/hybrid_models.py and each server configuration (f32 KV caches with flash
attention off; llama.cpp's defaults), this starts the server of tests/llamacpp_models.py (target +
draft, `--spec-type draft-simple`, up to 4 draft tokens, `-np 4`), then

1. runs `specaudit audit --engine llamacpp:URL --target HF --dtype float32 --batch-size 4` and keeps
   its exit status and its last lines;
2. sends the built-in prompts itself, 4 at a time (specaudit's own llama.cpp client), and compares
   each answer with `transformers` greedy decoding of the same float32 HF target, one prompt at a
   time (`model.generate`, no sampling). At a first divergence it replays the target in float64 on
   the common prefix and records the top-2 margin there;
3. reads `/metrics` (draft tokens, accepted tokens, busy slots per decode).

    python tests/hybrid_servers.py [FAMILY ...] [--configs NAME ...] [--num-prompts N] [--out FILE.json]

The audit runs the first N built-in prompts plus its adversarial ones; the own comparison the first N.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import hybrid_models as hm
import llamacpp_models as lm

MAX_NEW_TOKENS = 32
BATCH_SIZE = 4
EOS = hm.VOCAB["eos_token_id"]
METRICS = ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total", "n_busy_slots_per_decode",
           "n_decode_total")
CONFIGS = {"f32-cache-fa-off": lm.EXACT_ARGS, "defaults": []}


def reference_outputs(hf_target: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers greedy decoding in float32, one prompt at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_target, dtype=torch.float32).eval()
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS,
                                 do_sample=False, eos_token_id=EOS, pad_token_id=hm.VOCAB["pad_token_id"])
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def float64_margin(hf_target: Path, prefix: list[int]) -> tuple[float, list[int]]:
    """The float64 target's top-2 logit margin after `prefix`, and its top-2 ids."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_target, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prefix])).logits[0, -1]  # [V]
    top = torch.topk(logits, 2)
    return float(top.values[0] - top.values[1]), top.indices.tolist()


def compare(hf_target: Path, prompts, served, reference) -> dict:
    exact, divergences = 0, []
    for index, (prompt, got, want) in enumerate(zip(prompts, served, reference)):
        if got == want:
            exact += 1
            continue
        position = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        margin, top2 = float64_margin(hf_target, prompt + want[:position])
        divergences.append({"prompt_index": index, "position": position,
                            "reference_token": want[position] if position < len(want) else None,
                            "engine_token": got[position] if position < len(got) else None,
                            "float64_margin": round(margin, 6), "float64_top2": top2})
    return {"exact": exact, "num_prompts": len(prompts), "divergences": divergences}


def audit_cli(url: str, hf_target: Path, out: Path, num_prompts: int) -> dict:
    command = [sys.executable, "-m", "specaudit", "audit", "--engine", f"llamacpp:{url}", "--target", str(hf_target),
               "--dtype", "float32", "--batch-size", str(BATCH_SIZE), "--max-new-tokens", str(MAX_NEW_TOKENS),
               "--num-prompts", str(num_prompts), "--no-progress", "--out", str(out)]
    start = time.monotonic()
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
    result = {"command": " ".join(command[1:]), "exit": done.returncode, "seconds": round(time.monotonic() - start),
              "last_lines": [line for line in done.stdout.strip().splitlines() if "falling back" not in line][-6:]}
    audit_json = out / "audit.json"
    if audit_json.is_file():
        runs = json.loads(audit_json.read_text())["runs"]
        result["runs"] = [{key: run.get(key) for key in ("num_prompts", "exact_matches", "error")}
                          | {"divergences": [{key: d.get(key) for key in ("prompt_index", "position", "kind")}
                                             | {"class": (d.get("diagnosis") or {}).get("class")}
                                             for d in run.get("divergences", [])]} for run in runs]
    return result


def run_family(result: dict, work: Path, configs: list[str], num_prompts: int, save) -> None:
    """Fill `result` ({"family": ...}) in place, calling `save()` after each step."""
    from specaudit.engines.adapters.servers import LlamaCppEngine
    from specaudit.equivalence.prompts import load_prompts

    llama_dir = lm.llama_cpp_dir()
    family = result["family"]
    result["server"] = lm.build_info(llama_dir)
    try:
        pair = hm.hybrid_pair(llama_dir, family)
    except Exception as error:
        result["conversion_error"] = str(error)[-2000:]
        return
    prompts = load_prompts("builtin", None, num_prompts)
    reference = reference_outputs(pair.hf_target, prompts)
    for name in configs:
        args = CONFIGS[name]
        entry: dict = {}
        result["configs"][name] = entry
        log = work / f"{family}-{name}.log"
        try:
            with lm.LlamaServer(llama_dir, pair, args, log) as server:
                entry["server_command"] = " ".join(server.command)
                entry["audit"] = audit_cli(server.url, pair.hf_target, work / f"{family}-{name}-audit", num_prompts)
                metrics = server.metrics()
                entry["metrics_after_audit"] = {key: metrics.get(key) for key in METRICS}
                save()
                start = time.monotonic()
                served = LlamaCppEngine(server.url, batch_size=BATCH_SIZE).generate(prompts, MAX_NEW_TOKENS, EOS)
                entry["generate_s"] = round(time.monotonic() - start, 2)
                metrics = server.metrics()
                entry["metrics_after_both"] = {key: metrics.get(key) for key in METRICS}
                entry["comparison"] = compare(pair.hf_target, prompts, served, reference)
                if server.process.poll() is not None:
                    entry["server_exit"] = server.process.returncode
        except Exception as error:
            entry["error"] = f"{type(error).__name__}: {str(error)[-2000:]}"
            if log.is_file():
                entry["server_log_tail"] = log.read_text(errors="replace").splitlines()[-15:]
        save()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", default=list(hm.FAMILIES))
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("hybrid-servers.json"))
    parser.add_argument("--work", type=Path, default=Path("hybrid-servers-work"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []

    def save() -> None:
        args.out.write_text(json.dumps(results, indent=1))

    for family in args.families:
        results.append({"family": family, "configs": {}})
        run_family(results[-1], args.work, args.configs, args.num_prompts, save)
        save()
        print(json.dumps(results[-1], indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
