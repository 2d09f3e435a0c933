"""A search finding as a repro bundle, and its replay against an engine (`specaudit replay BUNDLE --engine E`).

`write_search_bundle` writes `OUT/bundles/search-<engine>-<pair>-b<batch>-<dtype>-<N>.json` (finding N): the shrunk mix's
requests as sent (token ids, parameters, arrival, the waves), the engine's answers and the reference's, the run's
divergences with their diagnosis, the settings and the command that replays it. `replay_search_bundle` sends the
same requests, wave by wave, to the engine named and judges them as the search did (equivalence/search/judging.py):
exit status 1 when the mix still fails, 0 when it passes now.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from specaudit import __version__ as VERSION
from specaudit.engines.requests import RequestParams
from specaudit.equivalence.search.judging import Judging, JudgingSettings, failed
from specaudit.equivalence.search.model import Mix, Request

SEARCH_BUNDLE_FORMAT = "specaudit-search-bundle/1"


def _slug(text: Any) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(text)).strip("_")[:60] or "x"


def write_search_bundle(folder: Path, mix: Mix, run: dict[str, Any], judging: Judging, seed: int,
                        target: str | None, number: int = 1) -> Path:
    """The shrunk `mix` of finding `number` and its `run` (judged last by `judging`: its answers are the
    judging's last)."""
    settings, pair_name = judging.settings, judging.pair.name
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (f"search-{_slug(settings.engine_name)}-{_slug(pair_name)}-b{settings.batch_size}-"
                     f"{settings.dtype}-{number}.json")
    answers = {int(p.get("index", i)): p for i, p in enumerate(run.get("prompts") or [])}
    bundle = {
        "format": SEARCH_BUNDLE_FORMAT, "specaudit_version": VERSION, "engine": settings.engine_name,
        "engine_description": run.get("engine_description"), "pair": pair_name,
        "settings": {"dtype": settings.dtype, "batch_size": settings.batch_size,
                     "max_new_tokens": settings.max_new_tokens, "eos_token_id": settings.eos_token_id,
                     "draft_tokens": settings.draft_tokens, "seed": seed},
        "finding": number,
        "waves": mix.waves(),
        "requests": [{"prompt_ids": list(r.prompt), "params": r.params.to_dict(), "arrival": r.arrival,
                      "kind": r.kind, "shared_with": r.shared_with, "shared_length": r.shared_length,
                      "reference_finish": (answers.get(i) or {}).get("reference_finish"),
                      "reported_finish": (answers.get(i) or {}).get("reported_finish")}
                     for i, r in enumerate(mix.requests)],
        "probes": [dict(p.__dict__) for p in mix.probes], "seed_probes": run.get("seed_probes"),
        "engine_outputs": judging.last_outputs, "reference_outputs": judging.last_reference_outputs,
        "divergences": run.get("divergences") or [], "error": run.get("error"),
        "replay": (f"specaudit replay {path} --engine {settings.engine_name}"
                   + (f" --target {target}" if target else "")),
    }
    path.write_text(json.dumps(bundle, indent=1, default=str))
    return path


def read_mix(bundle: dict[str, Any]) -> Mix:
    """The bundle's requests as a mix (their arrivals give back its waves)."""
    from specaudit.equivalence.search.seeds import SeedProbe

    return Mix([Request(tuple(int(t) for t in r["prompt_ids"]), RequestParams.from_dict(r.get("params") or {}),
                        r.get("arrival", "alone"), r.get("kind", "fresh"), r.get("shared_with"),
                        int(r.get("shared_length") or 0)) for r in bundle["requests"]],
               [SeedProbe(int(p["request"]), float(p["temperature"]), int(p["seed"])) for p in bundle.get("probes") or []])


def replay_search_bundle(bundle: dict[str, Any], pair: Any, engine: Any, engine_name: str,
                         replay: Any = None, timeout: float | None = None) -> dict[str, Any]:
    """Send the bundle's requests again to `engine` (built on `pair`) and judge them; returns
    `{"exit_status", "message", "run"}`."""
    s = bundle["settings"]
    settings = JudgingSettings(engine_name=engine_name, batch_size=int(s.get("batch_size") or 1), dtype=s["dtype"],
                               max_new_tokens=int(s["max_new_tokens"]), eos_token_id=s["eos_token_id"],
                               timeout=timeout, draft_tokens=s.get("draft_tokens"))
    mix = read_mix(bundle)
    run = Judging(pair, engine, settings, replay).judge(mix, "full")
    if not failed(run):
        return {"exit_status": 0, "run": run,
                "message": f"the {len(mix.requests)} request(s) in {len(mix.waves())} wave(s) pass now: the finding "
                           "does not reproduce"}
    found = [f"request {d.get('prompt_index')} at position {d.get('position')}: {d.get('kind')} "
             f"{(d.get('diagnosis') or {}).get('class')}" for d in run.get("divergences") or []
             if d.get("kind") == "structural"]
    return {"exit_status": 1, "run": run,
            "message": "the finding reproduces: " + ("; ".join(found) or str(run.get("error")))}


def is_search_bundle(path: Path | str) -> bool:
    try:
        return json.loads(Path(path).read_text()).get("format") == SEARCH_BUNDLE_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def replay_from_args(args: Any, load_target: Any) -> int:
    """`specaudit replay SEARCH_BUNDLE [--engine E] (--pair P | --target DIR)`: the bundle's requests sent again to
    E (default: the engine the bundle was found on) and judged; exit 1 when the finding reproduces, else 0."""
    from specaudit.engines.registry import make_engine

    bundle = json.loads(Path(args.bundle).read_text())
    s = bundle["settings"]
    dtype = args.dtype or s["dtype"]
    pair = load_target(args, dtype)
    replay = pair if dtype == "float64" else load_target(args, "float64")
    name = args.engine or bundle["engine"]
    engine = make_engine(name, pair.target, pair.draft, batch_size=int(s.get("batch_size") or 1),
                         draft_tokens=int(s.get("draft_tokens") or 4), pad_token_id=pair.pad_token_id)
    bundle = {**bundle, "settings": {**s, "dtype": dtype}}
    result = replay_search_bundle(bundle, pair, engine, name, replay)
    print(f"search bundle: {len(bundle['requests'])} request(s) in waves {bundle['waves']}, found on "
          f"{bundle['engine']} ({bundle['pair']}, batch size {s.get('batch_size')}, {s['dtype']}); sent to {name}")
    print(result["message"])
    return int(result["exit_status"])
