"""EXSPEC grouping policies, as engine factories for `specaudit bench` (how reports/bench/README.md's
policy table was measured):

    PYTHONPATH=scripts specaudit bench --engine eqspec --engine exspec_policies:realign \
        --engine exspec_policies:masked --engine exspec_policies:sorted_realign \
        --engine exspec_policies:sorted_masked --engine exspec_policies:sorted_masked_wait2 ...

Each builds `EXSpec` with one policy: the fallback batch realigned after the step (`realign`) or
cut out with its left padding masked (`masked`), requests admitted in arrival order or sorted by
prompt length (`sorted_*`), and partial same-length groups run for at most N steps while waiting
for a full one (`wait2`).
"""

from __future__ import annotations

from typing import Any

from specaudit.engines.exspec import EXSpec


def _exspec(target: Any, draft: Any, drafter: Any = None, **options: Any) -> EXSpec:
    return EXSpec(target, draft, drafter=drafter, **options)


def realign(target: Any, draft: Any = None, *, drafter: Any = None, **options: Any) -> EXSpec:
    return _exspec(target, draft, drafter, **{**options, "fallback": "realign", "sort_by_length": False})


def masked(target: Any, draft: Any = None, *, drafter: Any = None, **options: Any) -> EXSpec:
    return _exspec(target, draft, drafter, **{**options, "fallback": "masked", "sort_by_length": False})


def sorted_realign(target: Any, draft: Any = None, *, drafter: Any = None, **options: Any) -> EXSpec:
    return _exspec(target, draft, drafter, **{**options, "fallback": "realign", "sort_by_length": True})


def sorted_masked(target: Any, draft: Any = None, *, drafter: Any = None, **options: Any) -> EXSpec:
    return _exspec(target, draft, drafter, **{**options, "fallback": "masked", "sort_by_length": True})


def sorted_masked_wait2(target: Any, draft: Any = None, *, drafter: Any = None, **options: Any) -> EXSpec:
    return _exspec(target, draft, drafter, **{**options, "fallback": "masked", "sort_by_length": True, "wait_steps": 2})
