#!/usr/bin/env bash
# Compile every example for CUDA (at a reduced batch) into build/gpu/, for tests/test_gpu.py on the GPU machine.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
arch="${1:-sm_80}"
mkdir -p build/gpu
for f in examples/*.conv; do
  convdsl compile "$f" --target cuda --arch "$arch" --batch 2 -o "build/gpu/$(basename "${f%.conv}").vmfb"
done
