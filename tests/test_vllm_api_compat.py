"""KVTierConnector against the installed vLLM's connector interface (0.32 CPU or 0.33 CUDA).

No engine runs here: these tests read the interface itself, so an upstream rename or a
new abstract method shows up as a failure instead of an engine that never starts.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed"
)


def _base_and_ours():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvtier.integrations.vllm import KVTierConnector

    return KVConnectorBase_V1, KVTierConnector


def test_every_abstract_method_is_implemented():
    _, ours = _base_and_ours()
    assert not ours.__abstractmethods__


def test_overrides_accept_what_vllm_passes():
    base, ours = _base_and_ours()
    checked = 0
    for name in vars(ours):
        upstream = getattr(base, name, None)
        if name.startswith("_") or not callable(upstream):
            continue
        theirs = inspect.signature(upstream)
        mine = inspect.signature(getattr(ours, name))
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in mine.parameters.values())
        for param in theirs.parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or param.name == "self":
                continue
            assert (
                param.name in mine.parameters or takes_kwargs
            ), f"{name}() lacks vLLM's parameter {param.name!r}"
        checked += 1
    assert checked >= 20


def test_out_of_tree_loading_finds_the_class():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    _, ours = _base_and_ours()
    config = KVTransferConfig(
        kv_connector="KVTierConnector",
        kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both",
    )
    assert KVConnectorFactory.get_connector_class(config) is ours


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None
    or not __import__("vllm").__version__.startswith("0.33"),
    reason="checks the vllm 0.33 (CUDA) package; another version is installed",
)
def test_imports_against_vllm_033():
    from kvtier.integrations.vllm.metrics import KVTierPromMetrics, KVTierStats

    _, ours = _base_and_ours()
    assert (
        ours.build_kv_connector_stats({"counters": {"hit_tokens": 3}, "gauges": {}}).reduce()[
            "hit_tokens"
        ]
        == 3
    )
    assert issubclass(
        KVTierPromMetrics,
        __import__(
            "vllm.distributed.kv_transfer.kv_connector.v1.metrics",
            fromlist=["KVConnectorPromMetrics"],
        ).KVConnectorPromMetrics,
    )
    assert KVTierStats().is_empty()


# -- by name: vLLM's connector factory, MultiConnector (issue 35) ---------------------------------


def _multi_config():
    """vLLM's `KVTransferConfig` for kvtier under `MultiConnector`, every connector by name only."""
    from vllm.config import KVTransferConfig

    children = [
        {"kv_connector": "ExampleConnector", "kv_role": "kv_both"},
        {"kv_connector": "KVTierConnector", "kv_role": "kv_both"},
    ]
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": children},
    )


def test_the_factory_finds_kvtier_by_name():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # importing the package registered the name
    _, ours = _base_and_ours()
    config = KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(config) is ours
    assert KVConnectorFactory.get_connector_class_by_name("KVTierConnector") is ours
    # MultiConnector's children are looked up by name as well, HMA support included
    assert KVConnectorFactory.supports_hma_config(_multi_config()) is False


def test_beside_nixl_the_hybrid_kv_cache_manager_stays_on():
    """docs/disaggregated.md's layout: NIXL first, kvtier second, both by name. vLLM keeps its
    hybrid KV-cache manager only if every child supports it (both do); NIXL's class imports
    without NIXL installed."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    _base_and_ours()
    children = [
        {"kv_connector": "NixlConnector", "kv_role": "kv_producer"},
        {"kv_connector": "KVTierConnector", "kv_role": "kv_both"},
    ]
    config = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_producer",
        kv_connector_extra_config={"connectors": children},
    )
    assert KVConnectorFactory.supports_hma_config(config) is True


def test_registering_again_is_harmless():
    from kvtier.integrations.vllm.plugin import register_connector, register_with_vllm

    _, ours = _base_and_ours()
    # vLLM's factory raises on a second registration: kvtier's call says "already" instead
    assert register_connector() is False
    register_with_vllm()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    assert KVConnectorFactory.get_connector_class_by_name("KVTierConnector") is ours


# A fresh interpreter, as each vLLM process starts: nothing of kvtier imported, vLLM's plugin loader
# run, the name resolved; the plugin must not have imported the connector module itself.
_FRESH_PROCESS = """
import sys
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.plugins import load_general_plugins

try:
    KVConnectorFactory.get_connector_class_by_name("KVTierConnector")
except ValueError:
    pass
else:
    raise SystemExit("registered before the plugins ran")
load_general_plugins()
assert "kvtier.integrations.vllm.connector" not in sys.modules, "the plugin imported the connector"
cls = KVConnectorFactory.get_connector_class_by_name("KVTierConnector")
print(cls.__module__ + "." + cls.__qualname__)
"""


def test_vllm_general_plugin_registers_in_a_fresh_process():
    import subprocess
    import sys
    from importlib.metadata import entry_points

    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("kvtier") == "kvtier.integrations.vllm.plugin:register_with_vllm", (
        "the installed kvtier's metadata lacks pyproject.toml's vllm.general_plugins entry point: "
        "reinstall it (pip install -e .)"
    )
    done = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "kvtier.integrations.vllm.connector.KVTierConnector"


def test_the_package_imports_without_vllm():
    """Registering is skipped, not an error, where vLLM is absent (simulated: `import vllm` fails);
    only the connector itself needs vLLM."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "sys.modules['vllm'] = None\n"
        "import kvtier.integrations.vllm as integration\n"
        "try:\n"
        "    integration.KVTierConnector\n"
        "except ImportError:\n"
        "    print('connector needs vllm')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "connector needs vllm"
    assert "Traceback" not in done.stderr


def test_multiconnector_front_end_rebuilds_kvtier_stats():
    """The path that failed with "Connector 'KVTierConnector' is not registered": the engine core
    sends a MultiConnector's stats as a dict keyed by each child's class name, msgpack-encoded; the
    front end rebuilds each child's stats through the factory, aggregates and logs them."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiKVConnectorStats,
    )
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from kvtier.integrations.vllm.metrics import KVTierStats

    # importing kvtier registers the name the front end looks the child up by
    _base_and_ours()
    logging = KVConnectorLogging(_multi_config())
    encoder = MsgpackEncoder()
    decoder = MsgpackDecoder(EngineCoreOutputs)
    for hit_tokens in (256, 128):
        # the engine core: the scheduler's MultiConnector stats, as Scheduler.make_stats sends them
        kvtier = KVTierStats()
        kvtier.add("hit_tokens", hit_tokens)
        kvtier.add("miss_tokens", 128)
        kvtier.set_gauge("used_slots", 3)
        payload = MultiKVConnectorStats(data={"KVTierConnector": kvtier}).to_dict()
        sent = EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=payload))
        received = decoder.decode(encoder.encode(sent))
        # the front end
        logging.observe(received.scheduler_stats.kv_connector_stats)
    accumulated = logging.transfer_stats_accumulator
    assert isinstance(accumulated["KVTierConnector"], KVTierStats)
    assert accumulated.reduce()["KVTierConnector"] == {
        "hit_tokens": 384,
        "miss_tokens": 256,
        "used_slots": 3,
        "hit_rate": 0.6,
    }
    logged = []
    logging.log(log_fn=lambda fmt, *args: logged.append(fmt % args))
    assert "'hit_tokens': 384" in logged[0]
