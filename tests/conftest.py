import warnings

import pytest

warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(autouse=True)
def _quiet_transformers():
    from transformers.utils import logging

    logging.set_verbosity_error()
    yield


# The longest test (minutes, on 2 processes of its own) runs first: on two xdist workers the other worker's tests
# then run beside it rather than after it
FIRST = "test_every_measured_row_is_within_tolerance"


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.name != FIRST)  # stable: every other test keeps its order
