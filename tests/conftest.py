import functools
import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from specaudit.engines.models import zoo
from specaudit.testing import models

# tiny models: one thread per process is fastest, and xdist runs one process per core
torch.set_num_threads(1)


@pytest.fixture(params=zoo.builtin_pair_names())
def pair_name(request) -> str:
    return request.param

from warning_scope import attribute_to_module_callers

attribute_to_module_callers()


def pytest_configure(config: pytest.Config) -> None:
    """The folder of the reference outputs (property_tests/models.py), named before the xdist workers start, so
    each built-in pair's reference is computed once, not once per worker, and kept for later runs under
    `$SPECAUDIT_CACHE/references` (each file named by a digest of what its outputs depend on)."""
    if hasattr(config, "workerinput"):
        return
    cache = Path(os.environ.get("SPECAUDIT_CACHE", Path.home() / ".cache" / "specaudit"))
    # and the planted-fault hunts' outcomes (property_tests/faults/hunt.py), each file named by a digest of
    # what the derandomized search depends on
    for variable, folder in ((models.REFERENCE_MEMO, "references"), (models.HUNT_MEMO, "hunts")):
        if not os.environ.get(variable):
            os.environ[variable] = str(cache / folder)
            config.add_cleanup(functools.partial(os.environ.pop, variable, None))


VLLM_SCOPE = "vLLM servers"


def runs_vllm_servers(nodeid: str) -> bool:
    """A test of a module that starts vLLM servers (each start imports vLLM and torch in three processes:
    minutes of the 2 cores)."""
    return Path(nodeid.split("::")[0]).name.startswith(("test_vllm", "test_wild_vllm"))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile` (scripts/test.sh), with every vLLM module in one unit of work: one worker runs them one
    after the other, so one vLLM server set is up at a time while the other worker runs the CPU-bound modules.
    (`--dist loadgroup` with `xdist_group` marks split a group across both workers with pytest-xdist 3.8.0.)"""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class VLLMModulesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return VLLM_SCOPE if runs_vllm_servers(nodeid) else super()._split_scope(nodeid)

    return VLLMModulesTogether(config, log)


def runs_child_suites(nodeid: str) -> bool:
    """The module that runs the precision-sensitive tests again under other CPU kernels, in child pytest
    sessions (tests/test_cpu_kernels.py): minutes in two tests."""
    return Path(nodeid.split("::")[0]).name == "test_cpu_kernels.py"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The vLLM modules first, then the child suites under other CPU kernels (the longest units of work start
    at once beside the CPU-bound modules, not at the tail), then the other modules by their number of tests,
    most first (pytest-xdist's own order, which scripts/test.sh turns off with `--no-loadscope-reorder` so that
    this one holds)."""
    tests_per_module = Counter(item.path for item in items)
    items.sort(key=lambda item: (not runs_vllm_servers(item.nodeid), not runs_child_suites(item.nodeid),
                                 -tests_per_module[item.path], str(item.path)))
