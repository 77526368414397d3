#!/usr/bin/env bash
# GPU check of the core bridge: runs on a machine with an NVIDIA GPU, torch (CUDA build) and JAX (CUDA).
# Writes what it prints to ${OUT:-.}/gpu_check.txt. Usage: bash benchmarks/gpu_check.sh
set -uo pipefail
out="${OUT:-.}/gpu_check.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 BRIDGE_CACHE_DIR=/tmp/bridge-xla
{
  echo "== machine"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import sys, torch, jax; print('python', sys.version.split()[0], 'torch', torch.__version__, 'jax', jax.__version__, jax.devices())"
  echo "== example: char GPT, 20 steps, plain torch on the CPU vs bridge on the GPU (float32)"
  python -m bridge compare --match loss examples/gpt_char.py --steps 20
  echo "== example: CNN, 20 steps"
  python -m bridge compare --match loss examples/cnn.py --steps 20
  echo "== tests on the GPU backend (parity, semantics, amp, serialization)"
  JAX_PLATFORMS=cuda python -m pytest -q -p no:cacheprovider tests/test_parity.py tests/test_core_semantics.py tests/test_amp_serialization.py 2>&1 | tail -25
  echo "== eager step time, char GPT (bridge on GPU vs torch CUDA eager)"
  python benchmarks/eager_step.py
} 2>&1 | tee "$out"
