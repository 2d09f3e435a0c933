"""The search over workloads (`specaudit audit --search`): Hypothesis-drawn request mixes, judged as the greedy
audit judges a run, the first failing mix shrunk to a minimal reproducer (docs/search.md).

strategies.py draws one request's prompt, parameters and arrival; model.py is the plain model of an example (the
requests, their waves, what the examples covered); machine.py is the rule-based state machine; arrival.py sends an
example wave by wave; judging.py judges it (equivalence/audit.py `audit_engine`) against a memoized reference;
run.py runs the search within its budget; bundle.py writes and replays the shrunk case; coverage.py says what was
reached; pipeline.py is the search as a choice of the pipeline's composition.
"""
