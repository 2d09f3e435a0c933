"""EXSPEC grouping policies, as engine factories for `specaudit bench` (how reports/bench/README.md's
policy tables were measured):

    PYTHONPATH=scripts specaudit bench --engine eqspec --engine exspec --engine exspec_policies:realign \
        --engine exspec_policies:masked --engine exspec_policies:window_b ...

Each builds `EXSpec` with one policy. The default (`exspec`): a padded batch is realigned and held,
the window's oldest other sequences joining it in its free rows. `realign` / `masked`: no holding, the fallback batch
realigned after the step or cut out with its left padding masked, every step stacked anew;
`sorted_*`: requests admitted sorted by prompt length; `wait2`: partial same-length groups run for
at most 2 steps while waiting for a full one; `window_b`: the default with a window of B (no choice
of rows: the pool refills freed rows).
"""

from __future__ import annotations

from typing import Any

from specaudit.engines.exspec import EXSpec


def _exspec(target: Any, draft: Any, drafter: Any = None, **options: Any) -> EXSpec:
    return EXSpec(target, draft, drafter=drafter, **options)


def realign(target: Any, draft: Any = None, *, drafter: Any = None, **options: Any) -> EXSpec:
    return _exspec(target, draft, drafter, **{**options, "hold": False, "fallback": "realign", "sort_by_length": False})


def masked(target: Any, draft: Any = None, *, drafter: Any = None, **options: Any) -> EXSpec:
    return _exspec(target, draft, drafter, **{**options, "hold": False, "fallback": "masked", "sort_by_length": False})


def sorted_realign(target: Any, draft: Any = None, *, drafter: Any = None, **options: Any) -> EXSpec:
    return _exspec(target, draft, drafter, **{**options, "hold": False, "fallback": "realign", "sort_by_length": True})


def sorted_masked(target: Any, draft: Any = None, *, drafter: Any = None, **options: Any) -> EXSpec:
    return _exspec(target, draft, drafter, **{**options, "hold": False, "fallback": "masked", "sort_by_length": True})


def sorted_masked_wait2(target: Any, draft: Any = None, *, drafter: Any = None, **options: Any) -> EXSpec:
    return _exspec(target, draft, drafter, **{**options, "hold": False, "fallback": "masked", "sort_by_length": True,
                                              "wait_steps": 2})


def sorted_hold(target: Any, draft: Any = None, *, drafter: Any = None, **options: Any) -> EXSpec:
    return _exspec(target, draft, drafter, **{**options, "hold": True, "sort_by_length": True})


def window_b(target: Any, draft: Any = None, *, drafter: Any = None, batch_size: int = 8, **options: Any) -> EXSpec:
    return _exspec(target, draft, drafter, **{**options, "hold": True, "batch_size": batch_size, "window_size": batch_size})
