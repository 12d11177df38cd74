"""gmlx: speculative decoding and continuous batching together, on MLX.

Importing gmlx loads nothing: entry points that run models call
gmlx.platform.blas.ensure_fast_blas() before mlx is first imported (on Linux the fast
BLAS must be loaded globally before mlx, or mlx binds its bundled reference BLAS).
"""

__version__ = "0.1.0"
