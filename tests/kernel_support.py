"""What the CPU-kernel test files share: the extension with its settings restored, the ISAs
this CPU runs, and the identity check over random schedules with the kernels on."""

import pytest

from gmlx.config import EngineConfig
from gmlx.drafters import make_drafter
from gmlx.engine import Engine
from gmlx.platform import cpu_kernels
from schedules import SoloReference, check_schedule, make_schedule

requires_kernels = pytest.mark.skipif(
    not cpu_kernels.is_built(), reason=f"gmlx CPU kernels not built: {cpu_kernels.status()['reason']}")


@pytest.fixture
def ext():
    """The extension, with its thread count, ISA and panel switch point restored after the test."""
    ext = cpu_kernels.extension()
    num_threads, isa, panel_min_rows = ext.num_threads(), ext.isa(), ext.panel_min_rows()
    yield ext
    ext.set_num_threads(num_threads)
    ext.set_isa(isa)
    ext.set_panel_min_rows(panel_min_rows)


def supported_isas(ext) -> list[str]:
    order = ["portable", "avx2", "avx512"]
    return order[: order.index(ext.best_isa()) + 1]


def check_schedules_with_drafter(target, kind: str, code_prompts, seeds) -> int:
    """Every stream of random schedules (one per seed) equals solo plain decoding, speculating
    with `kind` (ngram, or the target as its own draft model); returns the speculative rounds."""
    drafter = make_drafter(kind if kind == "ngram" else f"draft:{target.path}", target)
    engine = Engine(target, drafter, EngineConfig())
    reference = SoloReference(target)
    return sum(check_schedule(engine, reference, make_schedule(seed, target.vocab_size, code_prompts,
                                                                max_requests=6)).counters["num_spec_rounds"]
               for seed in seeds)
