#!/usr/bin/env bash
# gmlx on an NVIDIA GPU (mlx's CUDA backend), for a machine with no package index.
#
#   bash scripts/cuda_bench.sh prepare          # here: wheels for Python 3.12 into .cuda1/ .cuda2/,
#                                               # SmolLM2's GGUF in thirds into .cuda3/ .cuda4/ .cuda5/
#   bash scripts/cuda_bench.sh stage [DIR]      # there, first: keep .cuda1/ (then .cuda3-5/: optional)
#   OUT=dir bash scripts/cuda_bench.sh run      # there, next: install, then tests and benchmarks
#   OUT=dir bash scripts/cuda_bench.sh check    # there, instead of run: the rules' tests and cost
#   bash scripts/cuda_bench.sh probe scripts/row_bits_probe.py   # there: one script on the stack
#
# mlx-cuda's wheel is ~90 MB, more than one transfer of 64 MiB beside the tree (~20 MB), so its
# files travel xz-packed in two halves; the rest of the wheels ride with the second half. The
# real model (98 MB) travels in thirds, each staged by its own call; without them the runs skip
# its benchmark. Calls must follow each other within the machine's idle window (~30 s). The run
# writes its logs and the bench JSON under $OUT.
set -uo pipefail

MLX_VERSION=0.32.4
STAGE=/tmp/gmlx_cuda_stage
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
# Speculative and batched output against plain decoding, on the GPU's own kernels.
IDENTITY_TESTS=(tests/test_speculative.py tests/test_engine.py::test_staggered_batch_equals_alone)
SITE=/tmp/gmlx_cuda_site
PY_TAGS=(--python-version 3.12 --implementation cp --only-binary=:all: --no-deps
         --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64
         --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

prepare() {
    local work
    work=$(mktemp -d)
    mkdir -p .cuda1 .cuda2
    python3 -m pip download -q "${PY_TAGS[@]}" -d "$work" "mlx-cuda-13==$MLX_VERSION" || exit 1
    python3 -m pip download -q "${PY_TAGS[@]}" -d .cuda2 "mlx==$MLX_VERSION" mlx-lm==0.32.2 pyzmq msgspec gguf || exit 1
    mkdir -p "$work/x" && (cd "$work/x" && unzip -q ../mlx_cuda_13-*.whl) || exit 1
    tar -C "$work/x" -cf - . | xz -T0 -6 > "$work/mlx_cuda.tar.xz" || exit 1
    split -b 40000000 -d "$work/mlx_cuda.tar.xz" "$work/mlx_cuda.tar.xz.part"
    mv "$work/mlx_cuda.tar.xz.part00" .cuda1/ && mv "$work"/mlx_cuda.tar.xz.part0[1-9] .cuda2/
    local gguf
    gguf=$(python3 -c "from gmlx.models.source import resolve_model_path; print(resolve_model_path('smollm2'))") || exit 1
    split -n 3 -d "$gguf" "$work/$GGUF_NAME.part"
    for i in 0 1 2; do mkdir -p ".cuda$((i + 3))" && mv "$work/$GGUF_NAME.part0$i" ".cuda$((i + 3))/"; done
    rm -rf "$work"
    du -sh .cuda1 .cuda2 .cuda3 .cuda4 .cuda5
}

stage() {
    mkdir -p "$STAGE" && cp "${1:-.cuda1}"/* "$STAGE/" && ls -la "$STAGE"
}

# SmolLM2's GGUF put back together from the staged thirds; empty when they are not all there.
real_model() {
    [ "$(ls "$STAGE/$GGUF_NAME".part0* 2>/dev/null | wc -l)" = 3 ] || return 0
    [ -f "$STAGE/$GGUF_NAME" ] || cat "$STAGE/$GGUF_NAME".part0* > "$STAGE/$GGUF_NAME"
    echo "$STAGE/$GGUF_NAME"
}

# The real model on the GPU: plain and the default drafter, with each attention rule and the rules off.
bench_real_model() {
    local gguf
    gguf=$(real_model)
    [ -n "$gguf" ] || { echo "real model: not staged (stage .cuda3, .cuda4 and .cuda5 first)"; return 0; }
    timeout 150 python3 -m workers.cli bench --quiet --model "$gguf" --concurrency 1,8 --requests-per-client 2 \
        --max-tokens 64 --repeats 2 --out "$OUT/bench_smollm2.json" --target engine:drafter=none,label=plain \
        --target engine:label=default --target "engine:row_attention=unmasked,label=default unmasked" \
        --target "engine:drafter=none,row_invariance=0,label=plain rules off" \
        --target "engine:row_invariance=0,label=default rules off" > "$OUT/bench_smollm2.log" 2>&1
    echo "bench smollm2 rc=$?"; show_table "$OUT/bench_smollm2.log" 2-8,12,14
}

# A bench log's table, the columns worth reading in a terminal.
show_table() {
    grep -E '^\| (conc|[0-9])' "$1" | cut -d'|' -f"$2"
}

install() {
    rm -rf "$SITE" && mkdir -p "$SITE"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .cuda2/*.whl || return 1
    # After pip: pip --target would replace the mlx folder the CUDA library lands in.
    cat "$STAGE"/mlx_cuda.tar.xz.part* .cuda2/mlx_cuda.tar.xz.part* | xz -d | tar -C "$SITE" -xf - || return 1
    # libmlx's rpath looks for the CUDA libraries in site-packages/nvidia beside it.
    local nvidia
    nvidia=$(python3 -c "import nvidia; print(list(nvidia.__path__)[0])") || return 1
    ln -sfn "$nvidia" "$SITE/nvidia"
}

# Install, then run everything after this on the installed stack.
start() {
    : "${OUT:?OUT names the folder for logs}"
    install > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
    export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
}

# Prefill under the rules (one attention call a query): time to first token on long prompts.
bench_prefill() {
    timeout "$1" python3 -m workers.cli bench --quiet --concurrency 1 --requests-per-client 3 --prompt-tokens 400 \
        --max-tokens 8 --repeats 2 --out "$OUT/bench_prefill.json" --target engine:drafter=none,label=plain \
        --target "engine:drafter=none,row_attention=unmasked,label=plain unmasked" \
        --target "engine:drafter=none,row_invariance=0,label=plain rules off" > "$OUT/bench_prefill.log" 2>&1
    echo "bench prefill rc=$?"; show_table "$OUT/bench_prefill.log" 2-8,12
}

run() {
    start
    local gmlx=(python3 -m workers.cli)
    { nvidia-smi -L; python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
      "${gmlx[@]}" doctor; } > "$OUT/env.txt" 2>&1
    cat "$OUT/env.txt"
    # Row invariance on (auto on a GPU), then off: without it 3 of 25 failed on an H200.
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m "not slow" "${IDENTITY_TESTS[@]}" tests/test_row_invariance.py \
        > "$OUT/tests.log" 2>&1
    echo "tests rc=$?"; tail -n 25 "$OUT/tests.log"
    # The built-in model, in-process: plain, the default (adaptive) and fixed-depth speculation.
    # The last two targets: what the row-invariance rules cost (on by default on a GPU).
    timeout 150 "${gmlx[@]}" bench --quiet --concurrency 1,2,4,8,16,32 --requests-per-client 2 \
        --max-tokens 64 --repeats 2 --out "$OUT/bench_engine.json" \
        --target engine:drafter=none,label=plain --target engine:label=default \
        --target engine:adaptive=0,label=fixed --target "engine:drafter=none,row_invariance=0,label=plain rules off" \
        --target "engine:row_invariance=0,label=default rules off" > "$OUT/bench_engine.log" 2>&1
    echo "bench engine rc=$?"; tail -n 40 "$OUT/bench_engine.log"
    bench_prefill 90
    # Whether a cheaper attention rule (fixed 16-query masked calls) would keep rows' bits.
    timeout 45 python3 scripts/row_bits_probe.py > "$OUT/probe.log" 2>&1
    echo "probe rc=$?"; tail -n 30 "$OUT/probe.log"
    GMLX_ROW_INVARIANCE=0 timeout 120 python3 -m pytest -q -p no:cacheprovider -m "not slow" "${IDENTITY_TESTS[@]}" \
        > "$OUT/tests_rules_off.log" 2>&1
    echo "tests, row invariance off: rc=$?"; tail -n 6 "$OUT/tests_rules_off.log"
    timeout 110 "${gmlx[@]}" bench --quiet --concurrency 1,4,16 --requests-per-client 2 --max-tokens 64 \
        --out "$OUT/bench_server.json" --target server:drafter=none,label=plain \
        --target server:label=default > "$OUT/bench_server.log" 2>&1
    echo "bench server rc=$?"; tail -n 15 "$OUT/bench_server.log"
    bench_real_model
}

# After a change to the row-invariance rules, a shorter run (~5 minutes): their identity tests
# on this GPU under each attention rule, then what they cost in decode and prefill, side by side
# with the rules off.
check() {
    start
    local gmlx=(python3 -m workers.cli)
    python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m "not slow" "${IDENTITY_TESTS[@]}" \
        tests/test_row_invariance.py > "$OUT/tests.log" 2>&1
    echo "tests rc=$?"; tail -n 12 "$OUT/tests.log"
    GMLX_ROW_ATTENTION=unmasked timeout 120 python3 -m pytest -q -p no:cacheprovider -m "not slow" \
        "${IDENTITY_TESTS[@]}" > "$OUT/tests_unmasked.log" 2>&1
    echo "tests, unmasked attention rule: rc=$?"; tail -n 6 "$OUT/tests_unmasked.log"
    timeout 40 python3 scripts/row_bits_probe.py --attention-only > "$OUT/probe_attention.log" 2>&1
    echo "attention probe rc=$?"; grep -E "unmasked|moved" "$OUT/probe_attention.log"
    timeout 150 "${gmlx[@]}" bench --quiet --concurrency 1,4,16,32 --requests-per-client 2 --max-tokens 64 \
        --repeats 2 --out "$OUT/bench_engine.json" --target engine:drafter=none,label=plain \
        --target "engine:drafter=none,row_attention=unmasked,label=plain unmasked" \
        --target "engine:drafter=none,row_invariance=0,label=plain rules off" --target engine:label=default \
        --target "engine:row_attention=unmasked,label=default unmasked" \
        --target "engine:row_invariance=0,label=default rules off" > "$OUT/bench_engine.log" 2>&1
    echo "bench engine rc=$?"; show_table "$OUT/bench_engine.log" 2-8,12
    bench_prefill 60
    bench_real_model
}

# One script on the installed stack, for a probe between full runs (`probe scripts/x.py`).
probe() {
    [ -d "$SITE/mlx" ] || install || exit 1
    PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 python3 "$@"
}

case "${1:-}" in
    prepare) prepare ;;
    stage) shift; stage "$@" ;;
    run) run ;;
    check) check ;;
    probe) shift; probe "$@" ;;
    *) echo "usage: $0 prepare|stage|run|check|probe script.py" >&2; exit 2 ;;
esac
