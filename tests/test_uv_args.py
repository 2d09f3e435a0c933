"""scripts/uv_args.py: uv is given the package sources pip is configured with (its files and PIP_* variables)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "uv_args.py"


def uv_args(tmp_path: Path, config: str, **env: str) -> list[str]:
    (tmp_path / "pip.conf").write_text(config)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    clean.update(PIP_CONFIG_FILE=str(tmp_path / "pip.conf"), **env)
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=clean, check=True)
    return done.stdout.splitlines()


def test_indexes_find_links_constraints_and_cert_reach_uv(tmp_path: Path) -> None:
    config = ("[global]\nindex-url = https://mirror.example/simple\n"
              "extra-index-url = file:///a/simple file:///b/simple\nfind-links = /wheels\ncert = /ca.pem\n"
              "[install]\nconstraint = /c.txt\n")
    lines = uv_args(tmp_path, config, PIP_FIND_LINKS="/more-wheels")
    pairs = list(zip(lines[:-1:2], lines[1:-1:2]))
    assert pairs[0] == ("--index-strategy", "unsafe-best-match")
    assert ("--index-url", "https://mirror.example/simple") in pairs
    assert [v for o, v in pairs if o == "--extra-index-url"] == ["file:///a/simple", "file:///b/simple"]  # in order
    assert {v for o, v in pairs if o == "--find-links"} == {"/wheels", "/more-wheels"}
    assert ("--constraint", "/c.txt") in pairs
    assert lines[-1] == "SSL_CERT_FILE=/ca.pem"

