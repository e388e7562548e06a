#!/usr/bin/env bash
# The GPU check of issue 39 on a bare GPU machine: installs what the machine lacks, then
# runs benchmarks/cuda_check.py (its docstring says what it checks and what it prints).
#
#   bash benchmarks/cuda_check.sh --download   here, with a network: the wheels the GPU
#                                              machine lacks, into .whl/ (ignored by git)
#   bash benchmarks/cuda_check.sh [ARGS]       there: install and check; ARGS go to
#                                              cuda_check.py; log and JSON land in $OUT
#
# The device call of a GPU session:
#   run(command="bash benchmarks/cuda_check.sh", carry=[".whl"], timeout_s=600)
set -uo pipefail
cd "$(dirname "$0")/.."

# Checked against the GPU image's package list (.library/device/KINDS.md): it has torch,
# transformers, numpy, safetensors, tokenizers, tqdm, jinja2, pyyaml and requests, not these.
WHEELS=("llguidance==1.9.1" "gguf==0.19.0")

if [ "${1:-}" = "--download" ]; then
    exclude="$(git rev-parse --git-common-dir)/info/exclude"
    mkdir -p "$(dirname "$exclude")"
    grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
    platforms=()
    for tag in manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 \
        manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
        manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
        platforms+=(--platform "$tag")
    done
    exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d .whl "${WHEELS[@]}"
fi

OUT="${OUT:-/tmp/cuda-check}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "cuda_check.sh: no .whl/ carried: llguidance and gguf must already be installed" >&2
fi
# The checkout, against the machine's own torch; the CPU kernels are not built (a model on
# a GPU runs the torch ops). Should the install fail, the sources run from src/.
if ! CELLBATCH_KERNELS=0 python3 -m pip install -q --no-index --no-deps \
    --no-build-isolation -e . >"$OUT/install.log" 2>&1; then
    echo "cuda_check.sh: pip install -e . failed (see install.log); running from src/" >&2
    export PYTHONPATH="$PWD/src:$PYTHONPATH"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 timeout 560 python3 benchmarks/cuda_check.py \
    --output-json "$OUT/cuda_check.json" "$@" 2>&1 | tee "$OUT/cuda_check.log"
