#!/usr/bin/env bash
# Create the peer virtual environments under benchmarks/.envs/ (git-ignored).
#
#   quark/  AMD Quark 0.13 (amd-quark==0.13) on the CPU build of torch 2.13.0.
#           torch is installed FIRST, by its exact pin, so pip takes the local
#           CPU wheel instead of resolving a CUDA build through amd-quark.
#           Quark 0.13 pins onnx<=1.22 and onnxruntime<=1.28 (its "cli" extra).
#   bench/  onnxsim (its quark_compat shim) and onnxruntime's quantize_static,
#           plus Pillow (JPEG decoding) and matplotlib (the chart). The
#           onnx / onnxruntime / onnxsim versions match the project's runtime
#           environment so the onnxsim and ORT numbers use the same runtime as ours.
#
# Usage: bash benchmarks/peers/setup_envs.sh [quark|bench ...]   (default: both)
# Each environment is skipped when its marker file exists; delete the directory to
# rebuild. Logs go to benchmarks/.envs/<name>.log. Exit status is non-zero if any
# requested environment failed; the other environments are still attempted.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ENVS="$(cd "$HERE/.." && pwd)/.envs"
PYTHON="${BENCH_BASE_PYTHON:-python3.11}"
mkdir -p "$ENVS"

make_env() {  # name, then pip requirement groups separated by "--"
    local name="$1"; shift
    local dir="$ENVS/$name" log="$ENVS/$name.log"
    if [ -f "$dir/.ready" ]; then
        echo "[setup_envs] $name: ready ($dir)"
        return 0
    fi
    echo "[setup_envs] $name: creating $dir (log: $log)"
    rm -rf "$dir"
    "$PYTHON" -m venv "$dir" >"$log" 2>&1 || { echo "[setup_envs] $name: venv creation FAILED"; return 1; }
    local group=()
    for arg in "$@" --; do
        if [ "$arg" = "--" ]; then
            if [ "${#group[@]}" -gt 0 ]; then
                echo "+ pip install ${group[*]}" >>"$log"
                "$dir/bin/python" -m pip install --no-input "${group[@]}" >>"$log" 2>&1 || {
                    echo "[setup_envs] $name: pip install ${group[*]} FAILED (see $log)"; return 1; }
            fi
            group=()
        else
            group+=("$arg")
        fi
    done
    "$dir/bin/python" -m pip freeze >"$dir/.freeze" 2>/dev/null
    touch "$dir/.ready"
    echo "[setup_envs] $name: ready"
}

want=("$@")
[ "${#want[@]}" -eq 0 ] && want=(quark bench)
status=0
for name in "${want[@]}"; do
    case "$name" in
        quark)
            make_env quark \
                torch==2.13.0 -- \
                amd-quark==0.13 "onnxruntime>=1.22.2,<=1.28.0" onnxruntime_extensions psutil \
                || status=1 ;;
        bench)
            make_env bench \
                onnx==1.23.2 onnxruntime==1.31.1 onnxsim==0.8.1 numpy pillow matplotlib \
                || status=1 ;;
        *) echo "[setup_envs] unknown environment: $name"; status=2 ;;
    esac
done
exit $status
