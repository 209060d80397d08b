"""Security: file modes, refused directories, paths that cannot leave the tier root, secrets that
are never printed, and tenants (`cache_salt`) and deployments (keyed names) kept apart in every tier.

Everything runs on the real tiers: a DiskTier on a temporary directory, Redis servers started by
the fixtures of `redis_servers.py` (one with an ACL user and password), the SeaweedFS S3 server of
`s3_server.py`, and the real OffloadScheduler driven by the fake engine. The test process runs as
root here, so it can hand a directory to another uid (`os.chown`) the way an attacker's would be.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from helpers import HANG_MS, HANG_S, key, keys
from kvtier.base import LookupResult
from kvtier.build import secondary_tiers
from kvtier.cli.output import EngineLogs
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.keys import make_offload_key
from kvtier.scheduler import GroupSpec, OffloadScheduler, SchedulerOffloadConfig
from kvtier.sim import FakeEngine, KVCache
from kvtier.sim.fake_engine import make_slab
from kvtier.slab import HostSlab
from kvtier.tiers.cascade import TierRules
from kvtier.tiers.cpu.manager import CPUTierManager
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.namespace import Namespace
from kvtier.tiers.remote.tier import RemoteTier
from kvtier.tiers.secondary import SecondaryTier
from kvtier.tiers.tiered import TieredManager
from redis_servers import ACL_USER
from sched_helpers import UNBOUNDED_DEFERRALS, FakeClock, prompt, run_until_done
from tier_helpers import disk_tiers
from tier_jobs import Slab, load, store
from vllm_helpers import scheduler_connector

HIT, MISS = LookupResult.HIT, LookupResult.MISS
SLOT = 4096
# a user that is not this process's
OTHER_UID = 4242
KVTIER = shutil.which("kvtier", path=str(Path(sys.executable).parent))
# planted secrets: long, unique strings that no message could contain by chance
REDIS_SECRET = "planted-redis-password-7c1e9a44d0"
S3_SECRET = "planted-s3-secret-key-53b0f8e2aa91"
KEY_SECRET = "planted-key-secret-0e6d2c9b7f13"
SECRETS = (REDIS_SECRET, S3_SECRET, KEY_SECRET)


def namespace(model: str = "tiny", slot_bytes: int = SLOT) -> Namespace:
    return Namespace(model, "float16", "blocks", 16, 4, "sha256_cbor", 1, slot_bytes)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@contextlib.contextmanager
def umask(value: int) -> Iterator[None]:
    """The process umask for the block: with 0, a mode comes from kvtier's own code alone."""
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def make_disk(tmp_path):
    with disk_tiers(tmp_path / "disk", namespace) as make:
        yield make


def chunk_file(tier: DiskTier, k: bytes) -> Path:
    return Path(tier.directory) / k.hex()[:2] / f"{k.hex()}.kv"


# -- modes: files 0600 in directories 0700, whatever the umask ------------------------------------


def test_disk_files_are_0600_in_directories_0700(make_disk, tmp_path):
    # a mode left to the umask would come out 0666 / 0777 here
    with umask(0):
        tier = make_disk(capacity_files=1)
        slab = Slab(2, namespace())
        store(tier, slab, keys(1))
        # evicts 1 (its file becomes a spare, reused or kept)
        store(tier, slab, keys(2))
    ns_dir = Path(tier.directory)
    assert mode(tmp_path / "disk") == mode(ns_dir) == 0o700
    assert mode(chunk_file(tier, key(2)).parent) == mode(ns_dir / "spare") == 0o700
    assert mode(chunk_file(tier, key(2))) == mode(ns_dir / "namespace.json") == 0o600


def test_disk_file_mode_0640_lets_the_group_read_and_narrows_an_older_directory(tmp_path):
    root = tmp_path / "disk"
    ns = namespace()
    (root / ns.id_hex).mkdir(parents=True)
    # as an older kvtier made it: open to every user
    os.chmod(root / ns.id_hex, 0o755)
    cfg = KVTierConfig.from_dict(
        {"disk_path": str(root), "disk_bytes": 4 * (4096 + SLOT), "disk_file_mode": "0640"}
    )
    # a mode left to the umask would lose the group's bits here
    with umask(0o077):
        ((tier, _),) = secondary_tiers(cfg, ns)
        try:
            assert tier.wait_scanned(HANG_S)
            store(tier, Slab(1, ns), keys(1))
        finally:
            tier.close()
    assert mode(root / ns.id_hex) == mode(chunk_file(tier, key(1)).parent) == 0o750
    assert mode(chunk_file(tier, key(1))) == 0o640
    with pytest.raises(ConfigError, match="disk_file_mode: expected one of"):
        KVTierConfig.from_dict({"disk_file_mode": "0666"})


def test_the_host_slab_is_0600_and_one_made_by_another_user_or_a_symlink_is_refused(tmp_path):
    with (
        umask(0),
        HostSlab("kvtier-test-own", 2, SLOT, owner=True, populate=False, directory=str(tmp_path)),
    ):
        assert mode(tmp_path / "kvtier-test-own") == 0o600
    # another user made a segment under the name this engine will use: refused, never mapped
    planted = tmp_path / "kvtier-test-planted"
    planted.write_bytes(bytes(2 * SLOT))
    os.chown(planted, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=f"kvtier-test-planted belongs to uid {OTHER_UID}"):
        HostSlab("kvtier-test-planted", 2, SLOT, populate=False, directory=str(tmp_path))
    # a symlink under the name, to a file of the right size: refused, the file is not mapped
    target = tmp_path / "elsewhere"
    target.write_bytes(b"x" * (2 * SLOT))
    (tmp_path / "kvtier-test-link").symlink_to(target)
    with pytest.raises(ConfigError, match="kvtier-test-link: Too many levels of symbolic links"):
        HostSlab("kvtier-test-link", 2, SLOT, populate=False, directory=str(tmp_path))
    assert target.read_bytes() == b"x" * (2 * SLOT)


def test_engine_logs_are_0600_even_when_the_file_existed(tmp_path, capfd):
    made, existing = tmp_path / "out" / "made.log", tmp_path / "existing.log"
    existing.write_text("")
    # as `Path.write_text` makes it (the demo does, before EngineLogs)
    os.chmod(existing, 0o644)
    with umask(0):
        for path, echo in ((made, False), (existing, True)):
            with EngineLogs(path, echo=echo):
                os.write(1, b"an engine line\n")
    capfd.readouterr()
    assert mode(made) == mode(existing) == 0o600
    assert made.read_text() == existing.read_text() == "an engine line\n"


# -- directories refused at start -----------------------------------------------------------------


def test_a_disk_directory_owned_by_another_user_is_refused_at_start(tmp_path):
    root = tmp_path / "theirs"
    root.mkdir()
    os.chown(root, OTHER_UID, OTHER_UID)
    cfg = KVTierConfig.from_dict({"disk_path": str(root), "disk_bytes": "1MiB"})
    with pytest.raises(
        ConfigError, match=f"'{root}' refused: it is owned by uid {OTHER_UID}, not by this process"
    ):
        secondary_tiers(cfg, namespace())
    # nothing was written there
    assert list(root.iterdir()) == []
    # our root, but a namespace directory inside it that another user made first
    mine = tmp_path / "mine"
    (mine / namespace().id_hex).mkdir(parents=True)
    os.chown(mine / namespace().id_hex, OTHER_UID, OTHER_UID)
    with pytest.raises(
        ConfigError, match=f"{namespace().id_hex}' refused: it is owned by uid {OTHER_UID}"
    ):
        DiskTier(mine, namespace(), 1 << 20)


def test_a_world_writable_disk_directory_is_refused_unless_sticky(make_disk, tmp_path):
    root = tmp_path / "open"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(
        ConfigError, match=f"'{root}' refused: every user may write it \\(mode 777\\)"
    ):
        DiskTier(root, namespace(), 1 << 20)
    # with the sticky bit (as /tmp), others cannot rename or delete what kvtier makes there
    os.chmod(root, 0o1777)
    tier = make_disk(root=root)
    store(tier, Slab(1, namespace()), keys(1))
    assert load(tier, Slab(1, namespace()), keys(1)).failed_keys == frozenset()


# -- paths: nothing from outside decides where a file goes ----------------------------------------


def tree(path: Path) -> dict[str, bytes | str]:
    """Every entry under `path` (without following symlinks): file bytes, or where a link points."""
    out: dict[str, bytes | str] = {}
    for p in sorted(path.rglob("*")):
        rel = str(p.relative_to(path))
        out[rel] = os.readlink(p) if p.is_symlink() else (p.read_bytes() if p.is_file() else "dir")
    return out


@pytest.fixture
def outside(tmp_path) -> Path:
    """A directory beside the tier root with a file that a symlink will point at."""
    out = tmp_path / "outside"
    out.mkdir()
    (out / "precious").write_bytes(b"must never change")
    return out


def test_hostile_keys_and_namespace_fields_stay_inside_the_tier_root(make_disk, tmp_path):
    ns = namespace(model="../../outside/\x00/etc/passwd")
    tier = make_disk(ns=ns)
    hostile = [
        b"../../outside/x" + bytes(4),
        b"/etc/passwd\x00" + bytes(4),
        b"\x00" * 36,
        b"..\\.." + bytes(4),
    ]
    slab = Slab(len(hostile), ns)
    assert store(tier, slab, hostile).failed_keys == frozenset()
    assert load(tier, slab, hostile).failed_keys == frozenset()
    assert all(slab.holds(row, k) for row, k in enumerate(hostile))
    # every file is <root>/<namespace id hex>/<hh>/<key hex>.kv (or the tier's own bookkeeping)
    root = tmp_path / "disk"
    names = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    assert names == {f"{ns.id_hex}/{k.hex()[:2]}/{k.hex()}.kv" for k in hostile} | {
        f"{ns.id_hex}/namespace.json"
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk"]


@pytest.mark.parametrize(
    "prefix", ["../other", "/abs", "a/b", "kvtier\n", "..", ".", "nul\x00", "a b", ""]
)
def test_a_remote_prefix_that_could_leave_its_place_in_a_name_is_refused(prefix):
    with pytest.raises(ConfigError, match="remote_prefix: expected a string matching"):
        KVTierConfig.from_dict({"remote_prefix": prefix})


def test_a_symlinked_hh_directory_is_never_followed(make_disk, outside):
    tier, slab = make_disk(), Slab(1, namespace())
    k = key(1)
    store(tier, slab, keys(1))
    # someone moves 1's hh directory outside and leaves a symlink to it: the file there is intact
    hh = chunk_file(tier, k).parent
    shutil.move(hh, outside / "hh")
    hh.symlink_to(outside / "hh")
    before = tree(outside)
    # the load does not read through the link (ELOOP: counted), the key leaves the index, and
    # neither that nor a new store of it touches anything outside the root
    assert load(tier, slab, keys(1)).failed_keys == frozenset(keys(1))
    assert tier.lookup(k) is MISS and tier.stats().counters["unsafe_paths"] >= 1
    assert store(tier, slab, keys(1)).failed_keys == frozenset(keys(1))
    assert tier.drain(HANG_S) and tree(outside) == before


def test_a_symlinked_chunk_file_is_never_read_and_a_restart_drops_it(make_disk, outside):
    tier, slab = make_disk(), Slab(2, namespace())
    store(tier, slab, keys(1, 2))
    # 1's file moves outside (still a valid chunk file); a symlink to it takes its place
    path = chunk_file(tier, key(1))
    shutil.move(path, outside / "chunk")
    path.symlink_to(outside / "chunk")
    before = tree(outside)
    assert load(tier, slab, keys(1)).failed_keys == frozenset(keys(1))
    assert tier.drain(HANG_S) and not path.is_symlink() and tree(outside) == before
    # planted again, the start-up scan of a restarted tier drops the link without following it
    path.symlink_to(outside / "chunk")
    tier.close()
    again = make_disk()
    assert again.lookup(key(1)) is MISS and again.lookup(key(2)) is HIT
    assert not path.is_symlink() and tree(outside) == before


def test_a_symlinked_spare_is_never_written_through(make_disk, outside):
    first, slab = make_disk(capacity_files=2), Slab(2, namespace())
    store(first, slab, keys(1))
    store(first, slab, keys(2))
    first.close()
    # restarted with room for one file: the older one, 1, becomes spare/<name>
    tier = make_disk(capacity_files=1)
    assert tier.drain(HANG_S) and tier.lookup(key(2)) is HIT
    (spare,) = (Path(tier.directory) / "spare").iterdir()
    # the spare is swapped for a symlink to a file outside; the next store would reuse the spare
    spare.unlink()
    spare.symlink_to(outside / "precious")
    assert store(tier, slab, keys(3)).failed_keys == frozenset(keys(3))
    assert (outside / "precious").read_bytes() == b"must never change"
    # a restart finds a symlink among the spares: dropped, not adopted
    spare.symlink_to(outside / "precious")
    tier.close()
    again = make_disk(capacity_files=1)
    store(again, slab, keys(4, 5))
    assert not spare.exists() and (outside / "precious").read_bytes() == b"must never change"


def test_symlinks_planted_before_start_never_lead_outside(tmp_path, outside, make_disk):
    ns, root = namespace(), tmp_path / "disk"
    # the namespace directory itself is a symlink to a directory outside: refused at start
    root.mkdir()
    (root / ns.id_hex).symlink_to(outside)
    with pytest.raises(
        ConfigError, match=f"{ns.id_hex}' refused: it cannot be made or is not a plain directory"
    ):
        DiskTier(root, ns, 1 << 20)
    assert tree(outside) == {"precious": b"must never change"}
    # a real namespace directory in which namespace.json, its temporary name and the O_DIRECT
    # probe's name are symlinks to a file outside: each is replaced, never written through
    (root / ns.id_hex).unlink()
    (root / ns.id_hex).mkdir()
    for name in (
        "namespace.json",
        f"namespace.json.tmp.{os.getpid()}",
        f".direct-probe.{os.getpid()}",
    ):
        (root / ns.id_hex / name).symlink_to(outside / "precious")
    tier = make_disk(root=root)
    store(tier, Slab(1, ns), keys(1))
    assert tree(outside) == {"precious": b"must never change"}
    assert json.loads((root / ns.id_hex / "namespace.json").read_text())["id"] == ns.id_hex


# -- secrets: never in a log record, an error, describe(), the metrics or `kvtier config` ----------


def leaks(*texts: str) -> list[str]:
    """The planted secrets that appear in any of `texts`."""
    return [secret for secret in SECRETS if any(secret in text for text in texts)]


def secret_file(path: Path, content: str) -> str:
    path.write_text(content + "\n")
    os.chmod(path, 0o600)
    return str(path)


def start_tiers(extra: dict, ns: Namespace | None = None) -> tuple[list[str], list[SecondaryTier]]:
    """The secondary tiers a configuration starts (closed again here), and what they describe."""
    tiers = [tier for tier, _ in secondary_tiers(KVTierConfig.from_dict(extra), ns or namespace())]
    described = [tier.store.describe() for tier in tiers if isinstance(tier, RemoteTier)]
    for tier in tiers:
        tier.close()
    return described, tiers


def test_a_redis_password_is_never_printed_wrong_or_unreachable(
    redis_server_acl, monkeypatch, caplog, tmp_path
):
    # its only user is ACL_USER with a password that is not ours
    server = redis_server_acl.ready()
    caplog.set_level(logging.DEBUG)
    # timeouts only a hang reaches: the server's AuthenticationError, not a busy machine's timeout
    base = {
        "redis_url": server.url,
        "redis_username": ACL_USER,
        "redis_timeout_ms": HANG_MS,
        "redis_connect_timeout_ms": HANG_MS,
    }
    errors: list[str] = []
    # a wrong password from the environment: the tier starts disabled, with a warning saying why
    monkeypatch.setenv("KVTIER_REDIS_PASSWORD", REDIS_SECRET)
    described, (tier,) = start_tiers(base)
    assert tier.breaker.is_open and "did not answer at start (AuthenticationError" in caplog.text
    # ... and with redis_required, the engine does not start
    with pytest.raises(ConfigError, match="AuthenticationError") as refused:
        start_tiers({**base, "redis_required": True})
    errors.append(str(refused.value))
    # the same wrong password from a file, against a server that is not there at all
    monkeypatch.delenv("KVTIER_REDIS_PASSWORD")
    from redis_servers import free_port

    gone = {
        **base,
        "redis_url": f"redis://127.0.0.1:{free_port()}/0",
        "redis_required": True,
        "redis_password_file": secret_file(tmp_path / "pw", REDIS_SECRET),
    }
    with pytest.raises(ConfigError, match="ConnectionError") as refused:
        start_tiers(gone)
    errors.append(str(refused.value))
    assert leaks(caplog.text, *errors, *described) == []
    assert described == [server.url + "/0"]


def test_an_s3_secret_is_never_printed_wrong_or_unreachable(
    s3_server, monkeypatch, caplog, tmp_path
):
    caplog.set_level(logging.DEBUG)
    creds = secret_file(
        tmp_path / "s3.json",
        json.dumps({"access_key_id": s3_server.access_key_id, "secret_access_key": S3_SECRET}),
    )
    # a timeout only a hang reaches: the server's SignatureDoesNotMatch, not a busy machine's timeout
    base = {
        "s3_endpoint": s3_server.endpoint,
        "s3_bucket": s3_server.bucket,
        "s3_credentials_file": creds,
        "s3_timeout_ms": HANG_MS,
    }
    # the server refuses the signature: disabled with a warning, or refused at start when required
    described, (tier,) = start_tiers(base)
    assert tier.breaker.is_open and "SignatureDoesNotMatch" in caplog.text
    with pytest.raises(ConfigError, match="SignatureDoesNotMatch") as wrong:
        start_tiers({**base, "s3_required": True})
    # the secret from the environment, against an endpoint where nothing listens
    from redis_servers import free_port

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDPLANTED")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET)
    with pytest.raises(ConfigError, match="did not answer at start") as gone:
        start_tiers(
            {
                "s3_endpoint": f"http://127.0.0.1:{free_port()}",
                "s3_bucket": s3_server.bucket,
                "s3_required": True,
                "s3_timeout_ms": 1000,
                "s3_connect_timeout_ms": 500,
            }
        )
    assert leaks(caplog.text, str(wrong.value), str(gone.value), *described) == []
    assert described == [f"{s3_server.endpoint}/{s3_server.bucket}"]


def test_the_key_secret_is_in_no_name_value_log_or_error(fresh_redis, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("KVTIER_KEY_SECRET", KEY_SECRET)
    ns = namespace()
    ((tier, _),) = secondary_tiers(
        KVTierConfig.from_dict({"redis_url": fresh_redis.url, "remote_key_mode": "keyed"}), ns
    )
    try:
        store(tier, Slab(2, ns), keys(1, 2))
    finally:
        tier.close()
    with fresh_redis.client() as client:
        names = [n for n in client.scan_iter(match="*")]
        values = [client.get(n) for n in names]
    assert len(names) == 2
    # a secret too short for the keyed mode is refused without being repeated
    monkeypatch.setenv("KVTIER_KEY_SECRET", "short-" + KEY_SECRET[:6])
    with pytest.raises(ConfigError, match="at least 16 characters") as refused:
        start_tiers({"redis_url": fresh_redis.url, "remote_key_mode": "keyed"})
    assert KEY_SECRET[:6] not in str(refused.value)
    assert not any(KEY_SECRET.encode() in blob for blob in names + values)
    assert leaks(caplog.text, str(refused.value)) == []


def test_kvtier_config_never_prints_a_secret(tmp_path):
    assert KVTIER is not None, "pip install -e . installs the `kvtier` console script"
    env = {
        **os.environ,
        "KVTIER_REDIS_PASSWORD": REDIS_SECRET,
        "KVTIER_KEY_SECRET": KEY_SECRET,
        "AWS_SECRET_ACCESS_KEY": S3_SECRET,
    }
    files = {
        "--redis-password-file": secret_file(tmp_path / "pw", REDIS_SECRET),
        "--key-secret-file": secret_file(tmp_path / "key", KEY_SECRET),
        "--s3-credentials-file": secret_file(
            tmp_path / "s3.json",
            json.dumps({"access_key_id": "AKID", "secret_access_key": S3_SECRET}),
        ),
    }
    # (arguments, exit status): the first is valid, the others put a secret where none may go
    runs = [
        (
            [
                "--json",
                "--redis-url",
                "redis://cache:6379/0",
                "--remote-key-mode",
                "keyed",
                "--s3-endpoint",
                "http://s3:9000",
                "--s3-bucket",
                "bucket",
                *(x for item in files.items() for x in item),
            ],
            0,
        ),
        (["--redis-url", f"redis://svc:{REDIS_SECRET}@cache:6379/0"], 2),
        (["--redis-url", f"redis://cache:{REDIS_SECRET}/0"], 2),
        (["--s3-endpoint", f"http://AKID:{S3_SECRET}@s3:9000", "--s3-bucket", "bucket"], 2),
    ]
    for argv, status in runs:
        done = subprocess.run(
            [KVTIER, "config", *argv],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=False,
        )
        assert done.returncode == status, done.stderr
        assert leaks(done.stdout, done.stderr) == [], argv
        # the files are named, their content is not read
        if status == 0:
            assert json.loads(done.stdout)["kv_connector_extra_config"][
                "redis_password_file"
            ] == str(tmp_path / "pw")


def test_the_connector_logs_and_metrics_never_show_a_secret(
    model, redis_server_acl, s3_server, monkeypatch, caplog, tmp_path
):
    pytest.importorskip("vllm")
    from prometheus_client import REGISTRY, generate_latest
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    caplog.set_level(logging.DEBUG)
    # wrong: the tier starts disabled
    monkeypatch.setenv("KVTIER_REDIS_PASSWORD", REDIS_SECRET)
    monkeypatch.setenv("KVTIER_KEY_SECRET", KEY_SECRET)
    creds = secret_file(
        tmp_path / "s3.json",
        json.dumps({"access_key_id": s3_server.access_key_id, "secret_access_key": S3_SECRET}),
    )
    extra = {
        "cpu_bytes": "4MiB",
        "disk_path": str(tmp_path / "disk"),
        "remote_key_mode": "keyed",
        "redis_url": redis_server_acl.ready().url,
        "redis_username": ACL_USER,
        "s3_endpoint": s3_server.endpoint,
        "s3_bucket": s3_server.bucket,
        "s3_credentials_file": creds,
    }
    vllm_config, connector = scheduler_connector(model, extra)
    try:
        # vLLM's own Prometheus path: build_prom_metrics, then observe what the connector reports
        prom = KVConnectorProm(vllm_config, ["model_name", "engine"], {0: [str(model), "0"]})
        stats = connector.get_kv_connector_stats()
        prom.observe(stats.data)
        metrics = generate_latest(REGISTRY).decode()
    finally:
        connector.shutdown()
    # the metrics do show the shared tiers (both disabled: wrong password, wrong secret) ...
    assert 'kvtier:tier_breaker_open{engine="0",model_name="' in metrics
    assert 'tier="redis"} 1.0' in metrics and 'tier="s3"} 1.0' in metrics
    # ... and none of the secrets, nor do the log records or vLLM's log line of the stats
    assert leaks(metrics, caplog.text, str(stats.reduce()), repr(connector.kvtier_config)) == []


# -- tenants: a request with salt A never gets what salt B stored, in any tier -----------------------

NUM_BLOCKS, BLOCK, NUM_SLOTS = 32, 4, 8
# 4 chunks of 1 block
PROMPT = prompt(16, seed=3)
TierMaker = Callable[[Namespace], SecondaryTier]


@pytest.fixture
def engines():
    """Builds fake engines (real scheduler, real worker) over a CPU tier and the given secondary
    tiers; each one and its tiers stop at the end of the test, or at `stop(engine)`."""
    made: list[tuple[FakeEngine, TieredManager | CPUTierManager]] = []

    def make(*tier_makers: TierMaker, model: str = "salted") -> FakeEngine:
        slab = make_slab(KVCache(1, NUM_BLOCKS, BLOCK), 1, NUM_SLOTS)
        ns = Namespace(model, "float32", "sim", BLOCK, 1, "sha256", 1, slab.rows.shape[1])
        cpu = CPUTierManager(NUM_SLOTS)
        tiers = [(m(ns), TierRules()) for m in tier_makers]
        manager = (
            TieredManager(cpu, [slab.rows], tiers, job_timeout_s=HANG_S) if tier_makers else cpu
        )
        # never advances: a request waits for its probes and promotions, however slow
        clock = FakeClock()
        config = SchedulerOffloadConfig(
            groups=(GroupSpec(tokens_per_block=BLOCK),),
            max_defer_s=60.0,
            max_deferrals=UNBOUNDED_DEFERRALS,
        )
        engine = FakeEngine(
            OffloadScheduler(config, manager, clock=clock),
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK,
            clock=clock,
            slab=slab,
        )
        made.append((engine, manager))
        return engine

    yield make
    for engine, manager in made:
        stop(engine, manager)


def stop(engine: FakeEngine, manager=None) -> None:
    """Wait for the engine's writes to reach every tier, then close it and its tiers (idempotent)."""
    manager = manager or engine.scheduler.manager
    manager.close()
    engine.close()


def serve(engine: FakeEngine, req_id: str, salt: str | None) -> int:
    """Serve PROMPT + one token under `salt`; returns the tokens kvtier supplied."""
    req = engine.add_request(req_id, PROMPT + [1], 1, cache_salt=salt)
    # steps until it ends, for up to HANG_S: its probes and promotions take real time, which 10**6
    # steps (~17 s on 2 busy cores, less on a faster machine) bounded before
    run_until_done(engine)
    assert req.is_finished
    return req.num_external_tokens


def settle(engine: FakeEngine) -> None:
    """Every chunk stored in RAM has reached the secondary tiers."""
    manager = engine.scheduler.manager
    # cascades what became ready
    manager.stats()
    for tier in manager.tiers:
        assert tier.drain(HANG_S)
    manager.stats()


def disk_at(path: Path) -> TierMaker:
    def make(ns: Namespace) -> DiskTier:
        tier = DiskTier(path, ns, 64 * (ns.payload_bytes + 4096))
        assert tier.wait_scanned(HANG_S)
        return tier

    return make


def remote_on(backend: str, request, key_secret: bytes | None = None) -> TierMaker:
    if backend == "redis":
        from kvtier.tiers.remote.redis import RedisStore

        url = request.getfixturevalue("fresh_redis").url
        return lambda ns: RemoteTier(RedisStore(url), ns, key_secret=key_secret)
    from kvtier.tiers.remote.s3 import S3Store

    s3 = request.getfixturevalue("s3_server")
    return lambda ns: RemoteTier(
        S3Store(
            s3.endpoint,
            s3.bucket,
            access_key_id=s3.access_key_id,
            secret_access_key=s3.secret_access_key,
        ),
        ns,
        key_secret=key_secret,
    )


def test_the_cpu_tier_keeps_tenants_apart(engines):
    engine = engines()
    assert serve(engine, "a1", salt="tenant-a") == 0
    # the engine's own cache forgets; tenant B sends the same prompt: nothing from kvtier
    engine.reset_prefix_cache()
    assert serve(engine, "b1", salt="tenant-b") == 0
    # tenant A again: its 4 chunks come from kvtier (so B's miss was not for lack of them)
    engine.reset_prefix_cache()
    assert serve(engine, "a2", salt="tenant-a") == 16


def test_the_disk_tier_keeps_tenants_apart_across_a_restart(engines, tmp_path):
    first = engines(disk_at(tmp_path / "disk"))
    serve(first, "a1", salt="tenant-a")
    settle(first)
    stop(first)
    # a restarted engine (empty RAM and engine cache) on the same directory: only disk can serve
    again = engines(disk_at(tmp_path / "disk"))
    assert serve(again, "b1", salt="tenant-b") == 0
    assert serve(again, "a2", salt="tenant-a") == 16
    assert again.scheduler.manager.tier_stats()[0].counters["promotions"] == 4


@pytest.mark.parametrize("backend", ["redis", "s3"])
def test_a_shared_tier_keeps_tenants_apart_between_two_engines(engines, request, backend):
    # S3's bucket is shared by the session
    model = f"salted-{backend}-{os.getpid()}-{time.monotonic_ns()}"
    first = engines(remote_on(backend, request), model=model)
    # another engine, same store, both running
    second = engines(remote_on(backend, request), model=model)
    serve(first, "a1", salt="tenant-a")
    settle(first)
    assert serve(second, "b1", salt="tenant-b") == 0
    assert serve(second, "a2", salt="tenant-a") == 16
    assert second.scheduler.manager.tier_stats()[0].counters["promotions"] == 4
    # leave nothing in the shared bucket
    second.scheduler.manager.tiers[0].reset()
    assert second.scheduler.manager.tiers[0].drain(HANG_S)


@pytest.mark.parametrize("backend", ["redis", "s3"])
def test_keyed_deployments_share_nothing_and_names_reveal_no_key(engines, request, backend):
    model = f"keyed-{backend}-{os.getpid()}-{time.monotonic_ns()}"
    secret_a, secret_b = b"deployment-a-secret-0123456789", b"deployment-b-secret-0123456789"
    first = engines(remote_on(backend, request, secret_a), model=model)
    serve(first, "a1", salt=None)
    settle(first)
    # another deployment with its own secret, same store, same model and prompt: no hit
    other = engines(remote_on(backend, request, secret_b), model=model)
    assert serve(other, "b1", salt=None) == 0
    # a replica of the first deployment (same secret) does get the prompt from the store
    replica = engines(remote_on(backend, request, secret_a), model=model)
    assert serve(replica, "a2", salt=None) == 16
    # whoever lists the store sees names and headers from which no block hash can be read
    tier = replica.scheduler.manager.tiers[0]
    names = list(tier.store.list_names(tier.codec.name_prefix))
    values = [bytes(v) for v in tier.store.get(names)]
    block_keys = [make_offload_key(h, 0) for h in first.requests["a1"].block_hashes]
    # each deployment wrote its own copy
    assert len(names) == 2 * len(block_keys)
    assert not any(
        k.hex() in name or k in value for k in block_keys for name in names for value in values
    )
    tier.reset()
    assert tier.drain(HANG_S)
