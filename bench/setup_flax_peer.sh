#!/usr/bin/env bash
# Creates the virtualenv of the `flax446` benchmark peer: transformers 4.46.3, the last release
# with Flax generate, on jax 0.4.35 / flax 0.10.2 (which cannot share genjax's environment).
#
#   bash bench/setup_flax_peer.sh [DIR]     # default DIR: .flax-peer-venv at the repo root
#   python bench/run.py --libs genjax torch flax446 [--flax-python DIR/bin/python]
#
# Needs python3.11 (or $PYTHON) and access to the package registry. torch is not installed:
# transformers 4.46 converts the bench's PyTorch-format safetensors checkpoint to Flax without it.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$repo/.flax-peer-venv}"
python="${PYTHON:-python3.11}"

if ! command -v "$python" >/dev/null; then
    echo "setup_flax_peer.sh: $python not found; install Python 3.11 or set PYTHON=/path/to/python3.x" >&2
    exit 1
fi

"$python" -m venv "$dir"
"$dir/bin/python" -m pip install --quiet \
    "jax==0.4.35" "jaxlib==0.4.35" "flax==0.10.2" "transformers==4.46.3" safetensors numpy

# Fail now, not in the middle of a benchmark, if the stack does not import or run.
"$dir/bin/python" - <<'EOF'
import jax, jax.numpy as jnp, flax, transformers
from transformers import FlaxGPT2LMHeadModel, FlaxLlamaForCausalLM  # noqa: F401
assert float(jax.jit(lambda x: x + 1)(jnp.ones(()))) == 2.0
print(f"flax peer ready: jax {jax.__version__}, flax {flax.__version__}, "
      f"transformers {transformers.__version__}")
EOF
echo "python: $dir/bin/python"
