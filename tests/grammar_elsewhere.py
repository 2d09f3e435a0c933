"""Engines whose grammar is not the reference's: the project's EQSPEC and its plain batched twin, each
applying every JSON constraint with the other whitespace rule (`any_whitespace` flipped), as a server
started with another structured-output configuration than the audit was told. The speculation is right;
the request processing differs from the reference's, identically with and without speculation."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from specaudit.engines.batched import BatchedGreedy
from specaudit.engines.eqspec import EQSpec
from specaudit.engines.requests import RequestParams


def _other_whitespace(params: RequestParams) -> RequestParams:
    constraint = params.constraint
    if constraint is None or constraint.kind not in ("json_schema", "json_object"):
        return params
    return replace(params, constraint=replace(constraint, any_whitespace=not constraint.any_whitespace))


class _OtherWhitespace:
    @property
    def request_params(self) -> list[RequestParams] | None:
        return self.__dict__.get("_request_params")

    @request_params.setter
    def request_params(self, params: Any) -> None:
        self.__dict__["_request_params"] = None if params is None else [_other_whitespace(p) for p in params]


class EqspecOtherWhitespace(_OtherWhitespace, EQSpec):
    pass


class BatchedOtherWhitespace(_OtherWhitespace, BatchedGreedy):
    pass
