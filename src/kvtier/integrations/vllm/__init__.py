"""kvtier inside vLLM: `KVTierConnector`, loaded with
`kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm"`."""

from kvtier.integrations.vllm.connector import KVTierConnector, kv_transfer_config

__all__ = ["KVTierConnector", "kv_transfer_config"]
