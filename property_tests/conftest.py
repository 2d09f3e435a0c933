import pytest
import torch

from engines import zoo
from property_tests.profiles import load_profile

# tiny models: one thread per process is fastest, and xdist runs one process per core
torch.set_num_threads(1)

load_profile()


@pytest.fixture(params=zoo.builtin_pair_names())
def pair_name(request) -> str:
    return request.param
