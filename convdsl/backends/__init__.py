"""Where compiled kernels run: IREE (iree.py: iree-compile and iree.runtime; iree_config.py: knobs over IREE's
GPU configuration; into_call.py: destination-passing calls) and the CUDA driver (cuda_driver.py: load and launch
a compiled kernel on a caller's stream)."""
