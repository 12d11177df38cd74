"""Run `mlx_lm.server` unchanged, after gmlx has loaded its BLAS into the process.

On Linux the mlx wheel's bundled BLAS is ~20x slower than the system OpenBLAS gmlx loads
before mlx (docs/platform.md); comparing servers on different BLAS libraries would measure the
libraries. `python -m workers.bench.mlx_lm_launch ARGS` takes mlx_lm.server's own arguments.
"""

from gmlx.platform.blas import ensure_fast_blas

ensure_fast_blas()  # the fast BLAS before mlx is first imported
from mlx_lm.server import main  # noqa: E402

if __name__ == "__main__":
    main()
