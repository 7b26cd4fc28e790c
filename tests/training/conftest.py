"""Training tests run tiny models whose ops are dominated by thread hand-off on a shared
machine (a 40-step tiny run took 90 s on 2 busy cores with 2 threads, a few s with 1)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
