import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _close_fake_engines():
    """Every fake engine a test made stops its copy threads when the test ends."""
    yield
    from sched_helpers import close_engines

    close_engines()
