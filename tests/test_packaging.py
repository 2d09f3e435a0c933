"""The package as a user gets it: a wheel built from the checkout, installed (not editable) into a
fresh virtual environment, used from a folder outside the checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


ROOT = Path(__file__).resolve().parents[1]
GENERIC_NAMES = ("engines", "equivalence", "property_tests", "fixtures")


def _run(args: list[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTEST_ADDOPTS")}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _link_requirements(folder: Path) -> Path:
    """`folder` holding links to what the wheel requires, as installed in this environment (each
    distribution's files and metadata, and so on down its own requirements), nothing else: on the new
    venv's path, pip finds every requirement satisfied and installs the wheel alone. (Installing them
    from pip's cache took minutes on 2 cores: numpy, matplotlib, transformers, torch's 700 MB.)"""
    from importlib import metadata

    from packaging.requirements import Requirement

    folder.mkdir()
    wanted, seen = ["specaudit"], set()
    while wanted:
        name = wanted.pop()
        if name in seen:
            continue
        seen.add(name)
        dist = metadata.distribution(name)
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                wanted.append(requirement.name)
        if name == "specaudit":  # the wheel under test brings its own files
            continue
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (folder / top).exists() and not top.endswith(".pth"):
                (folder / top).symlink_to(source)
    return folder


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the venv's python, a work folder outside the checkout) with the wheel installed."""
    base = tmp_path_factory.mktemp("wheel-install")
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(base / "dist"), str(ROOT)], base)
    assert built.returncode == 0, built.stderr
    wheels = list((base / "dist").glob("specaudit-*.whl"))
    assert len(wheels) == 1, wheels
    venv = base / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)], base).returncode == 0
    python = venv / "bin" / "python"
    # the requirements as installed here (torch 2.13.0+cpu among them), linked rather than installed again
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], base).stdout.strip()
    (Path(site) / "specaudit-test-requirements.pth").write_text(f"{_link_requirements(base / 'requirements')}\n")
    installed = _run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                      f"torch=={torch.__version__}", str(wheels[0])], base)
    assert installed.returncode == 0, installed.stderr[-4000:]
    work = base / "work"
    work.mkdir()
    return python, work


def test_wheel_ships_one_namespace_with_its_data(installed: tuple[Path, Path]) -> None:
    python, work = installed
    probe = _run([str(python), "-c", "import json, site, sys; print(json.dumps(site.getsitepackages()))"], work)
    site_packages = [Path(p) for p in json.loads(probe.stdout)]
    names = {entry.name for folder in site_packages if folder.is_dir() for entry in folder.iterdir()}
    assert "specaudit" in names
    assert not names & set(GENERIC_NAMES), names & set(GENERIC_NAMES)
    package = next(folder / "specaudit" for folder in site_packages if (folder / "specaudit").is_dir())
    assert sorted(p.name for p in (package / "fixtures" / "pairs").glob("tiny-*.json"))
    assert (package / "fixtures" / "prompts.jsonl").is_file()
    assert not (package / "testing" / "faults").exists()  # planted faults are test-only
    for name in GENERIC_NAMES:
        result = _run([str(python), "-c", f"import {name}"], work)
        assert result.returncode != 0, f"`import {name}` works after installing the wheel"
    public = _run([str(python), "-c", "from specaudit.testing.strategies import decoding_cases\n"
                   "from specaudit.testing.properties import check_equivalence"], work)
    assert public.returncode == 0, public.stderr
    api = _run([str(python), "-c", "import specaudit; print(specaudit.__version__, specaudit.audit.__name__)"], work)
    assert api.returncode == 0 and api.stdout.split() == [api.stdout.split()[0], "audit"], api.stderr


def test_wheel_smoke_audit_from_outside_the_checkout(installed: tuple[Path, Path]) -> None:
    """The installed console script audits two engines on two pairs, the built-in prompts only (the adversarial
    ones, 9 s of this run's 22 on 2 cores, have their own tests in the checkout)."""
    python, work = installed
    script = python.parent / "specaudit"
    result = _run([str(script), "audit", "--engine", "eqspec", "--engine", "exspec", "--pair", "tiny-llama",
                   "--pair", "tiny-gpt2", "--batch-size", "2", "--num-prompts", "4", "--max-new-tokens", "8",
                   "--dtype", "float64", "--no-progress", "--no-adversarial", "--out", "out"], work)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    audit = json.loads((work / "out" / "audit.json").read_text())
    assert len(audit["runs"]) == 4
    assert all(run["exact_matches"] == run["num_prompts"] for run in audit["runs"])
    assert (work / "out" / "report.html").is_file()
    version = _run([str(script), "--version"], work)
    assert version.returncode == 0 and version.stdout.startswith("specaudit ")


def test_wheel_registers_the_pytest_plugin(installed: tuple[Path, Path]) -> None:
    python, work = installed
    result = _run([str(python), "-m", "pytest", "--help"], work)
    assert result.returncode == 0, result.stderr
    assert "--specaudit-engine" in result.stdout and "--specaudit-batch-size" in result.stdout
