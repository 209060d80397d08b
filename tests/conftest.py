import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# fixtures that start real servers for the remote tiers (never a server assumed to be running)
pytest_plugins = ["redis_servers", "s3_server"]


@pytest.fixture(scope="session")
def model() -> Path:
    """The seeded random-weight Llama the vLLM tests serve (generated once, then cached)."""
    from kvtier.integrations.vllm.tiny_model import ensure_tiny_llama
    from vllm_helpers import CACHE_DIR, engine_env

    engine_env()
    return ensure_tiny_llama(CACHE_DIR)


@pytest.fixture(scope="session")
def plain_llama(model):
    """Stock vLLM (no connector) on the tiny Llama in its default configuration: the reference
    engine of every module whose baseline runs that configuration, started once for the session
    (an engine start is 20-45 s here). `vllm_helpers.reference` empties its prefix cache before
    each module's workload, so a module's baseline is what a fresh engine of its own computed."""
    from vllm_helpers import make_llm, shutdown

    llm = make_llm(model)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="session")
def gemma() -> Path:
    """The seeded random-weight Gemma 3 (sliding-window and full-attention layers)."""
    from kvtier.integrations.vllm.tiny_model import ensure_tiny_gemma3
    from vllm_helpers import CACHE_DIR, engine_env

    engine_env()
    return ensure_tiny_gemma3(CACHE_DIR)


@pytest.fixture(autouse=True)
def _close_fake_engines():
    """Every fake engine a test made stops its copy threads when the test ends."""
    yield
    from sched_helpers import close_engines

    close_engines()


@pytest.fixture(autouse=True)
def _close_disk_tiers():
    """Every disk tier `tier_helpers.make_tiered` made stops its threads when the test ends."""
    yield
    if "tier_helpers" in sys.modules:
        sys.modules["tier_helpers"].close_made_disks()
