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
    """The vLLM modules first, in their own order: the longest work of the run (server starts on 2 cores)
    starts at once beside the CPU-bound tests instead of at the tail (scripts/test.sh: `--dist loadfile`,
    one process a module)."""
    def first(item: pytest.Item) -> bool:
        return item.path.name.startswith(("test_vllm", "test_wild_vllm"))

    items[:] = [item for item in items if first(item)] + [item for item in items if not first(item)]
