import pytest
import torch
from hypothesis import settings

from specaudit.engines.models import zoo
from specaudit.testing.profiles import load_profile

# tiny models: one thread per process is fastest, and xdist runs one process per core
torch.set_num_threads(1)

# this project's own properties in CI draw 15 base examples: the shipped `ci` profile (20, for users' own
# property tests) less a quarter, for the test command's 20-minute bound; `SPECAUDIT_PROFILE=thorough` draws 200
SUITE_CI_EXAMPLES = 15
if load_profile() == "ci":
    settings.register_profile("ci-suite", parent=settings.get_profile("ci"), max_examples=SUITE_CI_EXAMPLES)
    settings.load_profile("ci-suite")


@pytest.fixture(params=zoo.builtin_pair_names())
def pair_name(request) -> str:
    return request.param
