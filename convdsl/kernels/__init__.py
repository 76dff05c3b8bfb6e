"""The CUDA kernels: Triton GEMM cores of the implicit GEMMs (igemm.py), Hopper's TMA kernels (tma.py, halo.py),
the steps around them for runtimes that launch them directly (elementwise.py), their tiles (tiles.py); the launch
types and their index geometry (launch.py), the launches built from decided tiles and split-K chunks
(igemm_launches.py, tma_launches.py, elementwise_launches.py), and their compiling without a GPU (compile.py).
What to launch is decided in convdsl/policy/."""
