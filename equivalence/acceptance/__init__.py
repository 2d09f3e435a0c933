"""Acceptance of speculative decoding: what a run's counters show per draft position (`observed`), what
the proposer can reach on the reference's outputs (`expected`), and the findings between them (`findings`).
Greedy verification keeps outputs exact whatever the draft proposes, so acceptance is where a wrong draft
checkpoint or a broken proposer shows."""
