"""The cpu device's own pieces: compiled layers, C++ kernels, quantized layers, threads."""
