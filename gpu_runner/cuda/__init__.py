"""The cuda device: flashinfer attention, CUDA graphs, memory sizing, warm-up."""
