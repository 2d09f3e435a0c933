"""The suite's warning filter: a deprecated argument passed by specaudit code fails; the same warning
raised by a library about its own internal call does not (tests/warning_scope.py, pyproject's
`filterwarnings`)."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

from specaudit.engines.ops.hf_call import cache_keyword, cached_forward


def _renamed(old: str, new: str):
    """A forward decorator in the convention of libraries' keyword renames: warn at `stacklevel=2`."""
    def wrap(forward):
        @functools.wraps(forward)
        def wrapped(self, *args, **kwargs):
            if old in kwargs:
                warnings.warn(f"{old} is going away; use {new}", FutureWarning, stacklevel=2)
                kwargs[new] = kwargs.pop(old)
            return forward(self, *args, **kwargs)
        return wrapped
    return wrap


class Renamed(torch.nn.Module):
    @_renamed("past_key_values", "cache")
    def forward(self, input_ids: torch.Tensor, cache: object = None, use_cache: bool = False) -> torch.Tensor:
        return input_ids * 2


def _call_from(module_name: str, model: torch.nn.Module) -> object:
    """Call `model` with the old keyword from code whose module is `module_name`."""
    scope = {"__name__": module_name, "model": model, "torch": torch}
    exec("def call():\n    return model(input_ids=torch.ones(1), past_key_values=None)\n", scope)
    return scope["call"]()


def test_a_deprecated_keyword_passed_from_specaudit_fails() -> None:
    with pytest.raises(FutureWarning):
        _call_from("specaudit.engines.probe", Renamed())


def test_the_same_warning_from_a_library_internal_call_only_warns() -> None:
    with pytest.warns(FutureWarning):
        _call_from("somelibrary.internals", Renamed())


def test_the_cache_goes_under_the_keyword_the_forward_takes() -> None:
    model = Renamed()
    assert cache_keyword(model) == "cache"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(cached_forward(model, None, input_ids=torch.ones(1)), torch.full((1,), 2.0))

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=False):
            return past_key_values

    class StateSpace(torch.nn.Module):
        def forward(self, input_ids, cache_params=None, use_cache=False):
            return cache_params

    marker = object()
    assert cached_forward(Old(), marker, input_ids=None) is marker
    assert cached_forward(StateSpace(), marker, input_ids=None) is marker


def test_a_wrapper_of_kwargs_alone_gets_the_installed_releases_keyword() -> None:
    """A module whose forward takes **kwargs (an engine's wrapper around a model) is handed the cache under
    the name the installed transformers' own models take, which it passes on."""
    import inspect

    from transformers import LlamaForCausalLM

    class Wrapper(torch.nn.Module):
        def forward(self, **kwargs):
            return kwargs

    expected = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
    marker = object()
    assert cached_forward(Wrapper(), marker, input_ids=None)[expected] is marker
