"""Sampled engines that break the engine contract in the ways the sampled audit must survive, named as
`sampled_failing_engines:NAME` in tests/test_sampling_guard.py. Each samples correctly (the project's
`SampledSpeculative`) and then breaks one promise."""

from __future__ import annotations

import threading
from typing import Any

import torch

from specaudit.engines.sampling.engine import SampledSpeculative

RELEASE = threading.Event()  # set by a test to let a hanging engine finish


class _Sampler(SampledSpeculative):
    """`SampledSpeculative`, its outputs passed through `corrupt`."""

    def corrupt(self, outputs: list[list[int]]) -> Any:
        return outputs

    def generate(self, prompts, max_new_tokens, eos_token_id, seeds=None):
        return self.corrupt(super().generate(prompts, max_new_tokens, eos_token_id, seeds=seeds))


class _Hangs(_Sampler):
    def generate(self, prompts, max_new_tokens, eos_token_id, seeds=None):
        RELEASE.wait(120)  # stands for an engine stuck in a loop; ends on its own in the end
        return [[] for _ in prompts]


class _OutOfVocabulary(_Sampler):
    def corrupt(self, outputs):
        vocab = self.target.config.vocab_size
        return [[vocab + 3] + row[1:] for row in outputs]


class _OneOutput(_Sampler):
    def corrupt(self, outputs):
        return outputs[:1]


class _FloatTokens(_Sampler):
    def corrupt(self, outputs):
        return [[float(t) for t in row] for row in outputs]


def _factory(cls: type) -> Any:
    def make(target, draft, **options: Any) -> _Sampler:
        return cls(target, draft, **options)
    return make


hangs = _factory(_Hangs)
out_of_vocabulary = _factory(_OutOfVocabulary)
one_output = _factory(_OneOutput)
float_tokens = _factory(_FloatTokens)
correct = _factory(_Sampler)


def raises_when_built(target, draft, **options: Any) -> _Sampler:
    raise RuntimeError("planted failure in the factory")


class _SaysWhatItGot(_Sampler):
    def describe(self) -> dict[str, str]:
        weight = next(self.target.parameters())
        return {"target_dtype": str(weight.dtype), "target_device": str(weight.device)}


says_what_it_got = _factory(_SaysWhatItGot)


class _OneTokenTooMany(_Sampler):
    def corrupt(self, outputs):
        return [row + [5] for row in outputs]


one_token_too_many = _factory(_OneTokenTooMany)


class _GoesOnAfterEos(_Sampler):
    def generate(self, prompts, max_new_tokens, eos_token_id, seeds=None):
        outputs = super().generate(prompts, max_new_tokens, eos_token_id, seeds=seeds)
        eos = eos_token_id if isinstance(eos_token_id, int) else list(eos_token_id)[0]
        return [[eos] + row[:-1] if len(row) > 1 else row for row in outputs]


goes_on_after_eos = _factory(_GoesOnAfterEos)


class _OutOfMemory(_Sampler):
    def generate(self, prompts, max_new_tokens, eos_token_id, seeds=None):
        raise torch.OutOfMemoryError("planted: tried to allocate too much")


out_of_memory = _factory(_OutOfMemory)
