#!/usr/bin/env bash
# One prepared GPU run: bf16 training throughput of a ~1B LLaMA-style model (seq 2048), BERT-large and a
# Mixtral-shaped mixture of experts (3 layers, seq 4096).
#
#   bash bench/gpu_throughput.sh --prepare-wheels 3.12   # on a machine with network: wheels for the GPU's Python
#   bash bench/gpu_throughput.sh --install-only          # on the GPU machine: install the package, nothing else
#   bash bench/gpu_throughput.sh                          # on the GPU machine (PyTorch present, no network)
#   bash bench/gpu_throughput.sh --dry-run --out /tmp/t.md   # CPU-sized, what CI runs
#
# Where the package is not installed yet, it is installed as a user of a GPU image without network would:
# pip install --no-index --find-links bench/wheels -e '.[test]', into the Python that holds the image's torch,
# which is kept (setup.py takes torch as a range) and checked to be kept. The whole run is bounded by
# --time-limit seconds (default 480; the cases' budget is ~5 minutes, see CASES in gpu_throughput.py) and writes a
# Markdown table to --out (default bench/results/), rewritten after each case.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=bench/wheels
OUT="bench/results/gpu_throughput_$(date -u +%Y%m%d).md"
DRY_RUN=()
TIME_LIMIT=480
INSTALL_ONLY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=(--dry-run); shift ;;
    --out) OUT="$2"; shift 2 ;;
    --wheels) WHEELS="$2"; shift 2 ;;
    --time-limit) TIME_LIMIT="$2"; shift 2 ;;
    --install-only) INSTALL_ONLY=1; shift ;;
    --prepare-wheels)
      # What a GPU image with PyTorch lacks: megatron-core (the newest release setup.py admits for that Python),
      # ISA-L's CRC, and setuptools for pip's isolated build of the package (pyproject.toml).
      set -x
      python3 -m pip download --no-deps --only-binary=:all: --python-version "$2" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" 'megatron-core>=0.16.1,<0.20' isal 'setuptools>=70.1'
      exit 0 ;;
    *) echo "unknown flag $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -m pip show -q megatron_patch >/dev/null 2>&1; then
  torch_before=$("$PYTHON" -c "import importlib.metadata as m; print(m.version('torch'))")
  set -x
  "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" -e '.[test]'
  set +x
  torch_after=$("$PYTHON" -c "import importlib.metadata as m; print(m.version('torch'))")
  if [ "$torch_before" != "$torch_after" ]; then
    echo "installing the package replaced torch $torch_before with $torch_after" >&2
    exit 1
  fi
  echo "installed: $("$PYTHON" -m pip list 2>/dev/null | grep -iE '^(torch|megatron.core|megatron.patch|transformers) ' | tr -s ' ' | paste -sd ',')"
fi
[ "$INSTALL_ONLY" = 1 ] && exit 0
echo "+ $PYTHON bench/gpu_throughput.py --out $OUT ${DRY_RUN[*]}"
exec timeout "$TIME_LIMIT" "$PYTHON" bench/gpu_throughput.py --out "$OUT" "${DRY_RUN[@]}"
