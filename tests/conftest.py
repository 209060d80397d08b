import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# fixtures that start real servers for the remote tiers (never a server assumed to be running)
pytest_plugins = ["redis_servers", "s3_server"]

# Tests that serve the tiny models (a vLLM engine, `kvtier serve`, the demo) use one of these.
ENGINE_FIXTURES = frozenset({"model", "gemma", "plain_llama"})
ENGINE_GROUP = "engines"


def serves_a_model(item: pytest.Item) -> bool:
    return bool(ENGINE_FIXTURES & set(item.fixturenames))


# before xdist's own, which names each test's group from these marks
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under `pytest -n 2 --dist loadgroup` (`make test`), every test that serves a model runs in
    one worker, in file order, and first: engines are pinned to the same cores and computed one at a
    time, the session's stock engine (`plain_llama`) is started once, and the other worker takes the
    rest file by file meanwhile (each file's module fixtures are set up once). Without xdist the
    marks do nothing and the order is pytest's."""
    for item in items:
        group = ENGINE_GROUP if serves_a_model(item) else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
    # an xdist worker: the controller hands out groups in this order (`--no-loadscope-reorder`)
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: not serves_a_model(item))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """xdist's loadgroup marks a test's group in its node id; where it does not (pytest-xdist#1386, on
    pytest 9), two workers would serve models at once: say so instead of running that way."""
    if getattr(session.config.option, "loadgroup", False) and any(
        "@" not in item.nodeid for item in session.items
    ):
        raise pytest.UsageError(
            "pytest-xdist's --dist loadgroup does not group tests on this pytest "
            "(pytest-dev/pytest-xdist#1386): install the test extra's pytest (< 9)"
        )


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
