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
