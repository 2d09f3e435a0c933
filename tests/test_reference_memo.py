"""The reference outputs (property_tests/models.py): computed by one process, read by the others and by later
runs, under a name that changes with anything the outputs depend on."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

from specaudit.testing import models


def test_a_reference_is_written_once_and_read_back_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(models.REFERENCE_MEMO, str(tmp_path))
    outputs, logits = models.reference.__wrapped__("tiny-gpt2", 3)
    (kept,) = tmp_path.iterdir()
    assert kept.name == f"tiny-gpt2-3-float64-cpu-{models.reference_key(models.pair('tiny-gpt2').target)}.pt"
    read_outputs, read_logits = models.reference.__wrapped__("tiny-gpt2", 3)
    assert read_outputs == outputs and all(torch.equal(a, b) for a, b in zip(read_logits, logits))
    # what is read is the file's: another process's computation, not this one's
    torch.save(([[7]], [torch.zeros(1)]), kept)
    assert models.reference.__wrapped__("tiny-gpt2", 3)[0] == [[7]]
    # outputs kept under inputs that have changed since are not read, and go when the new ones are written
    stale = kept.with_name("tiny-gpt2-3-float64-cpu-0123456789abcdef.pt")
    kept.rename(stale)
    assert models.reference.__wrapped__("tiny-gpt2", 3)[0] == outputs
    assert [path.name for path in tmp_path.iterdir()] == [kept.name]


def test_the_key_changes_with_the_weights_and_the_config() -> None:
    target = models.pair("tiny-gpt2").target
    key = models.reference_key(target)
    assert models.reference_key(target) == key
    changed = copy.deepcopy(target)
    with torch.no_grad():
        next(changed.parameters()).view(-1)[0] += 2.0 ** -40  # one weight, one low bit
    assert models.reference_key(changed) != key
    reconfigured = copy.deepcopy(target)
    reconfigured.config.layer_norm_epsilon = reconfigured.config.layer_norm_epsilon * 2
    assert models.reference_key(reconfigured) != key


def test_the_test_session_names_one_folder() -> None:
    folder = Path(os.environ[models.REFERENCE_MEMO])
    assert folder.name == "references"
