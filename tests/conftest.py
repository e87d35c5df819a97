import warnings

import pytest

warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(autouse=True)
def _quiet_transformers():
    from transformers.utils import logging

    logging.set_verbosity_error()
    yield

