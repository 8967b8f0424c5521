#!/usr/bin/env bash
# The benchmark venv for benchmarks/peers/run.py (never used by the test suite or CI).
#
#   bash benchmarks/peers/setup.sh /tmp/peers-venv [PATH/TO/google-research/performer/fast_attention/jax/fast_attention.py]
#
# Installs, in this order (torch first, so nothing pulls another torch build):
#   torch==2.13.0 (the CPU build), jax[cpu], absl-py and gin-config (google-research's
#   Performer imports them), pytorch-fast-transformers (built from its PyPI sdist against
#   that torch: --no-build-isolation, no nvcc on PATH, so only the CPU kernels), performer-pytorch
#   (--no-deps, its dependencies named explicitly), and linattn from this checkout
#   (pip install -e .[numba]).  google-research's Performer is not on PyPI: pass its
#   fast_attention.py (see benchmarks/peers/README.md) and it is copied to
#   benchmarks/peers/_vendor/ (git-ignored), where run.py looks for it.
set -euo pipefail
venv=${1:?usage: setup.sh VENV [fast_attention.py]}
google=${2:-}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
python=${PYTHON:-python3.11}

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check)
"${pip[@]}" --upgrade pip setuptools wheel
"${pip[@]}" torch==2.13.0
"${pip[@]}" "jax[cpu]" absl-py gin-config psutil ninja
# fast-transformers: its setup.py imports torch, so build it against the installed one;
# hide nvcc (and CUDA_HOME) so that only the CPU extensions are compiled.
# (Its setup.py adds the CUDA extensions whenever an `nvcc` runs: drop every PATH entry
# that holds one, e.g. /usr/local/bin on machines with a CUDA toolkit.)
no_nvcc=$(printf '%s' "$PATH" | tr ':' '\n' | while read -r d; do [ -x "$d/nvcc" ] || printf '%s\n' "$d"; done | paste -sd:)
env -u CUDA_HOME -u CUDA_PATH PATH="$no_nvcc" MAX_JOBS="${MAX_JOBS:-2}" \
  "${pip[@]}" --no-build-isolation --no-binary pytorch-fast-transformers pytorch-fast-transformers
# performer-pytorch: without its dependencies (an unpinned torch), then those by name,
# pinned to releases of its time (2022): local-attention >= 1.10 imports hyper-connections,
# which performer-pytorch 1.1.4 does not know about (its module imports local_attention).
"${pip[@]}" --no-deps performer-pytorch==1.1.4 local-attention==1.4.4 axial-positional-embedding==0.2.1
"${pip[@]}" einops
"${pip[@]}" -e "$repo[numba]"
if [ -n "$google" ]; then  # kept out of git (benchmarks/peers/.gitignore); run.py reads it
  mkdir -p "$here/_vendor"
  cp "$google" "$here/_vendor/fast_attention.py"
  sha256sum "$here/_vendor/fast_attention.py"
fi
"$venv/bin/python" -m pip check || true
"$venv/bin/python" - <<'PY'
import importlib
for name in ("torch", "jax", "fast_transformers.causal_product", "performer_pytorch",
             "linattn", "linattn_numba.cpu", "gin", "absl"):
    try:
        module = importlib.import_module(name)
        print(f"{name:35s} ok {getattr(module, '__version__', '')}")
    except Exception as error:  # noqa: BLE001
        print(f"{name:35s} MISSING ({type(error).__name__}: {error})")
PY
