"""What every loaded pair is: a target and its draft on one device and dtype (`ModelPair`), the
byte tokenizer of the built-in pairs, and the dtype names. Shared by the tiny pairs (`zoo`) and the
bench pair (`bench_pair`), which do not import each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from specaudit.engines.limits import eos_ids

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class ByteTokenizer:
    """UTF-8 bytes as token ids, plus three specials; the tokenizer of the built-in pairs."""

    pad_token_id = 256
    bos_token_id = 257
    eos_token_id = 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes, for a grammar engine's vocabulary (engines/constraints/matcher.py): the specials none."""
        return [bytes([i]) for i in range(256)] + [b"", b"", b""]

    def decode(self, ids: list[int]) -> str:
        specials = {256: "<pad>", 257: "<bos>", 258: "<eos>"}
        out, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            out.append(specials.get(i, f"<{i}>"))
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


@dataclass
class ModelPair:
    """A target and its draft, on one device and dtype, sharing one vocabulary."""

    name: str
    target: PreTrainedModel
    draft: PreTrainedModel | None  # None: a target alone, for black-box engines
    tokenizer: Any | None
    # the ids that end a row: one id, or the tuple of every EOS id the target's generation config
    # declares (Llama 3, Qwen and Gemma declare several); None: no EOS
    eos_token_id: int | tuple[int, ...] | None
    pad_token_id: int
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The EOS ids as a tuple (empty with none): stopping at any of them is correct."""
        return eos_ids(self.eos_token_id)


AUTO = "auto"  # `--device auto`: accelerate's device_map="auto" over the machine's devices


def prepare_model(model: PreTrainedModel, dtype: torch.dtype, device: str) -> PreTrainedModel:
    if device == AUTO:
        model = dispatch_auto(model.to(dtype=dtype) if getattr(model, "hf_device_map", None) is None else model)
    else:
        model = model.to(device=device, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    return model


def accelerate_missing() -> str | None:
    """Why `--device auto` cannot run here (accelerate not installed), or None."""
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:
        return ("--device auto splits the target over this machine's devices with accelerate's device_map=\"auto\", "
                "and accelerate is not installed: pip install accelerate (or specaudit[gguf]), or give --device cpu "
                "or cuda[:N]")
    return None


def dispatch_auto(model: PreTrainedModel) -> PreTrainedModel:
    """`model` placed by accelerate over the machine's devices (its layers split over the GPUs in order, the
    rest on the CPU); a model loaded with device_map="auto" is already placed and is returned as it is."""
    if getattr(model, "hf_device_map", None) is not None:
        return model
    from accelerate import dispatch_model, infer_auto_device_map

    no_split = getattr(model, "_no_split_modules", None) or []
    device_map = infer_auto_device_map(model, no_split_module_classes=list(no_split), dtype=next(model.parameters()).dtype)
    if set(device_map.values()) <= {"cpu"}:
        model.hf_device_map = {"": "cpu"}
        return model
    model = dispatch_model(model, device_map=device_map)
    model.hf_device_map = device_map
    return model
