"""EXSPEC pool faults: same-length groups that are not, and results that go to the wrong rows."""

from __future__ import annotations

from specaudit.testing.faults.mutation import FaultEngine, LineChange


class GroupStacksDifferentLengths(FaultEngine):
    """A group that stacks rows of different lengths: `ExspecPool._speculate` decides that a
    batch is a same-length group by its prompt lengths, so rows with equal prompts that accepted
    differently are stepped as a group (no realignment) and cut out of the cache at wrong columns."""

    engine = "exspec"
    changes = (
        LineChange("specaudit.engines.exspec", "same_length = len({s.length for s in group}) == 1",
                   "same_length = len({s.prompt_length for s in group}) == 1"),
    )


class GroupResultsToWrongRows(FaultEngine):
    """Results written back to the wrong rows: after a group step in which a row finished,
    `ExspecPool._speculate` cuts the running sequences' caches from batch rows 0, 1, ... instead of
    from their own rows, so a sequence after the finished one takes its neighbour's cache."""

    engine = "exspec"
    changes = (
        LineChange("specaudit.engines.exspec", "self._cut_caches(state, [group[b] for b in running], running, [0] * len(running), ends)",
                   "self._cut_caches(state, [group[b] for b in running], list(range(len(running))), [0] * len(running), ends)"),
    )
