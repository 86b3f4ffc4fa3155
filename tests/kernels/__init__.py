"""Kernel tests: one file per op folder of replicas/kernels (test_<op>.py), each checking every backend of
that op (the native C++ kernel where this host builds it, the Triton kernel where triton imports: compiled on
CUDA, else under Triton's interpreter on CPU tensors, and the PyTorch path) against the folder's naive.py;
test_triton_compile.py compiles every Triton kernel for sm_90."""
