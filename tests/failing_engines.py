"""Engines and factories that fail in every way the harness must survive, named as
`failing_engines:NAME` in tests/test_errors*.py."""

from __future__ import annotations

import threading
from typing import Any

import torch

from specaudit.engines.reference import ReferenceDecoder

RELEASE = threading.Event()  # set by a test to let a hanging engine finish


class _Engine:
    """Greedy decoding of the target, then `corrupt(outputs)`: a fake engine with a given fault."""

    def __init__(self, target, batch_size: int) -> None:
        self.reference = ReferenceDecoder(target)
        self.batch_size = batch_size

    def corrupt(self, outputs: list[list[int]]) -> Any:
        return outputs

    def generate(self, prompts, max_new_tokens, eos_token_id):
        return self.corrupt(self.reference.generate(prompts, max_new_tokens, eos_token_id))


class _Raises(_Engine):
    def generate(self, prompts, max_new_tokens, eos_token_id):
        raise RuntimeError("planted failure inside generate")


class _OneOutputShort(_Engine):
    def corrupt(self, outputs):
        return outputs[:-1]


class _FloatTokens(_Engine):
    def corrupt(self, outputs):
        return [[float(t) + 0.5 for t in row] for row in outputs]


class _NegativeToken(_Engine):
    def corrupt(self, outputs):
        return [[-1] + row[1:] for row in outputs]


class _Hangs(_Engine):
    def generate(self, prompts, max_new_tokens, eos_token_id):
        RELEASE.wait(120)  # stands for an engine stuck in a loop; ends on its own in the end
        return [[] for _ in prompts]


class _OutOfMemory(_Engine):
    def generate(self, prompts, max_new_tokens, eos_token_id):
        if self.batch_size > 2:
            raise torch.OutOfMemoryError("planted: tried to allocate too much")
        return super().generate(prompts, max_new_tokens, eos_token_id)


class _HostMemoryError(_Engine):
    def generate(self, prompts, max_new_tokens, eos_token_id):
        raise MemoryError()


class _WrongThenHangs(_Engine):
    """The first call of generate (the run) gives a wrong token at position 1 of prompt 0 (a
    structural divergence); every later call (the diagnosis's re-runs) hangs until RELEASE."""

    calls = 0

    def generate(self, prompts, max_new_tokens, eos_token_id):
        type(self).calls += 1
        if type(self).calls > 1:
            RELEASE.wait(120)
            return [[] for _ in prompts]
        outputs = super().generate(prompts, max_new_tokens, eos_token_id)
        outputs[0][1] = (outputs[0][1] + 1) % 250
        return outputs


def _factory(cls):
    def factory(target, draft, *, batch_size: int, draft_tokens: int, **_: Any):
        return cls(target, batch_size)
    return factory


make_raising = _factory(_Raises)
make_one_output_short = _factory(_OneOutputShort)
make_float_tokens = _factory(_FloatTokens)
make_negative_token = _factory(_NegativeToken)
make_hanging = _factory(_Hangs)
make_out_of_memory = _factory(_OutOfMemory)
make_host_memory_error = _factory(_HostMemoryError)
make_wrong_then_hangs = _factory(_WrongThenHangs)


def factory_raises(target, draft, **_: Any):
    raise ValueError("planted: this factory refuses to build")


def factory_without_generate(target, draft, **_: Any) -> object:
    return object()


not_callable = 42


def factory_raises_for_large_batches(target, draft, *, batch_size: int, draft_tokens: int, **_: Any):
    """Builds at the first batch size (the pre-run check passes), refuses larger ones."""
    if batch_size > 2:
        raise ValueError("planted: batch sizes above 2 are not supported")
    return _Engine(target, batch_size)
