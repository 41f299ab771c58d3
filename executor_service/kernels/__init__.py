"""The C kernels (the *.c files and headers here), built once per machine into one shared library
(cpu_kernels, cached where kernel_cache allows), and the ctypes wrappers of the row argmax, the
layers' elementwise passes and the panel GEMM. Attention's kernels are wrapped in attention/."""
