"""Which cache went wrong in a hybrid model: the attention layers' KV cache or the recurrent state.

On a target with recurrent layers (gated delta-net, short convolutions, Mamba-2) a row whose own
cache is wrong (`kv_cache`) or whose output depends on its batch (`cross_row`) may owe it to either
kind of cache: both are trimmed or rolled back at a rejection, both are selected per row. A
controlled experiment tells them apart. The row's batch is re-run twice, each time with one kind of
layer silenced (its output zeroed by a forward hook; it still runs, so its cache is still written
and still mishandled), and compared with greedy decoding of the same silenced target:

- recurrent layers silenced and the row still diverges: the attention KV cache is wrong (the class
  found, `kv_cache` or `cross_row`; if the other re-run diverges too, both caches are: rows selected
  or trimmed wrongly everywhere);
- else, attention silenced and the row still diverges: the recurrent state is wrong (`recurrent_state`);
- else, attention silenced and the row exact: the state was right, so the attention KV cache was not
  (the class found). A state error spreads to every later token, while a few wrong attention columns
  may leave a short re-run's tokens of a silenced target unchanged, so this re-run is the decisive one.

A drafter scripted from the target's greedy tokens (the planted-fault hunts) is scripted from the
silenced target's in the re-runs, so each step accepts as many tokens as in the run; a draft model
drafts as always and the silenced target accepts what it accepts. When the re-run with attention
silenced cannot be made (no re-run for this engine, the layers not found), the state is named, with
that said: a rejection or a neighbour changes a recurrent state exactly so.
"""

from __future__ import annotations

import re
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

import torch

RECURRENT_MIXER = re.compile(r"GatedDeltaNet|ShortConv|Mixer|Mamba(Layer)?$")
ATTENTION = re.compile(r"Attention$")


def _decoder_layers(target: Any, count: int) -> list[torch.nn.Module] | None:
    for module in target.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return list(module)
    return None


def silenced_modules(target: Any, kind: str) -> list[torch.nn.Module] | str:
    """The module of each `kind` layer ("recurrent" or "attention") whose output to silence, or why none."""
    from specaudit.engines.ops.layout import attention_layer_kinds

    kinds = attention_layer_kinds(target)
    layers = _decoder_layers(target, len(kinds))
    if layers is None:
        return "the decoder layers were not found"
    pattern = RECURRENT_MIXER if kind == "recurrent" else ATTENTION
    found = []
    for i, (layer, layer_kind) in enumerate(zip(layers, kinds)):
        if (layer_kind == "recurrent") != (kind == "recurrent"):
            continue
        children = [m for m in layer.children() if pattern.search(type(m).__name__) and "Norm" not in type(m).__name__]
        if len(children) != 1:
            return f"layer {i} has no single {kind} module to silence"
        found.extend(children)
    return found or f"the target has no {kind} layer"


def _zeroed(_module: torch.nn.Module, _args: Any, output: Any) -> Any:
    if isinstance(output, tuple):
        return (torch.zeros_like(output[0]), *output[1:])
    return torch.zeros_like(output)


@contextmanager
def silenced(target: Any, kind: str) -> Iterator[str | None]:
    """Within the block, the `kind` layers of `target` add nothing to the residual stream (their
    caches are still written); yields None, or why they could not be silenced."""
    modules = silenced_modules(target, kind)
    if isinstance(modules, str):
        yield modules
        return
    hooks = [module.register_forward_hook(_zeroed) for module in modules]
    try:
        yield None
    finally:
        for hook in hooks:
            hook.remove()


def diverges_silenced(diagnoser: Any, index: int, batch: list[int], kind: str) -> bool | str:
    """Re-run `batch` with the target's `kind` layers silenced: does row `index` still diverge from
    greedy decoding of the silenced target? (Or why the experiment was not run.) Below float64 the
    float64 target is silenced too and the re-run is judged as the audit judges a run (rulings/ruler.py)."""
    from specaudit.engines.reference import greedy_decode
    from specaudit.equivalence.rulings import Ruler

    targets = [diagnoser.facts.target]
    if diagnoser.facts.ruler is not None and diagnoser.facts.replay_target not in (None, diagnoser.facts.target):
        targets.append(diagnoser.facts.replay_target)
    with ExitStack() as stack:
        missing = [stack.enter_context(silenced(model, kind)) for model in targets]
        if any(missing):
            return next(m for m in missing if m)
        prompt = list(diagnoser.facts.prompts[index])
        facts = diagnoser.facts
        reference = greedy_decode(facts.target, prompt, facts.max_new_tokens, facts.eos_token_id)[0]
        runs = diagnoser.silenced_runs  # one re-run of a batch serves each of its rows' divergences
        result = runs.get((tuple(batch), kind))
        if result is None:
            result = runs[(tuple(batch), kind)] = diagnoser._run(batch)
        if isinstance(result, str):
            return result
        output = result[batch.index(index)]
        if output == reference or diagnoser.facts.ruler is None:
            return output != reference
        ruler = diagnoser.facts.ruler
        return not Ruler(ruler.dtype, diagnoser.facts.target, diagnoser.facts.replay_target, ruler.band).equivalent(
            prompt, reference, output)


def recurrent_or_attention(diagnoser: Any, index: int, found: Any, tried: list[str]) -> tuple[str, str, str]:
    """The class, evidence and what decided, for `found` (a kv_cache or cross_row finding) on a target
    with recurrent layers, by the silenced re-runs; other findings and targets pass through."""
    target = diagnoser.facts.target
    unchanged = found.cls, found.evidence, found.named_by
    if found.cls not in ("kv_cache", "cross_row") or target is None:
        return unchanged
    from specaudit.engines.ops.layout import attention_layer_kinds

    recurrent = attention_layer_kinds(target).count("recurrent")
    if not recurrent:
        return unchanged
    batch = [index]
    if diagnoser.facts.batch_size:
        start = index - index % diagnoser.facts.batch_size
        batch = list(range(start, min(start + diagnoser.facts.batch_size, len(diagnoser.facts.prompts))))
    where = "alone" if len(batch) == 1 else f"in its batch (prompts {batch[0]} to {batch[-1]})"
    outcome: dict[str, bool | str] = {}
    for kind in ("attention", "recurrent"):
        try:
            outcome[kind] = diverges_silenced(diagnoser, index, batch, kind)
        except Exception as exc:  # an experiment that fails tells that, not more
            outcome[kind] = f"failed: {type(exc).__name__}: {exc}".splitlines()[0]
    said = {kind: ("was not run (" + result + ")" if isinstance(result, str) else "still diverges" if result
                   else "is exact") for kind, result in outcome.items()}
    tried.append(f"re-run {where} with the attention layers silenced: {said['attention']}; with the recurrent "
                 f"layers silenced: {said['recurrent']}")
    state, attention = outcome["attention"] is True, outcome["recurrent"] is True
    shown = (f"re-run {where} against greedy decoding of the same target with its attention layers silenced, it "
             f"{said['attention']}; with its {recurrent} recurrent layers silenced, it {said['recurrent']}")
    decided = f"{found.named_by}, then re-runs with the attention or the recurrent layers silenced"
    if attention:
        both = " (the recurrent state is wrong too)" if state else ""
        return found.cls, f"{found.evidence}; {shown}: the attention layers' KV cache is wrong{both}", decided
    if state:
        return "recurrent_state", (f"{found.evidence}; {shown}: the recurrent state, not the attention KV cache, "
                                   "was not the row's own after its accepted tokens"), decided
    if outcome["attention"] is False:
        return found.cls, (f"{found.evidence}; {shown}: with the same drafts and the attention out of the way the "
                           "recurrent state keeps the row exact, so the attention layers' KV cache is what went "
                           "wrong"), decided
    return "recurrent_state", (f"{found.evidence}; {shown}, which decides nothing; the target keeps recurrent state "
                               f"in {recurrent} layers, which a rejection or another row changes exactly this way: "
                               "the state was not the row's own after its accepted tokens"), found.named_by
