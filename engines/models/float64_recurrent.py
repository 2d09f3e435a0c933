"""Float64 switches for the layers that leave float64: recurrences, RMS norms and expert routers.

transformers' reference PyTorch paths (used when `flash-linear-attention` and `causal_conv1d` are
absent) compute the recurrences in float32 whatever the model's dtype: the gated delta rule casts
query, key, value, beta and the decay to float32; the Mamba-2 scans and their single-token state
update cast dt, A, B and C; the decay of gated delta-net comes from `A_log.float()`. Every RMS norm
(Llama's, Qwen3's, Gemma's, gated or not) normalises in float32, and expert routers take their softmax
with `dtype=torch.float`. A float64 oracle would carry float32 noise there: two float64 inputs that
differ by rounding alone (a row alone against the same row in a batch) land on different float32 values
once in a while, and the logits then differ by about 1e-7 (found on tiny-lfm2, a 14-token prompt and
21 new tokens beside a 1-token prompt at batch size 2, every engine). Rotary embeddings stay as they
are: their float32 values depend on the position alone, the same in every batch.

`prepare_recurrent_float64(model)` swaps in the same code with every float32 cast turned into a
float64 cast (the source of each function or `forward`, with `torch.float32` read as
`torch.float64` and `.float()` as `.double()`), and every depthwise `conv1d` (the short
convolutions) computed as an explicit sum over the kernel (`depthwise_conv1d`: torch's CPU conv1d
costs tens of milliseconds per call on these shapes, which made a float64 audit of a hybrid pair
take many minutes):

- a mixer's, norm's or router's `forward` on that model's own module instances (nothing else changes);
- a module-level function of the model's family (the scans, the delta rules): the module's name is
  bound to a dispatcher that runs the float64 copy when any tensor argument is float64 and the
  original otherwise, so a model of the same family in another dtype computes as before.

Returns notes naming what was switched; `engines/models/float64.py` adds them to `float64_switches`.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
import textwrap
import types
from typing import Any, Callable

import torch
from transformers import PreTrainedModel

# module-level functions of the recurrent paths, by name
_FUNCTION_NAME = re.compile(r"gated_delta_rule|selective_state_update|chunk_scan|ssd|segment_sum|selective_scan|causal_conv1d")
# classes whose forward runs a recurrence, an RMS norm (gated or not) or an expert router: each casts to float32
_CLASS_NAME = re.compile(r"GatedDeltaNet|Mixer|RMSNorm|ShortConv|Mamba|Router")
_BARE_FLOAT = re.compile(r"torch\.float\b")  # `dtype=torch.float` (float32), not float16 or float64
_MARK = "_specaudit_float64"


def _explicit_convolutions(source: str) -> str:
    """`source` without its decorators (kernel hub, accelerate hooks), its conv1d calls as explicit sums."""
    lines = textwrap.dedent(source).splitlines()
    while lines and lines[0].lstrip().startswith("@"):
        lines.pop(0)
    return "\n".join(lines).replace("F.conv1d(", f"{_CONV}(").replace("nn.functional.conv1d(", f"{_CONV}(")


def _as_float64(source: str) -> str:
    source = _explicit_convolutions(source)
    source = source.replace("torch.float32", "torch.float64").replace(".float()", ".double()")
    return _BARE_FLOAT.sub("torch.float64", source)


_CONV = "_specaudit_depthwise_conv1d"
HALF_DTYPES = (torch.bfloat16, torch.float16)


def depthwise_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride: int = 1,
                     padding: int | tuple = 0, dilation: int = 1, groups: int = 1) -> torch.Tensor:
    """`F.conv1d` for a depthwise convolution (`groups` = channels) as one explicit sum over the kernel;
    anything else goes to `F.conv1d`. torch's CPU conv1d takes tens of milliseconds per call on these
    shapes (measured 45 ms for [4, 80, 4] in float64, the explicit sum 0.04 ms), and in bfloat16 about
    200 ms. Half-precision inputs are summed in float32 and rounded once, as torch's CPU kernel does
    (`tests/test_recurrent.py` checks the two bit for bit)."""
    if x.dtype in HALF_DTYPES:
        out = depthwise_conv1d(x.float(), weight.float(), None if bias is None else bias.float(), stride, padding,
                               dilation, groups)
        return out.to(x.dtype)
    pad = padding[0] if isinstance(padding, tuple) else padding
    channels = x.shape[1]
    if not (groups == channels == weight.shape[0] and weight.shape[1] == 1 and stride in (1, (1,))
            and dilation in (1, (1,)) and isinstance(pad, int)):
        return torch.nn.functional.conv1d(x, weight, bias, stride, padding, dilation, groups)
    if pad:
        x = torch.nn.functional.pad(x, (pad, pad))
    windows = x.unfold(-1, weight.shape[-1], 1)  # [B, C, L', K]
    out = (windows * weight[:, 0][None, :, None, :]).sum(-1)  # [B, C, L']
    return out if bias is None else out + bias[None, :, None]


def _compile(function: Callable[..., Any], module: types.ModuleType, *, float64: bool = True) -> Callable[..., Any]:
    """The float64 copy of `function` (or, with `float64=False`, the copy with only its depthwise
    convolutions as explicit sums), its globals the live module (so it calls the switched functions)."""
    source = (_as_float64 if float64 else _explicit_convolutions)(inspect.getsource(function))
    scope = dict(vars(module))
    exec(compile(source, f"<float64 {function.__qualname__}>", "exec"), scope)
    compiled = scope[function.__name__]
    setattr(module, _CONV, depthwise_conv1d)
    return types.FunctionType(compiled.__code__, vars(module), compiled.__name__, compiled.__defaults__,
                              compiled.__closure__)


def _uses_float32(function: Callable[..., Any]) -> bool:
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    return "torch.float32" in source or ".float()" in source or "conv1d(" in source or bool(_BARE_FLOAT.search(source))


def _any_float64(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(a, torch.Tensor) and a.dtype == torch.float64 for a in (*args, *kwargs.values()))


def _half_on_cpu(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(a, torch.Tensor) and a.dtype in HALF_DTYPES and a.device.type == "cpu"
               for a in (*args, *kwargs.values()))


def _dispatcher(original: Callable[..., Any], float64_copy: Callable[..., Any],
                half_copy: Callable[..., Any]) -> Callable[..., Any]:
    """float64 tensors: the float64 copy; half precision on the CPU: the copy with explicit-sum
    convolutions (same values, `depthwise_conv1d`); anything else (float32, any GPU): the original."""
    @functools.wraps(original)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        if _any_float64(args, kwargs):
            return float64_copy(*args, **kwargs)
        if _half_on_cpu(args, kwargs):
            return half_copy(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(dispatch, _MARK, original)
    return dispatch


def _switch_functions(module: types.ModuleType) -> list[str]:
    switched = []
    for name, value in sorted(vars(module).items()):
        if not (inspect.isfunction(value) and _FUNCTION_NAME.search(name)):
            continue
        if hasattr(value, _MARK):
            switched.append(name)  # already switched (another model of this family)
            continue
        if value.__module__ != module.__name__ or not _uses_float32(value):
            continue
        setattr(module, name, _dispatcher(value, _compile(value, module), _compile(value, module, float64=False)))
        switched.append(name)
    return switched


def prepare_recurrent_float64(model: PreTrainedModel) -> list[str]:
    """Switch `model`'s recurrent paths (already float64) to float64 arithmetic; notes on what changed."""
    module = sys.modules.get(type(model).__module__)
    if module is None:
        return []
    methods: set[str] = set()
    functions = _switch_functions(module)
    for submodule in model.modules():
        cls = type(submodule)
        if _switch_depthwise_conv(submodule):
            methods.add("Conv1d (depthwise)")
            continue
        if cls.__module__ != module.__name__ or not _CLASS_NAME.search(cls.__name__):
            continue
        if not _uses_float32(cls.forward):
            continue
        try:
            forward = _compile(cls.forward, module)
        except (OSError, SyntaxError, TypeError):
            continue
        submodule.forward = types.MethodType(forward, submodule)
        methods.add(cls.__name__)
    plain = sorted(m for m in methods if m.endswith(("RMSNorm", "Router")))  # in every family, not only hybrids
    recurrent = sorted(methods - set(plain)) + [f"{name}()" for name in functions]
    notes = [f"recurrent layers: float64, depthwise convolutions as explicit sums ({', '.join(recurrent)})"] if recurrent else []
    return notes + ([f"RMS norms and routers: float64 ({', '.join(plain)})"] if plain else [])


def _switch_depthwise_conv(submodule: torch.nn.Module) -> bool:
    """A depthwise `Conv1d` computes through `depthwise_conv1d` from now on; whether `submodule` is one."""
    if not (isinstance(submodule, torch.nn.Conv1d) and submodule.groups == submodule.in_channels > 1):
        return False
    submodule.forward = functools.partial(_conv_module_forward, submodule)
    return True


def _conv_module_forward(conv: torch.nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    return depthwise_conv1d(x, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups)


def prepare_half_convolutions(model: PreTrainedModel) -> list[str]:
    """On the CPU below float64: `model`'s depthwise convolutions (its `Conv1d` modules and its family's
    conv functions) as explicit sums in float32 rounded to the model's dtype, the values torch's CPU
    kernel gives at a thousandth of its cost; nothing else changes. Notes on what was switched."""
    if model.device.type != "cpu" or model.dtype not in HALF_DTYPES:
        return []
    module = sys.modules.get(type(model).__module__)
    functions = [name for name in (_switch_functions(module) if module is not None else [])
                 if "conv" in name]
    convolutions = sum(_switch_depthwise_conv(submodule) for submodule in model.modules())
    if not functions and not convolutions:
        return []
    switched = ([f"{convolutions} Conv1d"] if convolutions else []) + [f"{name}()" for name in functions]
    return [f"depthwise convolutions as explicit sums in float32, rounded to {str(model.dtype).removeprefix('torch.')} "
            f"as torch's CPU kernel rounds them ({', '.join(switched)})"]
