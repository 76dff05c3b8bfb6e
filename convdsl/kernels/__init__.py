"""The CUDA kernels: Triton GEMM cores of the implicit GEMMs (igemm.py), the steps around them for runtimes that
launch them directly (elementwise.py), their tiles (tiles.py), and the launches built from decided tiles and
split-K chunks, compiled without a GPU (launch.py).  What to launch is decided in convdsl/policy.py."""
