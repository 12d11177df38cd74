"""gmlx: speculative decoding and continuous batching together, on MLX."""

# The BLAS (and the sgemv interposer) must be loaded globally before mlx is first
# imported, or mlx binds its bundled reference BLAS for the life of the process.
from gmlx.platform.blas import ensure_fast_blas as _ensure_fast_blas

_ensure_fast_blas()

__version__ = "0.1.0"
