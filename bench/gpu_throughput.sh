#!/usr/bin/env bash
# One prepared GPU run: bf16 training throughput of a ~1B LLaMA-style model (seq 2048), BERT-large and a
# Mixtral-shaped mixture of experts (3 layers, seq 4096).
#
#   bash bench/gpu_throughput.sh --prepare-wheels 3.12   # on a machine with network: wheels for the GPU's Python
#   bash bench/gpu_throughput.sh                          # on the GPU machine (PyTorch present, no network)
#   bash bench/gpu_throughput.sh --dry-run --out /tmp/t.md   # CPU-sized, what CI runs
#
# Whatever Python package the GPU machine lacks is installed from bench/wheels/. The whole run is bounded by
# --time-limit seconds (default 480; the cases' budget is ~5 minutes, see CASES in gpu_throughput.py) and writes a
# Markdown table to --out (default bench/results/), rewritten after each case.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=bench/wheels
OUT="bench/results/gpu_throughput_$(date -u +%Y%m%d).md"
DRY_RUN=()
TIME_LIMIT=480
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=(--dry-run); shift ;;
    --out) OUT="$2"; shift 2 ;;
    --wheels) WHEELS="$2"; shift 2 ;;
    --time-limit) TIME_LIMIT="$2"; shift 2 ;;
    --prepare-wheels)
      set -x
      python3 -m pip download --no-deps --only-binary=:all: --python-version "$2" -d "$WHEELS" \
        megatron-core==0.16.1 einops packaging
      exit 0 ;;
    *) echo "unknown flag $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
PYTHON="${PYTHON:-python3}"
# Whether they are installed, not importing them: megatron-core's import alone takes seconds.
if ! "$PYTHON" -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('einops') and u.find_spec('megatron.core')))" \
    2>/dev/null; then
  set -x
  "$PYTHON" -m pip install --no-index --find-links "$WHEELS" megatron-core==0.16.1 einops packaging
  set +x
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "+ $PYTHON bench/gpu_throughput.py --out $OUT ${DRY_RUN[*]}"
exec timeout "$TIME_LIMIT" "$PYTHON" bench/gpu_throughput.py --out "$OUT" "${DRY_RUN[@]}"
