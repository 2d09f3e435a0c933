"""Hypothesis profiles for the property tests: `dev` (fast), `ci` (derandomized, no example
database, prints reproduction blobs) and `thorough` (many examples, for a nightly run).

`load_profile()` picks `SPECAUDIT_PROFILE` when set, else `ci` when the `CI` environment
variable is set, else `dev`. Tests scale their example counts with `examples(weight)`, so a
costly model test and a cheap tensor test both follow the active profile.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILES = ("dev", "ci", "thorough")
BASE_EXAMPLES = {"dev": 10, "ci": 20, "thorough": 200}

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

settings.register_profile("dev", max_examples=BASE_EXAMPLES["dev"], **_common)
settings.register_profile("ci", max_examples=BASE_EXAMPLES["ci"], derandomize=True, database=None,
                          print_blob=True, **_common)
settings.register_profile("thorough", max_examples=BASE_EXAMPLES["thorough"], print_blob=True, **_common)


def profile_name(environ: dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    name = env.get("SPECAUDIT_PROFILE") or ("ci" if env.get("CI") else "dev")
    if name not in PROFILES:
        raise ValueError(f"SPECAUDIT_PROFILE={name!r}: choose one of {', '.join(PROFILES)}")
    return name


def load_profile(environ: dict[str, str] | None = None) -> str:
    name = profile_name(environ)
    settings.load_profile(name)
    return name


def examples(weight: float) -> int:
    """The active profile's example count scaled by `weight` (at least 1)."""
    return max(1, round(settings().max_examples * weight))
