import pytest
import torch

from specaudit.engines.models import zoo

# tiny models: one thread per process is fastest, and xdist runs one process per core
torch.set_num_threads(1)


@pytest.fixture(params=zoo.builtin_pair_names())
def pair_name(request) -> str:
    return request.param

from warning_scope import attribute_to_module_callers

attribute_to_module_callers()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The vLLM modules (one xdist group, see tests/test_vllm_e2e.py) first, in their own order: the
    longest work of the run starts at once beside the CPU-bound tests instead of at the tail."""
    def first(item: pytest.Item) -> bool:
        mark = item.get_closest_marker("xdist_group")
        return mark is not None and (mark.args[:1] or [mark.kwargs.get("name")])[0] == "vllm"

    items[:] = [item for item in items if first(item)] + [item for item in items if not first(item)]
