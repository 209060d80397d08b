"""kvtier inside vLLM: `KVTierConnector`, known to vLLM's connector factory by name
(`kv_connector="KVTierConnector"`; `kv_connector_module_path="kvtier.integrations.vllm"` works too).

Importing this package registers the name (`plugin.register_with_vllm`: a failure is logged, not
raised, so the module path still works) but does not import the connector module:
`KVTierConnector` and `kv_transfer_config` are imported on first use. vLLM's plugin loader imports
`kvtier.integrations.vllm.plugin`, hence this package, in every vLLM process, whether it serves
with kvtier or not.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvtier.integrations.vllm.plugin import register_with_vllm

if TYPE_CHECKING:
    from kvtier.integrations.vllm.connector import KVTierConnector, kv_transfer_config

__all__ = ["KVTierConnector", "kv_transfer_config"]

_CONNECTOR_EXPORTS = frozenset({"KVTierConnector", "kv_transfer_config"})

register_with_vllm()


def __getattr__(name: str) -> Any:
    # PEP 562: the connector module's names, imported on first use
    if name not in _CONNECTOR_EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    connector = importlib.import_module("kvtier.integrations.vllm.connector")
    return getattr(connector, name)
