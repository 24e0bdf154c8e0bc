#!/usr/bin/env bash
# Runs ON a lent GPU machine (the `device` tool), from the repository root, with .gpukit/
# carried (made by bench/gpu/prepare_kit.sh). Stages, so each call fits the tool's 10 minutes:
#
#   bash bench/gpu/on_device.sh tests     # GPU tests: every decoder mode, encoder backend and
#                                         # the streaming kernel against eager, on the fixtures
#   bash bench/gpu/on_device.sh bench     # 618M model: RTFx from files per backend and mode,
#                                         # decoder-only speed-ups, NeMo on the same GPU
#   bash bench/gpu/on_device.sh stream    # streaming load on the 618M shape (streams at p95 < 300 ms)
#   bash bench/gpu/on_device.sh features  # 618M model: log-mel in the workers vs on the GPU, micro
#                                         # (batched vs per piece) and end to end (RTFx, stages)
#
# Logs and JSON go to $OUT (the tool brings them back). The machine starts bare, so every call
# installs the kit's wheels again (pure unpacking, seconds).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpukit/whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
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
make_model() {
  [ -f "$MODEL" ] || python3 ../shared/tools/make_random_nemo.py ../shared/fixtures/parakeet_tdt_0.6b_v2_shape "$MODEL" --seed 0
}
case "${1:-tests}" in
  tests)
    python3 -m pytest -q -rs tests/test_decode_graphs.py tests/test_encoder_backends_gpu.py \
      tests/test_stream_attention_triton.py tests/test_encoder_backends.py tests/test_decoding.py \
      tests/test_features_device.py::test_cuda_device_features_equal_cpu_worker_features_and_tokens \
      tests/test_encoder_precision.py tests/test_whisper_graph.py tests/test_whisper_graph_random.py \
      tests/test_whisper_fallback.py \
      2>&1 | tee "$OUT/gpu_tests.log"
    ;;
  bench)
    make_model
    python3 bench/encoder_precision.py --model "$MODEL" --device cuda --json "$OUT/encoder_precision.json" \
      2>&1 | tee "$OUT/gpu_bench.log"
    python3 bench/gpu_bench.py --model "$MODEL" --audio ../shared/data/speech/librispeech_test_other \
      --min-hours 1 --nemo-python python3 --json "$OUT/gpu_bench.json" 2>&1 | tee -a "$OUT/gpu_bench.log"
    ;;
  stream)
    make_model
    for n in 64 128 256; do
      python3 bench/streaming_load.py --model "$MODEL" --streams $n --files 20 --device cuda \
        --audio ../shared/data/speech/librispeech_test_other --json "$OUT/stream_$n.json" 2>&1 | tail -5
    done | tee "$OUT/stream.log"
    ;;
  features)
    make_model
    python3 bench/features_device.py --model "$MODEL" --device cuda --audio ../shared/data/speech/librispeech_test_other \
      --json "$OUT/features_device.json" 2>&1 | tee "$OUT/features.log"
    python3 bench/gpu_bench.py --model "$MODEL" --audio ../shared/data/speech/librispeech_test_other --min-hours 1 \
      --backends cuda-graphs --modes auto --features-on workers,device --json "$OUT/gpu_bench_features.json" \
      2>&1 | tee -a "$OUT/features.log"
    ;;
  *) echo "usage: on_device.sh tests|bench|stream|features"; exit 2 ;;
esac
