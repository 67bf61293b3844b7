"""``"sparse-vd"``: sparse variational dropout on a trained model, with pruning by ``log alpha``."""

from posthoc.methods.sparse_vd.method import SparseVariationalDropout  # noqa: F401
