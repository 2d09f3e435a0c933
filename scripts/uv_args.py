"""Print, one per line, the `uv pip install` options that give uv the package sources pip is configured with.

pip's configuration (its files and PIP_* variables, as `pip config list` shows them) names the index, the
extra indexes, find-links folders and constraint files; uv reads none of it. Every index is searched for the
best version, as pip does (`--index-strategy unsafe-best-match`). A CA bundle that pip is told to trust is
printed last as `SSL_CERT_FILE=PATH`, for the caller to put in uv's environment.

Usage: python scripts/uv_args.py   (with the python whose pip configuration counts)
"""

from __future__ import annotations

import shlex
import subprocess
import sys

OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
           "constraint": "--constraint"}


def pip_config() -> dict[str, list[str]]:
    """pip's settings, name -> values (every section: global, install, the environment)."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            check=True).stdout
    settings: dict[str, list[str]] = {}
    for line in listed.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        name = key.rsplit(".", 1)[-1]
        settings.setdefault(name, []).extend(shlex.split(shlex.split(value)[0]) if value else [])
    return settings


def main() -> None:
    settings = pip_config()
    lines = ["--index-strategy", "unsafe-best-match"]
    for name, option in OPTIONS.items():
        for value in dict.fromkeys(settings.get(name, [])):  # each once, in order
            lines += [option, value]
    for cert in settings.get("cert", [])[:1]:
        lines.append(f"SSL_CERT_FILE={cert}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
