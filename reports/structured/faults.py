"""The planted structured-output faults on tiny-llama, float64: exact prompts, accepted draft tokens and the class
named at the first differing token, per engine (reports/structured/README.md). Run: python reports/structured/faults.py"""
import torch, time
from specaudit.engines.models import zoo
from specaudit.engines.requests import RequestParams
from specaudit.engines.requests.reference import decode_with_params
from specaudit.engines.constraints import Constraint
from specaudit.engines.eqspec import EQSpec
from specaudit.testing.faults.constrained import GrammarNotRolledBack, BonusTokenUnmasked, MaskOnePositionOff, DraftUnmasked
from specaudit.equivalence.blackbox.constraints import constraint_cause, violation_finding
pair = zoo.load_pair("tiny-llama", dtype="float64")
tok = pair.tokenizer
cons = [Constraint("json_schema", '{"type":"object","properties":{"name":{"type":"string","maxLength":6},"n":{"type":"integer"}},"required":["name","n"]}', any_whitespace=False),
        Constraint("regex", r"[a-f]{2,5}-\d+"), Constraint("choice", choices=("alpha","beta","gamma")),
        Constraint("grammar", 'root ::= "(" expr ")"\nexpr ::= [0-9]+ | "(" expr ")"'), Constraint("json_object", any_whitespace=False)]
prompts = [tok.encode(s) for s in ["Hello", "The JSON is", "x", "answer: ", "zz top"]]
params = [RequestParams(constraint=c) for c in cons]
refs = [decode_with_params(pair.target, p, c, 30, pair.eos_token_id, tok) for p, c in zip(prompts, params)]
for r in refs: print(repr(r.text), r.finish_reason)
for cls in (EQSpec, GrammarNotRolledBack, BonusTokenUnmasked, MaskOnePositionOff, DraftUnmasked):
    eng = cls(pair.target, pair.draft, batch_size=3, draft_tokens=4)
    eng.request_params = params; eng.request_tokenizer = tok
    out = eng.generate(prompts, 30, pair.eos_token_id)
    steps = eng.last_trace.steps
    acc = sum(sum(s.accepted_counts) for s in steps if s.kind != "prefill")
    names = []
    for i,(o,r,p) in enumerate(zip(out, refs, params)):
        c = constraint_cause(i, p, r, o, [pair.eos_token_id], tok)
        v = violation_finding(i, p, o, [pair.eos_token_id], tok)
        names.append((c.diagnosis_class if c else None, v.diagnosis_class if v else None))
    print(cls.__name__, [o == r.tokens for o, r in zip(out, refs)], "accepted", acc, names)
