"""The GPU throughput script's CPU-sized dry mode runs every case end to end, so the script cannot rot."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_throughput_dry_run_writes_a_row_per_case(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_throughput import CASES

    out = tmp_path / "table.md"
    result = subprocess.run(["bash", str(ROOT / "bench" / "gpu_throughput.sh"), "--dry-run", "--out", str(out)],
                            capture_output=True, text=True, timeout=600, env={"PYTHON": sys.executable,
                                                                              "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = out.read_text().splitlines()[2:]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows] == [case.name for case in CASES]
    for row in rows:
        tokens_per_s, tflops = (float(cell) for cell in row.split(" | ")[4:6])
        assert tokens_per_s > 0 and tflops > 0
