"""The run's reference outputs (property_tests/models.py): computed by one worker process, read by the others."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from specaudit.testing import models


def test_a_reference_is_written_once_and_read_back_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(models.REFERENCE_MEMO, str(tmp_path))
    outputs, logits = models.reference.__wrapped__("tiny-gpt2", 3)
    (kept,) = tmp_path.iterdir()
    assert kept.name == "tiny-gpt2-3-float64-cpu.pt"
    read_outputs, read_logits = models.reference.__wrapped__("tiny-gpt2", 3)
    assert read_outputs == outputs and all(torch.equal(a, b) for a, b in zip(read_logits, logits))
    # what is read is the file's: another process's computation, not this one's
    torch.save(([[7]], [torch.zeros(1)]), kept)
    assert models.reference.__wrapped__("tiny-gpt2", 3)[0] == [[7]]


def test_the_test_session_shares_one_folder() -> None:
    assert Path(os.environ[models.REFERENCE_MEMO]).is_dir()
