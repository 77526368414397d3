#!/usr/bin/env bash
# GPU check of the core bridge: runs on a machine with an NVIDIA GPU, torch (CUDA build) and JAX (CUDA).
# Writes what it prints to ${OUT:-.}/gpu_check.txt. Usage: bash benchmarks/gpu_check.sh
set -uo pipefail
out="${OUT:-.}/gpu_check.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 BRIDGE_CACHE_DIR=/tmp/bridge-xla
# Tests start scripts in processes of their own beside the test process: no process may take
# most of the GPU's memory up front, as JAX does by default.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# The reference is plain torch on the CPU, in full float32, while torch's CUDA default (which
# the bridge follows) lets float32 convolutions run in TF32: the CNN's losses differ by about
# 1e-4. The tests turn TF32 off in their own process (tests/conftest.py); the example scripts
# they start keep the default. (NVIDIA_TF32_OVERRIDE=0 is no way out: XLA's cuDNN convolutions
# then fail with CUDNN_STATUS_NOT_SUPPORTED.)
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
