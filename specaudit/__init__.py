"""specaudit: prove batched speculative decoding equivalent to greedy decoding, or show where not.

The installed package maps the repository's folders into one namespace (see pyproject.toml):
`specaudit.engines` (engines/), `specaudit.equivalence` (equivalence/), `specaudit.testing`
(property_tests/: public Hypothesis strategies and properties) and `specaudit.fixtures`
(fixtures/: package data). The names below are the public API (`specaudit.equivalence.api`);
they load on first use, so `import specaudit` (and the pytest plugin) stays cheap.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

try:
    __version__ = metadata.version("specaudit")
except metadata.PackageNotFoundError:  # running from a checkout that was never installed
    __version__ = "0+unknown"

__all__ = ["AuditReport", "audit", "load_pair", "read_report", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("AuditReport", "audit", "load_pair", "read_report"):
        from specaudit.equivalence import api

        return getattr(api, name)
    raise AttributeError(f"module 'specaudit' has no attribute {name!r}")
