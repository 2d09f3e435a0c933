"""A constraint in each server's own request fields (engines/adapters/request_fields.py adds them to the body).

| Constraint  | vLLM 0.32.0 / 0.21.0 (`structured_outputs`) | vLLM before 0.10.2 (`guided_*`) | SGLang (`sampling_params`) | llama.cpp (`/completion`) | TensorRT-LLM (`response_format`) |
|-------------|--------------------------|------------------------|-------------------------|-------------------------|---------------------------------|
| json_schema | `json`: the schema       | `guided_json`          | `json_schema` (text)    | `json_schema` (backend llguidance; else refused) | `{"type": "json", "schema": ...}` |
| json_object | `json_object`: true      | `guided_json_object`   | `json_schema` `{"type": "object"}` | `json_schema` `{"type": "object"}` (llguidance) | `{"type": "json_object"}` |
| regex       | `regex`                  | `guided_regex`         | `regex`                 | refused (no regex field) | `{"type": "regex", "regex": ...}` |
| choice      | `choice`                 | `guided_choice`        | `ebnf`: `choice_grammar` | `grammar`: `choice_grammar` | `{"type": "ebnf", "ebnf": choice_grammar}` |
| grammar     | `grammar`                | `guided_grammar`       | `ebnf` (EBNF only)      | `grammar` (GBNF = EBNF only) | `{"type": "ebnf", "ebnf": ...}` (EBNF only) |

llama.cpp and the JSON kinds: built with llguidance (as the `xllamacpp` wheels b8672 and b11549 are), it turns
a schema into the llguidance grammar `%llguidance {}` / `start: %json SCHEMA` and applies llguidance's JSON rules
(its whitespace, not xgrammar's), so the reference must apply llguidance too: `--grammar-backend llguidance`, else
refused. It takes no regex; a grammar and a choice are the same language in any correct engine. vLLM's
whitespace rule is the server's (`--structured-outputs-config '{"disable_any_whitespace": true}'`: vLLM
0.32.0's xgrammar backend reads no per-request field for it); `any_whitespace` False is sent as
`disable_any_whitespace` too, and the audited server must be started with it.
"""

from __future__ import annotations

import json
from typing import Any

from specaudit.engines.constraints import Constraint, choice_grammar

DIALECT_FIELDS = {  # the field an HTTP 400 answer names when a server refuses the constraint
    "vllm": "structured_outputs", "vllm-guided": "guided_", "sglang": "json_schema|regex|ebnf",
    "llamacpp": "grammar|json_schema", "trtllm": "response_format",
}


# the log-probabilities a dialect reports under a constraint (engines/requests/reference.py's definitions):
# vLLM's sampler sees the masked logits ("raw" is the masked row); llama.cpp's `n_probs` come before its grammar
CONSTRAINED_LOGPROB_DEFINITION = {"llamacpp": "model"}


class ConstraintRefused(ValueError):
    """The dialect cannot carry this constraint (one line why)."""


def vllm_fields(constraint: Constraint, style: str = "structured_outputs") -> dict[str, Any]:
    """vLLM `/v1/completions` fields: `structured_outputs` (0.10.2 on), or `guided_*` (`style` "guided")."""
    value: Any
    if constraint.kind == "json_schema":
        key, value = "json", json.loads(constraint.text)
    elif constraint.kind == "json_object":
        key, value = "json_object", True
    elif constraint.kind == "choice":
        key, value = "choice", list(constraint.choices)
    else:  # regex, grammar
        key, value = constraint.kind, constraint.text
    if style == "guided":
        body: dict[str, Any] = {f"guided_{key}": value, "guided_decoding_backend": constraint.backend}
        return body
    outputs: dict[str, Any] = {key: value}
    if not constraint.any_whitespace:
        outputs["disable_any_whitespace"] = True
    return {"structured_outputs": outputs}


def sglang_fields(constraint: Constraint) -> dict[str, Any]:
    """SGLang `/generate` `sampling_params` fields."""
    if constraint.kind == "json_schema":
        return {"json_schema": constraint.text}
    if constraint.kind == "json_object":
        return {"json_schema": json.dumps({"type": "object"})}
    if constraint.kind == "regex":
        return {"regex": constraint.text}
    if constraint.kind == "choice":
        return {"ebnf": choice_grammar(constraint.choices)}
    if constraint.grammar_syntax != "ebnf":
        raise ConstraintRefused("SGLang takes an EBNF grammar (`ebnf`), not Lark")
    return {"ebnf": constraint.text}


def llamacpp_fields(constraint: Constraint) -> dict[str, Any]:
    """llama.cpp `/completion` fields: a GBNF `grammar` (a grammar, or a choice as one); a JSON schema as
    `json_schema` when the reference applies it with llguidance, as llama.cpp does
    (engines/constraints/llguidance_matcher.py)."""
    if constraint.kind in ("json_schema", "json_object") and constraint.backend == "llguidance":
        return {"json_schema": json.loads(constraint.text) if constraint.kind == "json_schema" else {"type": "object"}}
    if constraint.kind == "choice":
        return {"grammar": choice_grammar(constraint.choices)}
    if constraint.kind == "grammar" and constraint.grammar_syntax == "ebnf":
        return {"grammar": constraint.text}
    if constraint.kind == "grammar":
        raise ConstraintRefused("llama.cpp takes a GBNF grammar, not Lark")
    if constraint.kind == "regex":
        raise ConstraintRefused("llama.cpp takes no regex: give the constraint as a GBNF --grammar")
    raise ConstraintRefused(f"llama.cpp applies a {constraint.kind} with llguidance (its json_schema_to_grammar): "
                            "give --grammar-backend llguidance")


def trtllm_fields(constraint: Constraint) -> dict[str, Any]:
    """TensorRT-LLM `trtllm-serve` `/v1/completions` `response_format` (its server started with
    `guided_decoding_backend: xgrammar`)."""
    if constraint.kind == "json_schema":
        return {"response_format": {"type": "json", "schema": json.loads(constraint.text)}}
    if constraint.kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if constraint.kind == "regex":
        return {"response_format": {"type": "regex", "regex": constraint.text}}
    if constraint.kind == "choice":
        return {"response_format": {"type": "ebnf", "ebnf": choice_grammar(constraint.choices)}}
    if constraint.grammar_syntax != "ebnf":
        raise ConstraintRefused("TensorRT-LLM takes an EBNF grammar, not Lark")
    return {"response_format": {"type": "ebnf", "ebnf": constraint.text}}


def dialect_refusal(dialect: str, constraint: Constraint) -> str | None:
    """Why `dialect` cannot carry `constraint` (one line), or None."""
    builders = {"vllm": vllm_fields, "sglang": sglang_fields, "llamacpp": llamacpp_fields, "trtllm": trtllm_fields}
    if dialect not in builders:
        return f"the {dialect} dialect sends no structured-output constraint"
    try:
        builders[dialect](constraint)
    except ConstraintRefused as exc:
        return str(exc)
    return None
