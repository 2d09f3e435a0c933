"""Deprecation and future warnings from specaudit's own calls fail the suite; a library's warnings
about its own internals do not.

pyproject's `filterwarnings` turns DeprecationWarning, PendingDeprecationWarning and FutureWarning
into errors when Python attributes them to a `specaudit` module. A model's `forward` warns about
its arguments at `stacklevel=2`, which names torch's module-call dispatch (`Module._call_impl`), not
the code that called the model. `attribute_to_module_callers` re-attributes such a warning past the
dispatch frames to the caller of the module, so the filter sees who passed the argument.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
# frames that only forward a call into a module: torch's nn.Module.__call__ machinery
DISPATCH_MODULES = frozenset({"torch.nn.modules.module"})

_plain_warn = warnings.warn


def _category(message: Any, category: type[Warning] | None) -> type[Warning]:
    if isinstance(message, Warning):
        return type(message)
    return category or UserWarning


def _warn(message: Any, category: type[Warning] | None = None, stacklevel: int = 1, source: Any = None,
          **kwargs: Any) -> None:
    if issubclass(_category(message, category), DEPRECATIONS):
        try:
            while sys._getframe(stacklevel).f_globals.get("__name__") in DISPATCH_MODULES:
                stacklevel += 1
        except ValueError:  # the stack is shallower than the level asked for: leave it as asked
            pass
    _plain_warn(message, category, stacklevel + 1, source, **kwargs)


def attribute_to_module_callers() -> None:
    """Install the re-attribution (idempotent)."""
    warnings.warn = _warn
