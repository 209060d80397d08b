"""The wheel GPU users install, built from this tree and installed where they run it.

The wheel is built without network (`pip wheel --no-deps --no-build-isolation --no-index`, the
build backend from this venv) and installed with `--no-deps` into a fresh venv that borrows this
venv's packages (torch, numpy, vLLM's dependencies) as a plain path, after its own site-packages:
so `kvtier` and its entry points come from the wheel, never from the editable install. vLLM 0.33's
Python package (the `vllm` GPU users install, without its dependencies) goes first on PYTHONPATH,
as `make test-vllm-gpu` puts it; its CUDA extension cannot load here, and nothing below needs it.

A second wheel is built with a compiler that always fails: it installs all the same, without
the C copier, and kvtier copies on its ctypes fallback (`kvtier.worker.memmove`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the Makefile's VLLM_GPU_DIR: vLLM 0.33 installed with --no-deps into a directory of its own
VLLM_GPU_DIR = Path(sys.prefix) / "vllm-0.33.0"
# building and installing take ~2 s each; importing vLLM 0.33 ~5 s: a hang, not slowness
STEP_TIMEOUT_S = 300
ENTRY_POINT = "kvtier = kvtier.integrations.vllm.plugin:register_with_vllm"

pytestmark = pytest.mark.skipif(
    sys.platform == "win32", reason="the venv layout and the C copier's build are POSIX here"
)


def has_wheel_backend() -> bool:
    """setuptools builds wheels itself from 70.1; before, it needs the `wheel` package."""
    bdist = importlib.util.find_spec("setuptools.command.bdist_wheel")
    return bdist is not None or importlib.util.find_spec("wheel") is not None


def has_c_compiler() -> bool:
    """Whether the C copier can build here: a compiler, and Python's headers beside it."""
    compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")[0]
    has_headers = Path(sysconfig.get_paths()["include"], "Python.h").is_file()
    return has_headers and shutil.which(os.environ.get("CC", compiler)) is not None


def run(argv: list[str], env: dict[str, str] | None = None) -> str:
    """Run a command; its stdout, or a failure that shows what it printed."""
    done = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT_S, check=False
    )
    assert done.returncode == 0, f"{argv[:4]} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done.stdout


def build_wheel(out: Path, extra_env: dict[str, str] | None = None) -> Path:
    """A wheel of a copy of this tree's sources (no build outputs, no egg-info), built offline."""
    if not has_wheel_backend():
        pytest.skip("this venv's setuptools cannot build wheels (< 70.1 without `wheel`)")
    source = out / "source"
    ignore = shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info")
    shutil.copytree(REPO / "src" / "kvtier", source / "src" / "kvtier", ignore=ignore)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "wheel", "-q"]
    offline = ["--no-deps", "--no-build-isolation", "--no-index"]
    run(
        [*pip, *offline, "-w", str(out / "dist"), str(source)],
        env={**os.environ, **(extra_env or {})},
    )
    (wheel,) = (out / "dist").glob("kvtier-*.whl")
    return wheel


def install_in_fresh_venv(wheel: Path, venv: Path) -> Path:
    """A venv of its own holding the wheel; this venv's packages after its own. Its python."""
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    # a plain path line: this venv's .pth files (the editable kvtier) are not read
    Path(site.strip(), "borrowed_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", str(python)]
    # --ignore-installed: the borrowed packages hold the editable kvtier, which pip would keep
    run([*pip, "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)])
    return python


def child_env(pythonpath: Path | None) -> dict[str, str]:
    """This environment without what would put another kvtier or vLLM first."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_PLUGINS")}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def venv_python(wheel, tmp_path_factory) -> Path:
    return install_in_fresh_venv(wheel, tmp_path_factory.mktemp("venv") / "venv")


def test_wheel_holds_the_entry_points_and_the_compiled_copier(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        declared = archive.read(entry_points).decode()
    # what vLLM's plugin loader and the shell look up
    assert f"[vllm.general_plugins]\n{ENTRY_POINT}\n" in declared
    assert "[console_scripts]\nkvtier = kvtier.cli.main:main\n" in declared
    if not has_c_compiler():
        pytest.skip("no C compiler here: the wheel is the ctypes fallback's (see the next tests)")
    assert [n for n in names if n.startswith("kvtier/worker/_copyruns") and n.endswith(".so")]


CHECK_BESIDE_VLLM = """
import importlib.metadata, json, sys
import vllm
import kvtier.integrations.vllm
from kvtier.worker import memmove
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

(plugin,) = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "kvtier"]
by_name = KVConnectorFactory.get_connector_class_by_name("KVTierConnector")
print(json.dumps({
    "vllm": vllm.__version__,
    "vllm_file": vllm.__file__,
    "kvtier_file": kvtier.__file__,
    "plugin_dist": str(plugin.dist.locate_file("")),
    "plugin": plugin.load().__qualname__,
    "connector": kvtier.integrations.vllm.KVTierConnector.__module__,
    "is_same_class": by_name is kvtier.integrations.vllm.KVTierConnector,
    "native_copy": memmove.native_copy_available(),
    "vllm_cuda_extension": "vllm._C" in sys.modules,
}))
"""


def test_installed_wheel_resolves_beside_vllm_033(venv_python):
    if not (VLLM_GPU_DIR / "vllm").is_dir():
        pytest.skip(f"{VLLM_GPU_DIR} is absent: `make test` installs vLLM 0.33 there first")
    venv = venv_python.parents[1]
    out = run([str(venv_python), "-c", CHECK_BESIDE_VLLM], env=child_env(VLLM_GPU_DIR))
    seen = json.loads(out.splitlines()[-1])
    # vLLM 0.33's package, kvtier from the wheel (not this tree, not the editable install)
    assert seen["vllm"] == "0.33.0"
    assert Path(seen["vllm_file"]).is_relative_to(VLLM_GPU_DIR)
    assert Path(seen["kvtier_file"]).is_relative_to(venv)
    assert Path(seen["plugin_dist"]).is_relative_to(venv)
    # the entry point resolves; importing the package registered the name with vLLM's factory
    assert seen["plugin"] == "register_with_vllm"
    assert seen["connector"] == "kvtier.integrations.vllm.connector"
    assert seen["is_same_class"]
    # none of it needed vLLM's CUDA extension
    assert not seen["vllm_cuda_extension"]
    assert seen["native_copy"] == has_c_compiler()


def test_console_script_runs(venv_python):
    script = venv_python.parent / "kvtier"
    out = run([str(script), "--help"], env=child_env(None))
    assert out.startswith("usage: kvtier")


ROUND_TRIP = """
import math, numpy as np, torch
from kvtier.jobs import Endpoint, TransferJob, TransferPart
from kvtier.worker import TransferEngine, memmove

assert not memmove.native_copy_available()
kv = {f"layer.{i}": torch.randint(-2**31, 2**31 - 1, (8, 2, 16, 64), dtype=torch.int32) for i in range(3)}
before = {name: t.clone() for name, t in kv.items()}
part = TransferPart(group=0, slot_ids=np.array([3, 1]), block_ids=np.array([4, 5, 0, 7]))
with TransferEngine(kv, blocks_per_chunk=2, num_slots=4) as engine:
    for job_id, (src, dst) in enumerate([(Endpoint.ENGINE, Endpoint.SLAB), (Endpoint.SLAB, Endpoint.ENGINE)]):
        engine.submit(TransferJob(job_id=job_id, req_id="r", src=src, dst=dst, deadline=math.inf, parts=(part,)))
        assert engine.wait([job_id], timeout=60)
        if job_id == 0:
            for t in kv.values():
                t.zero_()
    assert all(r.success for r in engine.get_finished())
index = torch.tensor([4, 5, 0, 7])
assert all(torch.equal(kv[n][index], before[n][index]) for n in kv)
print("round trip ok on", "native" if memmove.native_copy_available() else "ctypes")
"""


def test_wheel_built_without_a_compiler_copies_on_the_fallback(tmp_path):
    # a compiler that always fails: the C copier is optional, the build still succeeds
    wheel = build_wheel(tmp_path, extra_env={"CC": "/bin/false", "LDSHARED": "/bin/false"})
    with zipfile.ZipFile(wheel) as archive:
        assert not [n for n in archive.namelist() if n.endswith(".so")]
    python = install_in_fresh_venv(wheel, tmp_path / "venv")
    # store two chunks, zero the engine's KV, load them back: every byte returns
    out = run([str(python), "-c", textwrap.dedent(ROUND_TRIP)], env=child_env(None))
    assert out.strip() == "round trip ok on ctypes"
