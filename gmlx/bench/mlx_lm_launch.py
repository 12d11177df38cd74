"""Run `mlx_lm.server` unchanged, after gmlx has loaded its BLAS into the process.

On Linux the mlx wheel's bundled BLAS is ~20x slower than the system OpenBLAS gmlx loads
before mlx (DESIGN.md); comparing servers on different BLAS libraries would measure the
libraries. `python -m gmlx.bench.mlx_lm_launch ARGS` takes mlx_lm.server's own arguments.
"""

import gmlx  # noqa: F401  (the BLAS, before mlx is imported below)
from mlx_lm.server import main

if __name__ == "__main__":
    main()
