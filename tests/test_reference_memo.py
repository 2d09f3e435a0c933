"""The reference outputs (property_tests/models.py): computed by one process, read by the others and by later
runs, under a name that changes with anything the outputs depend on."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

from specaudit.engines import reference_memo
from specaudit.testing import models


def test_a_reference_is_written_once_and_read_back_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(models.REFERENCE_MEMO, str(tmp_path))
    outputs, logits = models.reference.__wrapped__("tiny-gpt2", 3)
    (kept,) = tmp_path.iterdir()
    kernels = reference_memo.kernels_tag()
    assert kept.name == f"tiny-gpt2-3-float64-cpu-{kernels}-{models.reference_key(models.pair('tiny-gpt2').target)}.pt"
    read_outputs, read_logits = models.reference.__wrapped__("tiny-gpt2", 3)
    assert read_outputs == outputs and all(torch.equal(a, b) for a, b in zip(read_logits, logits))
    # what is read is the file's: another process's computation, not this one's
    torch.save(([[7]], [torch.zeros(1)]), kept)
    assert models.reference.__wrapped__("tiny-gpt2", 3)[0] == [[7]]
    # outputs kept under inputs that have changed since are not read, and go when the new ones are written
    stale = kept.with_name(f"tiny-gpt2-3-float64-cpu-{kernels}-0123456789abcdef.pt")
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


def test_an_audit_reference_is_kept_and_read_back_by_the_next_audit(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from specaudit.equivalence.audit import Reference

    pair = models.pair("tiny-llama")
    prompts = [list(p) for p in models.prompts()[:3]]
    eos = models.reference("tiny-llama")[0][1][4]  # emitted by prompt 1 at new token 5
    monkeypatch.setenv(models.REFERENCE_MEMO, str(tmp_path))
    first = Reference(pair, prompts, 8, eos)
    (kept,) = tmp_path.iterdir()
    assert not first.kept and kept.name.startswith("audit-tiny-llama-float64-")
    second = Reference(pair, prompts, 8, eos)
    assert second.kept and second.outputs == first.outputs
    assert all(torch.equal(a, b) for a, b in zip(second.logits, first.logits))
    assert len(first.outputs[1]) <= 5 and first.outputs[1][-1] == eos
    # another budget, other stop ids, other prompts: other files, each decoded
    for budget, stop, rows in ((9, eos, prompts), (8, None, prompts), (8, eos, prompts[:2])):
        assert not Reference(pair, rows, budget, stop).kept
    assert len(list(tmp_path.iterdir())) == 4
    # a file torch cannot read is decoded again and replaced
    kept.write_bytes(b"not a reference")
    again = Reference(pair, prompts, 8, eos)
    assert not again.kept and again.outputs == first.outputs
    assert Reference(pair, prompts, 8, eos).kept


def test_an_audit_reference_is_not_kept_without_a_memo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from specaudit.equivalence.audit import Reference

    monkeypatch.delenv(models.REFERENCE_MEMO, raising=False)
    monkeypatch.chdir(tmp_path)
    reference = Reference(models.pair("tiny-gpt2"), [list(models.prompts()[0])], 4, None)
    assert not reference.kept and len(reference.outputs[0]) == 4
    assert list(tmp_path.iterdir()) == []


def test_the_kept_reference_is_what_the_oracle_decodes() -> None:
    """The property oracle reads a built-in prompt's run from `models.reference`: the same tokens and logits
    as decoding that prompt alone."""
    from specaudit.engines.reference import greedy_decode
    from specaudit.testing.properties import ReferenceOracle

    pair = models.pair("tiny-qwen3")
    prompt = models.prompts()[7]
    kept = models.builtin_run(pair.target, prompt, 10)
    assert kept is not None
    tokens, logits = greedy_decode(pair.target, list(prompt), 10, None, record_logits=True)
    assert kept[0] == tokens and torch.equal(kept[1], logits)
    assert ReferenceOracle().decode(pair, prompt, 10, None)[0] == tokens
    # not a built-in prompt, a longer budget, a pair built elsewhere: decoded
    assert models.builtin_run(pair.target, prompt[:-1], 10) is None
    assert models.builtin_run(pair.target, prompt, models.MAX_NEW_TOKENS + 1) is None
    assert models.builtin_run(copy.deepcopy(pair.target), prompt, 10) is None


def test_the_oracle_keeps_a_derandomized_search_s_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from specaudit.testing import properties
    from specaudit.testing.properties import ReferenceOracle

    pair = models.pair("tiny-gpt2")
    prompt = (5, 9, 77, 3)  # not a built-in prompt
    monkeypatch.setenv(models.REFERENCE_MEMO, str(tmp_path))
    monkeypatch.setattr(properties, "settings", SimpleNamespace(default=SimpleNamespace(derandomize=False)))
    tokens, logits = ReferenceOracle().decode(pair, prompt, 6, None)
    assert not (tmp_path / "oracle").exists()  # a random search's prompts are not kept
    monkeypatch.setattr(properties, "settings", SimpleNamespace(default=SimpleNamespace(derandomize=True)))
    assert ReferenceOracle().decode(pair, prompt, 6, None)[0] == tokens
    (kept,) = (tmp_path / "oracle").iterdir()
    assert kept.name.startswith("tiny-gpt2-float64-")
    # read back: what the file holds (another process's run), truncated at the stop id asked for
    torch.save(([1, 2, 3, 4, 5, 6], torch.zeros(6, 3)), kept)
    assert ReferenceOracle().decode(pair, prompt, 6, 3)[0] == [1, 2, 3]
    # another budget is another run
    assert ReferenceOracle().decode(pair, prompt, 5, None)[0] == tokens[:5]
    assert len(list((tmp_path / "oracle").iterdir())) == 2
    assert torch.equal(ReferenceOracle().decode(pair, prompt, 5, None)[1], logits[:5])


def test_the_key_and_the_name_change_with_the_cpu_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below float64 near-ties round as the kernels do: a run under ATen's other vector kernels, or oneDNN capped
    to another instruction set, is another run, kept beside this one (its kernels in the file's name)."""
    target = models.pair("tiny-gpt2").target
    key, tag = models.reference_key(target), reference_memo.kernels_tag()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert models.reference_key(target) != key and reference_memo.kernels_tag() == f"{tag}-onednn_avx2"
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "ANOTHER")
    assert models.reference_key(target) != key and reference_memo.kernels_tag() == "another"
