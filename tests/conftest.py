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
