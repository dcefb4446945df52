"""Kernels of the compressors: selection and compaction, counter-based random bits, bit packing."""
