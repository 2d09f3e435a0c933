import pytest
import torch

from specaudit.engines.models import zoo
from specaudit.testing.profiles import load_profile

# tiny models: one thread per process is fastest, and xdist runs one process per core
torch.set_num_threads(1)

load_profile()


@pytest.fixture(params=zoo.builtin_pair_names())
def pair_name(request) -> str:
    return request.param
