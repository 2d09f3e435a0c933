"""Checks made before any run of an audit; each failure is a one-line `UsageError` (exit 2).

`preflight(config)` runs before a model is loaded:
- numbers: batch sizes, draft tokens (k), max_new_tokens and num_prompts at least 1, a positive timeout;
- dtypes known, the device present (`cuda` needs a GPU) and able to run every dtype (a tiny matmul,
  softmax and attention in that dtype on that device);
- engine names: built in, `PREFIX:LOCATION`, or an importable callable `module:factory`;
- pairs: a built-in name, or two local folders (`engines.models.model_files`: config, safetensors weights
  or the pickle opt-in, custom code opt-in, one vocabulary and tokenizer);
- the EOS ids (`--eos-token-id ID` or `A,B`): each in every pair's vocabulary;
- prompts: for every pair, the prompt set loads and fits its vocabulary and positions (not the
  built-in set when every engine is a recording: recordings bring their own prompts).

`check_factories(config, pair)` runs after the first pair is loaded and before its first run: each
engine that is not built in is built once; a factory that raises (a recording that is missing or
malformed, a server that cannot be reached, a bad option) or returns something without
`generate()` is a usage error, and so is a server engine whose host and port take no TCP connection,
or a recording whose prompts do not fit the pair (vocabulary, positions). Later builds that fail
are failed runs.
"""

from __future__ import annotations

import json
import socket
import urllib.parse
from dataclasses import dataclass
from typing import Any

import torch

from specaudit.engines.models import model_files
from specaudit.engines.models import zoo
from specaudit.engines.registry import BUILTIN_ENGINES, EngineSpecError, black_box_prefix, make_engine, resolve
from specaudit.equivalence.errors import ModelError, UsageError, one_line
from specaudit.equivalence.prompts import check_ids, load_prompts
from specaudit.engines.contract import capability
from specaudit.equivalence.pipeline.settings import AuditSettings, UserPair


@dataclass
class PairLimits:
    """What the prompts must fit: known before the models are loaded."""

    name: str
    vocab_size: int | None
    max_positions: int | None
    tokenizer: Any | None


def preflight(config: AuditSettings) -> None:
    """Raise `UsageError` for anything in the audit's settings that cannot run."""
    check_numbers(config)
    check_dtypes(config.dtypes)
    check_device(config.device, config.dtypes)
    for name in config.engines:
        check_engine_name(name)
    if config.plain_engine:
        check_engine_name(config.plain_engine)
    # recordings bring their own prompts (checked against the pair in `check_factories`): the prompt set
    # is not used unless one is given
    prompts_used = config.prompts != "builtin" or not all(black_box_prefix(n) == "recorded" for n in config.engines)
    for spec in config.pairs:
        limits = pair_limits(spec)
        check_eos_ids(config.eos_token_id, limits)
        if prompts_used:
            load_prompts(config.prompts, limits.tokenizer, config.num_prompts, vocab_size=limits.vocab_size,
                         max_positions=limits.max_positions, max_new_tokens=config.max_new_tokens)


def check_eos_ids(eos: Any, limits: PairLimits) -> None:
    """`--eos-token-id`: "pair", None, one id or a list of ids, each a whole number in the pair's vocabulary."""
    if eos is None or eos == "pair":
        return
    ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    if not ids:
        raise UsageError("--eos-token-id: the set of EOS ids is empty: give an id, ids A,B, pair, or none")
    shown = ",".join(str(i) for i in ids)
    for eos_id in ids:
        if isinstance(eos_id, bool) or not isinstance(eos_id, int):
            raise UsageError(f"--eos-token-id {shown}: {eos_id!r} is not a token id: give whole numbers, pair, or none")
        if eos_id < 0 or (limits.vocab_size is not None and eos_id >= limits.vocab_size):
            bound = f"0..{limits.vocab_size - 1}" if limits.vocab_size is not None else "0 or more"
            raise UsageError(f"--eos-token-id {shown}: {eos_id} is outside the vocabulary of {limits.name} ({bound}): "
                             "give ids from its tokenizer, pair, or none")
    if len(set(ids)) != len(ids):
        raise UsageError(f"--eos-token-id {shown} names an id twice: give each EOS id once")


def check_numbers(config: AuditSettings) -> None:
    for option, values in (("--batch-size", config.batch_sizes), ("--draft-tokens", [config.draft_tokens]),
                           ("--max-new-tokens", [config.max_new_tokens]),
                           ("--num-prompts", [] if config.num_prompts is None else [config.num_prompts])):
        for value in values:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{option} {value!r}: must be a whole number of at least 1")
    if not config.batch_sizes:
        raise UsageError("--batch-size: give at least one batch size, e.g. --batch-size 1 8")
    timeout = config.timeout
    if timeout is not None and not timeout > 0:
        raise UsageError(f"--timeout {timeout!r}: must be a positive number of seconds")


def check_dtypes(dtypes: list[str]) -> None:
    if not dtypes:
        raise UsageError(f"--dtype: give at least one of {', '.join(zoo.DTYPES)}")
    for dtype in dtypes:
        if dtype not in zoo.DTYPES:
            raise UsageError(f"unknown dtype {dtype!r}: use one of {', '.join(zoo.DTYPES)}")


def check_device(device: str, dtypes: list[str]) -> None:
    """The device exists here and runs each dtype's basic operations (`auto`: accelerate installed, and the
    first device its device map would use)."""
    if device == "auto":
        from specaudit.engines.models.pair import accelerate_missing

        missing = accelerate_missing()
        if missing is not None:
            raise UsageError(missing)
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    try:
        where = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise UsageError(f"unknown device {device!r}: use cpu, cuda, cuda:N or auto") from None
    if where.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {device}: no CUDA GPU is available on this machine: use --device cpu")
        if where.index is not None and where.index >= torch.cuda.device_count():
            raise UsageError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s): "
                             f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    elif where.type != "cpu":
        backend = getattr(torch, where.type, None) or getattr(torch.backends, where.type, None)
        available = getattr(backend, "is_available", None)
        if available is None or not available():
            raise UsageError(f"--device {device}: no {where.type} device is available here: use --device cpu")
    for dtype in dtypes:
        try:
            probe_dtype(zoo.DTYPES[dtype], where)
        except Exception as exc:  # whatever the backend raises, the dtype cannot run here
            raise UsageError(f"dtype {dtype} cannot run on {device} ({type(exc).__name__}): choose another --dtype, "
                             "e.g. float32") from None


def probe_dtype(dtype: torch.dtype, device: torch.device) -> None:
    """A matmul, softmax, norm and attention in `dtype` on `device`: what every decoder step needs."""
    x = torch.linspace(-1, 1, 32, dtype=torch.float32).reshape(1, 1, 4, 8).to(device=device, dtype=dtype)
    scores = (x @ x.transpose(-1, -2)).softmax(-1)
    normed = torch.nn.functional.layer_norm(x, (8,))
    attended = torch.nn.functional.scaled_dot_product_attention(normed, normed, normed, is_causal=True)
    float(scores.sum().item()) + float(attended.sum().item())


def check_engine_name(name: str) -> None:
    try:
        resolve(name)
    except EngineSpecError as exc:
        raise UsageError(str(exc)) from None


def pair_limits(spec: str | UserPair) -> PairLimits:
    """Check a pair (a built-in name, or a `UserPair`: two local folders) without loading weights; return
    what its prompts must fit."""
    if isinstance(spec, str):
        if spec not in zoo.builtin_pair_names():
            raise UsageError(f"unknown pair {spec!r}: use a built-in pair ({', '.join(zoo.builtin_pair_names())}) "
                             "or --target PATH --draft PATH")
        fixture = json.loads((zoo.PAIR_DIR / f"{spec}.json").read_text())
        known = [model.get("max_position_embeddings", model.get("n_positions"))
                 for model in (fixture["target"], fixture.get("draft", {}))]
        positions = min((p for p in known if p is not None), default=None)
        return PairLimits(spec, zoo.ByteTokenizer.vocab_size, positions, zoo.ByteTokenizer())
    trust, allow_pickle = spec.trust_remote_code, spec.allow_pickle_weights
    try:
        for role, path in (("target", spec.target), ("draft", spec.draft)):
            if path is not None:  # no draft: a target alone, for black-box engines
                model_files.check_model_folder(path, role, allow_pickle_weights=allow_pickle, trust_remote_code=trust)
        shared = None
        if spec.draft is not None:  # prompts must fit the ids both models have
            shared = model_files.check_same_vocabulary(spec.target, spec.draft, trust_remote_code=trust)
    except model_files.ModelFolderError as exc:
        raise ModelError(str(exc)) from None
    config = model_files.read_config(spec.target)
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    vocab = config.get("vocab_size", text_config.get("vocab_size"))
    if shared is not None and vocab is not None:
        vocab = min(vocab, shared)
    # the draft decodes the same sequences: the smaller of the two position limits holds
    known = [p for p in (_positions(spec.target), _positions(spec.draft)) if p is not None]
    positions = min(known) if known else None
    tokenizer = None
    try:
        from transformers import AutoTokenizer

        if model_files.has_tokenizer_files(spec.target):
            tokenizer = AutoTokenizer.from_pretrained(spec.target, local_files_only=True, trust_remote_code=trust)
    except Exception:  # no tokenizer: token-id prompts still work; text prompts get a clear error
        tokenizer = None
    return PairLimits(str(spec.target), vocab, positions, tokenizer)


def _positions(path: Any) -> int | None:
    """The most positions a local model folder's config allows, when it says."""
    if path is None:
        return None
    config = model_files.read_config(path)
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for key in ("max_position_embeddings", "n_positions", "seq_length", "max_sequence_length"):
        value = config.get(key, text_config.get(key))
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def check_factories(config: AuditSettings, pair: zoo.ModelPair) -> None:
    """Build every non-built-in engine once on `pair` at the first batch size (see the module doc)."""
    for name in config.engines:
        if name in BUILTIN_ENGINES:
            continue
        options = {"pad_token_id": pair.pad_token_id, **config.engine_options}
        try:
            engine = make_engine(name, pair.target, pair.draft, batch_size=config.batch_sizes[0],
                                 draft_tokens=config.draft_tokens, **options)
        except EngineSpecError as exc:
            raise UsageError(f"{exc}: the factory must return an object with generate(prompts, max_new_tokens, "
                             "eos_token_id)") from None
        except Exception as exc:  # any failure to build is the factory's (or its input's) problem
            if black_box_prefix(name):  # a recording or server: its own message names the file or URL and the fix
                raise UsageError(f"engine {name!r}: {one_line(str(exc))}") from None
            raise UsageError(f"engine {name!r} could not be built: {type(exc).__name__}: {one_line(str(exc))}: "
                             "fix the factory or its --engine-option values") from None
        url = capability(engine, "url")
        if isinstance(url, str) and capability(engine, "black_box"):
            check_reachable(name, url)
        recorded = capability(engine, "recorded_prompts")
        if recorded is not None:  # a recording brings its own prompts: they must fit this pair's model
            source = capability(engine, "path") or name
            positions = [getattr(model.config, "max_position_embeddings", None)
                         for model in (pair.target, pair.draft) if model is not None]
            positions = [p for p in positions if isinstance(p, int)]
            for number, ids in enumerate(recorded[: config.num_prompts] if config.num_prompts else recorded, 1):
                check_ids(f"{source}, prompt {number}", list(ids), getattr(pair.target.config, "vocab_size", None),
                          min(positions) if positions else None, config.max_new_tokens)
        close = capability(engine, "close")
        if callable(close):
            close()


def check_reachable(name: str, url: str, timeout: float = 10.0) -> None:
    """A TCP connection to a server engine's host and port can be made (nothing is sent)."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise UsageError(f"engine {name!r}: {url!r} has no valid port: fix the URL in the engine name") from None
    try:
        with socket.create_connection((parts.hostname or "localhost", port), timeout=timeout):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UsageError(f"engine {name!r}: cannot reach the server at {url} ({reason}): start the server, or "
                         "fix the URL in the engine name") from None
