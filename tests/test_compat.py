"""The megatron-core version gate, the CPU shim's scope, and the package's install metadata."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_patch import compat

ROOT = Path(__file__).resolve().parents[1]


def test_supported_version_passes():
    assert compat.check_megatron_core_version("0.16.1") == "0.16.1"


def test_wrong_version_names_the_supported_one():
    with pytest.raises(compat.UnsupportedMegatronCore, match=r"megatron-core 0\.15\.0 is installed.*==0\.16\.1"):
        compat.check_megatron_core_version("0.15.0")


def test_import_with_wrong_megatron_core_fails_clearly(tmp_path):
    # A dist-info earlier on sys.path is what importlib.metadata reports, as after `pip install megatron-core==0.15`.
    dist = tmp_path / "megatron_core-0.15.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.15.0\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    result = subprocess.run([sys.executable, "-c", "import megatron_patch"], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0
    assert "megatron-core 0.15.0 is installed, but megatron_patch supports megatron-core==0.16.1" in result.stderr
    assert "pip install megatron-core==0.16.1" in result.stderr


def test_setup_pins_the_supported_stack():
    setup_py = (ROOT / "setup.py").read_text()
    assert f'"megatron-core=={compat.SUPPORTED_MEGATRON_CORE}"' in setup_py
    assert '"torch==2.13.0"' in setup_py


def test_package_installs_into_a_new_venv(tmp_path):
    """pip builds and installs the package (no dependencies fetched: the venv sees this one's packages)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, timeout=120)
    site = subprocess.run([venv / "bin" / "python", "-c", "import site; print(site.getsitepackages()[0])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # the outer environment's packages (torch, megatron-core, ...) stand in for the dependencies
    outer = [p for p in sys.path if p.endswith("site-packages")]
    Path(site, "outer.pth").write_text("\n".join(outer) + "\n")
    # --ignore-installed: pip would otherwise uninstall this environment's own (editable) install first, and with
    # it the console scripts that later tests run.
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet",
                    "--ignore-installed", "--prefix", str(venv), str(ROOT)], check=True, timeout=300,
                   env=dict(os.environ, PIP_NO_INPUT="1"))
    script = venv / "bin" / "megatron-patch"
    assert script.exists(), "the megatron-patch console script is installed"
    where = subprocess.run([venv / "bin" / "python", "-c", "import megatron_patch; print(megatron_patch.__file__)"],
                           cwd=tmp_path, check=True, capture_output=True, text=True, timeout=120).stdout
    assert where.startswith(site)
    help_text = subprocess.run([venv / "bin" / "python", script, "--help"], capture_output=True, text=True,
                               cwd=tmp_path, timeout=120, check=True).stdout
    assert "quickstart" in help_text


def shim_scope(rank, world_size):
    import torch

    from megatron_patch.distributed import initialize_distributed

    initialize_distributed()
    import megatron.core.pipeline_parallel.schedules as schedules

    on_cpu = schedules.torch.zeros(1, device="cuda").device.type
    try:  # our code (and the user's) keeps the real torch: asking it for CUDA still fails loudly
        torch.zeros(1, device="cuda")
        real_torch_raises = False
    except (AssertionError, RuntimeError):
        real_torch_raises = True
    return on_cpu, real_torch_raises


def test_shim_applies_to_megatron_core_only():
    from megatron_patch.testing import run_on_ranks

    assert run_on_ranks(shim_scope, 1) == [("cpu", True)]


def test_shim_rewrites_fail_loudly_when_upstream_changes():
    import megatron.core.optimizer.clip_grads as clip_grads

    with pytest.raises(RuntimeError, match=re.escape("is no longer in megatron.core.optimizer.clip_grads")):
        compat._rewrite_function(clip_grads, "clip_grad_by_total_norm_fp32", [("text that is not there", "")])


_WITH_CUDA = """
import sys
import torch

torch.cuda.is_available = lambda: True  # a GPU machine, as far as the shim can tell
real_cuda_method = torch.Tensor.cuda
from megatron_patch import compat

assert compat.apply_cpu_shim() is False
import megatron.core.tensor_parallel.utils as tp_utils

assert torch.Tensor.cuda is real_cuda_method
assert tp_utils.torch is torch, "megatron-core got the CPU view of torch"
assert not any(type(finder).__name__ == "_MegatronTorchView" for finder in sys.meta_path)
print("untouched")
"""


def test_shim_does_nothing_when_cuda_is_available():
    result = subprocess.run([sys.executable, "-c", _WITH_CUDA], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("untouched")


WRITER_QUEUE_USER = """
import sys, time
from megatron_patch import compat
compat.apply()
from megatron.core.dist_checkpointing.strategies import filesystem_async
filesystem_async._get_write_results_queue().put("ready")
print("ready", flush=True)
time.sleep(600)
"""


def test_the_checkpoint_writers_queue_server_dies_with_its_process():
    """A process killed after a torch_dist save leaves no Manager server behind (megatron-core spawns one)."""
    import psutil

    process = subprocess.Popen([sys.executable, "-c", WRITER_QUEUE_USER], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        children = psutil.Process(process.pid).children(recursive=True)
        assert children, "the results queue is served by a process of its own"
    finally:
        process.kill()
        process.wait()
    _, alive = psutil.wait_procs(children, timeout=10)
    for child in alive:
        child.kill()
    assert not alive, [child.cmdline() for child in alive]
