"""Planted faults: one engine per known bug class of batched speculative decoding, each a
minimal line edit of EQSPEC or EXSPEC (see `mutation`), for proving that the equivalence
property catches every one of them (`tests/property/test_faults.py`).

`FAULTS` lists them in the order of the report; each is a factory with the engine contract.
"""

from __future__ import annotations

from specaudit.testing.faults.acceptance import BonusTokenDoubled, BonusTokenDropped, FirstRejectedDraftAccepted
from specaudit.testing.faults.caches import (
    AttentionCacheCutAtPassEnd,
    CacheTrimmedToSmallestAcceptance,
    DraftCacheNotTrimmed,
    DraftFillPassSkipped,
    FinishedRowsDroppedByPosition,
    TargetCacheNotTrimmed,
)
from specaudit.testing.faults.mutation import FaultEngine, LineChange, RunawayDecoding, StaleFault
from specaudit.testing.faults.padding import AttentionMaskBlindToPadding, PadTokenTreatedAsPadding, RepadWithoutUnpad
from specaudit.testing.faults.recurrent import (
    ConvStateResetMidSequence,
    PadTokensFedIntoState,
    RecurrentStateAdvancedByRejected,
    RecurrentStateFromAnotherRow,
    RecurrentStateNotRolledBack,
    StateStaleAfterZeroDraftStep,
)
from specaudit.testing.faults.pool import GroupResultsToWrongRows, GroupStacksDifferentLengths
from specaudit.testing.faults.positions import PositionIdsCountPadding, PositionIdsFromOne
from specaudit.testing.faults.stopping import OvershootMaxNewTokens, TokensAfterEos

FAULTS: tuple[type[FaultEngine], ...] = (
    PositionIdsCountPadding,
    PositionIdsFromOne,
    AttentionMaskBlindToPadding,
    TargetCacheNotTrimmed,
    DraftCacheNotTrimmed,
    DraftFillPassSkipped,
    FirstRejectedDraftAccepted,
    BonusTokenDropped,
    BonusTokenDoubled,
    CacheTrimmedToSmallestAcceptance,
    FinishedRowsDroppedByPosition,
    RepadWithoutUnpad,
    PadTokenTreatedAsPadding,
    OvershootMaxNewTokens,
    TokensAfterEos,
    GroupStacksDifferentLengths,
    GroupResultsToWrongRows,
    RecurrentStateNotRolledBack,
    RecurrentStateAdvancedByRejected,
    ConvStateResetMidSequence,
    RecurrentStateFromAnotherRow,
    PadTokensFedIntoState,
    StateStaleAfterZeroDraftStep,
    AttentionCacheCutAtPassEnd,
)

__all__ = ["FAULTS", "FaultEngine", "LineChange", "RunawayDecoding", "StaleFault"]
