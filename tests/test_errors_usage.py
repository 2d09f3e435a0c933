"""Bad usage and bad data: exit status 2 and one line that names the problem (and the file and line).

Every check here happens before any run; most before a model is loaded, so these tests are fast.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

from cli_run import audit, cli, runs, usage_error
from specaudit.equivalence import validate
from specaudit.equivalence.errors import UsageError

PAIR = ("--engine", "eqspec", "--pair", "tiny-gpt2")
SMALL = ("--batch-size", "2", "--num-prompts", "2", "--max-new-tokens", "4")


# ---- usage -----------------------------------------------------------------------------------------

def test_unknown_engine(tmp_path: Path) -> None:
    usage_error(audit("--engine", "no-such-engine", "--pair", "tiny-gpt2", out=tmp_path),
                "unknown engine 'no-such-engine'", "package.module:factory")


def test_unknown_pair(tmp_path: Path) -> None:
    usage_error(audit("--engine", "eqspec", "--pair", "tiny-nothing", out=tmp_path),
                "unknown pair 'tiny-nothing'", "tiny-gpt2", "--target PATH --draft PATH")


def test_factory_module_that_does_not_import(tmp_path: Path) -> None:
    usage_error(audit("--engine", "no_such_module_here:make", "--pair", "tiny-gpt2", out=tmp_path),
                "cannot import", "no_such_module_here", "PYTHONPATH")


def test_factory_module_that_fails_while_importing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_on_import.py").write_text('raise RuntimeError("planted: broken module")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    usage_error(audit("--engine", "broken_on_import:make", "--pair", "tiny-gpt2", out=tmp_path / "out"),
                "broken_on_import", "fails while being imported", "planted: broken module", "fix the module")


def test_factory_name_missing_from_its_module(tmp_path: Path) -> None:
    usage_error(audit("--engine", "failing_engines:no_such_factory", "--pair", "tiny-gpt2", out=tmp_path),
                "has no attribute 'no_such_factory'")


def test_factory_that_is_not_callable(tmp_path: Path) -> None:
    usage_error(audit("--engine", "failing_engines:not_callable", "--pair", "tiny-gpt2", out=tmp_path),
                "failing_engines:not_callable", "not a callable factory")


@pytest.mark.parametrize("factory, fragments", [
    ("factory_raises", ("could not be built", "planted: this factory refuses to build", "fix the factory")),
    ("factory_without_generate", ("no generate()", "must return an object with generate(")),
])
def test_factory_that_fails_to_build_stops_before_any_run(tmp_path: Path, factory: str, fragments) -> None:
    result = audit("--engine", "eqspec", "--engine", f"failing_engines:{factory}", "--pair", "tiny-gpt2",
                   *SMALL, out=tmp_path)
    usage_error(result, f"failing_engines:{factory}", *fragments)
    assert runs(tmp_path) == []  # not even the good engine ran


@pytest.mark.parametrize("option, value", [
    ("--batch-size", "0"), ("--batch-size", "-3"), ("--draft-tokens", "0"), ("--max-new-tokens", "0"),
    ("--num-prompts", "-1"), ("--batch-size", "two"),
])
def test_counts_below_one(tmp_path: Path, option: str, value: str) -> None:
    line = usage_error(audit(*PAIR, option, value, out=tmp_path), option, "whole number")
    assert value in line
    assert not (tmp_path / "audit.json").exists()


def test_counts_below_one_from_python(tmp_path: Path) -> None:
    import specaudit

    for kwargs in ({"batch_sizes": [0]}, {"max_new_tokens": 0}, {"draft_tokens": -1}, {"num_prompts": 0}):
        with pytest.raises(UsageError, match="at least 1"):
            specaudit.audit("eqspec", pairs=["tiny-gpt2"], out=tmp_path, **kwargs)


def test_timeout_must_be_positive(tmp_path: Path) -> None:
    usage_error(audit(*PAIR, "--timeout", "0", out=tmp_path), "--timeout", "above 0")


@pytest.mark.parametrize("value, fragment", [("999", "outside the vocabulary of tiny-gpt2 (0..258)"),
                                             ("-2", "outside the vocabulary"), ("eos", "give a token id")])
def test_eos_token_id_not_a_token(tmp_path: Path, value: str, fragment: str) -> None:
    usage_error(audit(*PAIR, "--eos-token-id", value, out=tmp_path), value, fragment)


@pytest.mark.parametrize("value, fragments", [
    ("258,999", ("--eos-token-id 258,999: 999 is outside the vocabulary of tiny-gpt2 (0..258)",)),
    ("258,x", ("'x' in '258,x' is not a token id", "ids separated by commas")),
    ("258,", ("'' in '258,' is not a token id",)),
    ("258,258", ("names an id twice",)),
])
def test_eos_token_id_set_with_a_bad_id(tmp_path: Path, value: str, fragments) -> None:
    usage_error(audit(*PAIR, "--eos-token-id", value, out=tmp_path), *fragments)


def test_eos_token_id_set_from_python(tmp_path: Path) -> None:
    from specaudit.equivalence.pipeline.runner import AuditSettings, run_audit

    for eos, fragment in (([], "the set of EOS ids is empty"), ([258, 1.5], "1.5 is not a token id"),
                          ([258, 300], "300 is outside the vocabulary")):
        config = AuditSettings(engines=["eqspec"], pairs=["tiny-gpt2"], batch_sizes=[1], eos_token_id=eos)
        with pytest.raises(UsageError, match=fragment):
            run_audit(config, tmp_path)


def test_unknown_dtype(tmp_path: Path) -> None:
    usage_error(audit(*PAIR, "--dtype", "float8", out=tmp_path), "unknown dtype 'float8'", "float64, float32")


def test_cuda_without_a_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine has none; any machine here
    usage_error(audit(*PAIR, "--device", "cuda", out=tmp_path), "--device cuda", "no CUDA GPU", "--device cpu")


def test_unknown_device(tmp_path: Path) -> None:
    usage_error(audit(*PAIR, "--device", "gpu", out=tmp_path), "unknown device 'gpu'", "cuda:N")


def test_dtype_the_device_cannot_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # every dtype runs on this CPU (float16 matmuls included, measured), so a device that refuses one is planted
    real_probe = validate.probe_dtype

    def refuses_float16(dtype: torch.dtype, device: torch.device) -> None:
        if dtype == torch.float16:
            raise RuntimeError("planted: no float16 kernels here")
        real_probe(dtype, device)

    monkeypatch.setattr(validate, "probe_dtype", refuses_float16)
    usage_error(audit(*PAIR, "--dtype", "float32", "float16", out=tmp_path),
                "dtype float16 cannot run on cpu", "choose another --dtype")


def test_every_dtype_runs_on_this_cpu() -> None:
    for name, dtype in (("float64", torch.float64), ("float32", torch.float32), ("bfloat16", torch.bfloat16),
                        ("float16", torch.float16)):
        validate.probe_dtype(dtype, torch.device("cpu"))  # raises if it cannot


def test_recording_missing(tmp_path: Path) -> None:
    missing = tmp_path / "nothing.jsonl"
    usage_error(audit("--engine", f"recorded:{missing}", "--pair", "tiny-gpt2", *SMALL, out=tmp_path / "out"),
                str(missing))


def test_recording_malformed(tmp_path: Path) -> None:
    recording = tmp_path / "rec.jsonl"
    recording.write_text('{"prompt_ids": [72, 105], "output_ids": [1, 2]}\nthis is not json\n')
    usage_error(audit("--engine", f"recorded:{recording}", "--pair", "tiny-gpt2", *SMALL, out=tmp_path / "out"),
                f"{recording}:2")


def test_recording_with_a_prompt_outside_the_vocabulary(tmp_path: Path) -> None:
    recording = tmp_path / "rec.jsonl"
    recording.write_text('{"prompt_ids": [72, 105], "output_ids": [1, 2]}\n{"prompt_ids": [72, 999], "output_ids": [1]}\n')
    usage_error(audit("--engine", f"recorded:{recording}", "--pair", "tiny-gpt2", "--max-new-tokens", "2",
                      out=tmp_path / "out"),
                f"{recording}, prompt 2", "token id 999", "outside the model's vocabulary")


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket is closed


def test_server_that_cannot_be_reached(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    result = audit("--engine", "eqspec", "--engine", f"llamacpp:{url}", "--pair", "tiny-gpt2", *SMALL, out=tmp_path)
    usage_error(result, "cannot reach the server", url, "start the server")
    assert runs(tmp_path) == []


# ---- data ------------------------------------------------------------------------------------------

def _prompts(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_prompts_file_missing(tmp_path: Path) -> None:
    missing = str(tmp_path / "none.jsonl")
    usage_error(audit(*PAIR, "--prompts", missing, out=tmp_path / "out"), missing, "does not exist",
                "--prompts builtin")


def test_prompts_path_is_a_folder_or_not_text(tmp_path: Path) -> None:
    usage_error(audit(*PAIR, "--prompts", str(tmp_path), out=tmp_path / "out"), str(tmp_path), "is not a file")
    binary = tmp_path / "prompts.bin"
    binary.write_bytes(b'{"prompt": "\xff\xfe"}\n')
    usage_error(audit(*PAIR, "--prompts", str(binary), out=tmp_path / "out"), str(binary), "not UTF-8")


@pytest.mark.parametrize("lines", [(), ("", "   ")])
def test_prompts_file_empty(tmp_path: Path, lines) -> None:
    path = _prompts(tmp_path, *lines)
    usage_error(audit(*PAIR, "--prompts", path, out=tmp_path / "out"), path, "is empty")


def test_prompts_not_jsonl(tmp_path: Path) -> None:
    path = _prompts(tmp_path, '{"prompt": "fine"}', "", "prompt: not json")
    usage_error(audit(*PAIR, "--prompts", path, out=tmp_path / "out"), f"{path}:3:", "not JSON", "JSONL")


def test_prompts_json_but_not_an_object(tmp_path: Path) -> None:
    path = _prompts(tmp_path, "[1, 2, 3]")
    usage_error(audit(*PAIR, "--prompts", path, out=tmp_path / "out"), f"{path}:1:", "expected a JSON object")


def test_prompts_without_a_usable_field(tmp_path: Path) -> None:
    path = _prompts(tmp_path, '{"input_ids": [1]}', '{"question": "why?", "id": 7}')
    usage_error(audit(*PAIR, "--prompts", path, out=tmp_path / "out"), f"{path}:2:", "no usable field",
                "id, question", "input_ids, prompt, text or turns")


@pytest.mark.parametrize("record", [{"input_ids": []}, {"prompt": ""}, {"turns": [""]}])
def test_empty_prompt(tmp_path: Path, record) -> None:
    path = _prompts(tmp_path, '{"prompt": "a"}', json.dumps(record))
    usage_error(audit(*PAIR, "--prompts", path, out=tmp_path / "out"), f"{path}:2:", "empty prompt")


@pytest.mark.parametrize("ids, fragments", [
    ([72, 259], ("token id 259", "outside the model's vocabulary (0..258)")),
    ([72, -4], ("token id -4", "negative")),
    ([72, 1.5], ("integer token ids",)),
    ([72, True], ("integer token ids",)),
])
def test_token_ids_out_of_range_or_not_integers(tmp_path: Path, ids, fragments) -> None:
    path = _prompts(tmp_path, '{"input_ids": [1, 2]}', json.dumps({"input_ids": ids}))
    usage_error(audit(*PAIR, "--prompts", path, out=tmp_path / "out"), f"{path}:2:", *fragments)


def test_prompt_plus_new_tokens_beyond_positions(tmp_path: Path) -> None:
    # tiny-gpt2 learns absolute positions: a longer sequence has no position embedding at all
    from specaudit.engines.models import zoo

    positions = zoo.build_builtin_pair("tiny-gpt2")[0].config.max_position_embeddings
    path = _prompts(tmp_path, '{"input_ids": [1]}', json.dumps({"input_ids": [65] * (positions - 10)}))
    usage_error(audit("--engine", "eqspec", "--pair", "tiny-gpt2", "--prompts", path, "--max-new-tokens", "16",
                      out=tmp_path / "out"),
                f"{path}:2:", f"{positions - 10} prompt tokens + 16 new tokens", f"{positions} positions",
                "--max-new-tokens")


def test_blank_lines_are_skipped_and_line_numbers_stay_true(tmp_path: Path) -> None:
    from specaudit.equivalence.prompts import PromptError, load_prompts

    path = _prompts(tmp_path, '{"input_ids": [1]}', "", '{"input_ids": [2, 3]}', "", '{"input_ids": [300]}')
    assert load_prompts(path, None, 2, vocab_size=259) == [[1], [2, 3]]  # the bad line is past --num-prompts
    with pytest.raises(PromptError, match=r"prompts\.jsonl:5:"):
        load_prompts(path, None, vocab_size=259)


def test_help_tells_the_failure_options_and_their_defaults() -> None:
    result = cli("audit", "--help")
    assert result.returncode == 0
    for text in ("--timeout SECONDS", "(default: 3600.0)", "--allow-pickle-weights", "--trust-remote-code"):
        assert text in result.stdout
