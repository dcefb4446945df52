"""Kernels of the compressors: selection (top-k), compaction, counter-based random bits, bit packing."""
