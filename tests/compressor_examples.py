"""Small-tensor-friendly hyper-parameters for the registered compressors, shared by the tests.

A name missing here is built with its defaults.
"""

EXAMPLE_KWARGS = {
    "qsgd": dict(levels=4),
    "randomk": dict(ratio=0.3),
    "topk": dict(ratio=0.3),
    "threshold": dict(v=0.5),
    "dgc": dict(ratio=0.3),
    "adaptive": dict(ratio=0.3),
    "powersgd": dict(matrix_approximation_rank=2),
    "qsparse": dict(ratio=0.3, levels=4),
    "random_sparsification": dict(p=0.5),
    "clipping": dict(bits=8),
    "stochastic_rounding": dict(bits=4),
    "sketchml": dict(buckets=16),
    "inceptionn": dict(error_bound=0.01),
}

# The cases that run through compressed_mean leave these three at their defaults.
AT_DEFAULTS = ("clipping", "stochastic_rounding", "inceptionn")
MEAN_KWARGS = {k: v for k, v in EXAMPLE_KWARGS.items() if k not in AT_DEFAULTS}

# The settings the docs call exact (docs/guide/compressors.md, "Numerics"; the factories'
# docstrings): each must give the uncompressed mean, on every backend. ``dense_below`` above the
# largest test tensor sends every tensor whole (``k = d``).
EXACT_SETTINGS = {
    "none": ("none", {}),
    "topk(ratio=1)": ("topk", dict(ratio=1.0)),
    "topk(dense_below>=d)": ("topk", dict(ratio=0.3, dense_below=1 << 20)),
    "threshold(v=0)": ("threshold", dict(v=0.0)),
    "dgc(ratio=1)": ("dgc", dict(ratio=1.0)),
    "randomk(ratio=1)": ("randomk", dict(ratio=1.0)),
    "random_sparsification(p=1)": ("random_sparsification", dict(p=1.0)),
    "clipping(bits=23)": ("clipping", dict(bits=23)),
}
