"""The search over workloads as one pytest test (`--specaudit-engine vllm:URL --specaudit-target DIR`), so that a
team gates a merge on it.

One test per (server engine, batch size): `specaudit audit --engine URL --target DIR --search` through the one
pipeline (`specaudit.audit(..., search=SearchSettings(...))`), its `audit.json`, reports and bundles written under
`--specaudit-out` (default: a folder of pytest's own temporary directory, printed). An in-process engine gets the
same test on each built-in pair with `--specaudit-search`. The test fails when the search has a finding (or its run
failed); the failure prints each finding's shrunk requests as sent, what told it apart, its bundle and the command
that replays it, and the command that runs the same search again.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specaudit.equivalence.cli.search_args import budget as parse_budget

DEFAULT_BUDGET = "50"
DEFAULT_SERVER_BATCH_SIZES = [4]


@dataclass(frozen=True)
class SearchTest:
    """What one search test runs (from the plugin's options)."""

    engine: str
    batch_size: int
    seed: int
    budget: str  # "50" examples, "10m" minutes
    max_new_tokens: int
    dtype: str
    out: Path
    target: str | None = None  # a server's weights folder
    pair: str | None = None  # an in-process engine's built-in pair
    prompts: str = "builtin"  # the pool fresh prompts are cut from

    def command(self) -> str:
        """The `specaudit audit` command that runs the same search."""
        words = ["specaudit", "audit", "--engine", self.engine]
        words += ["--target", self.target] if self.target else ["--pair", str(self.pair)]
        words += ["--dtype", self.dtype, "--batch-size", str(self.batch_size), "--max-new-tokens",
                  str(self.max_new_tokens), "--search", "--budget", self.budget, "--seed", str(self.seed),
                  "--out", str(self.out)]
        if self.prompts != "builtin":
            words += ["--prompts", self.prompts]
        return shlex.join(words)


class SearchFound(AssertionError):
    """The search's findings, in words (the test's failure message)."""


def check_budget(text: str) -> tuple[int | None, float | None]:
    try:
        return parse_budget(text)
    except Exception as exc:  # argparse's ArgumentTypeError: the same words as the CLI's
        raise ValueError(f"--specaudit-search-budget: {exc}") from None


def run_search(test: SearchTest) -> dict[str, Any]:
    """Run the search; the run record of `audit.json`. `SearchFound` when it found something or failed."""
    from specaudit.equivalence.api import audit
    from specaudit.equivalence.pipeline.settings import SearchSettings

    examples, minutes = check_budget(test.budget)
    options: dict[str, Any] = {
        "batch_sizes": [test.batch_size], "dtypes": [test.dtype], "max_new_tokens": test.max_new_tokens,
        "prompts": test.prompts, "search": SearchSettings(examples=examples, minutes=minutes, seed=test.seed)}
    if test.target:
        audit(test.engine, target=test.target, out=test.out, **options)
    else:
        audit(test.engine, pairs=[str(test.pair)], out=test.out, **options)
    written = json.loads((test.out / "audit.json").read_text())
    (run,) = written["runs"]
    if run.get("equivalent") and not run.get("error"):
        return run
    raise SearchFound(failure_message(run, test))


def failure_message(run: dict[str, Any], test: SearchTest) -> str:
    """Each finding: what told it apart, its shrunk requests as sent, its divergences, its bundle and replay."""
    search = run.get("search") or {}
    findings = search.get("findings") or []
    lines = [f"{test.engine}, batch size {test.batch_size}, {test.dtype}: the search found "
             f"{len(findings)} failure(s) in {search.get('examples')} examples (seed {test.seed})"]
    if not findings:
        lines.append(f"the run failed: {run.get('error')}")
    where = f"--target {shlex.quote(test.target)}" if test.target else f"--pair {test.pair}"
    for number, finding in enumerate(findings, 1):
        told = "; ".join(" ".join(x for x in sig if x) for sig in finding.get("signatures") or [])
        lines.append(f"finding {number}: {told} after {finding.get('found_after')} examples, shrunk to "
                     f"{finding.get('requests')} request(s) in waves {finding.get('waves')}")
        bundle_path = test.out / finding["bundle"] if finding.get("bundle") else None
        if bundle_path is not None and bundle_path.is_file():
            bundle = json.loads(bundle_path.read_text())
            for index, request in enumerate(bundle["requests"]):
                lines.append(f"  request {index} ({request.get('arrival')}): prompt_ids {request['prompt_ids']} "
                             f"params {json.dumps(request.get('params') or {})}")
                lines.append(f"    engine    {bundle['engine_outputs'][index]}")
                lines.append(f"    reference {bundle['reference_outputs'][index]}")
            for d in bundle.get("divergences") or []:
                diagnosis = d.get("diagnosis") or {}
                lines.append(f"  request {d.get('prompt_index')} at new token {d.get('position')}: {d.get('kind')} "
                             f"{diagnosis.get('class')}: {diagnosis.get('evidence')}")
            lines.append(f"  replay: specaudit replay {shlex.quote(str(bundle_path))} --engine {test.engine} {where}")
    lines.append(f"the same search again: {test.command()}")
    lines.append(f"report: {test.out / 'search.md'}")
    return "\n".join(lines)
