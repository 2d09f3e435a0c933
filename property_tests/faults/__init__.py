"""Planted faults: one engine per known bug class of batched speculative decoding, each a
minimal line edit of EQSPEC or EXSPEC (see `mutation`), for proving that the equivalence
property catches every one of them (`property_tests/test_faults.py`).

`FAULTS` lists them in the order of the report; each is a factory with the engine contract.
"""

from __future__ import annotations

from property_tests.faults.acceptance import BonusTokenDoubled, BonusTokenDropped, FirstRejectedDraftAccepted
from property_tests.faults.caches import (
    CacheTrimmedToSmallestAcceptance,
    DraftCacheNotTrimmed,
    DraftFillPassSkipped,
    FinishedRowsDroppedByPosition,
    TargetCacheNotTrimmed,
)
from property_tests.faults.mutation import FaultEngine, LineChange, RunawayDecoding, StaleFault
from property_tests.faults.padding import AttentionMaskBlindToPadding, PadTokenTreatedAsPadding, RepadWithoutUnpad
from property_tests.faults.pool import GroupResultsToWrongRows, GroupStacksDifferentLengths
from property_tests.faults.positions import PositionIdsCountPadding, PositionIdsFromOne
from property_tests.faults.stopping import OvershootMaxNewTokens, TokensAfterEos

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
)

__all__ = ["FAULTS", "FaultEngine", "LineChange", "RunawayDecoding", "StaleFault"]
