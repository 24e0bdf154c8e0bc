# GPU image: CUDA runtime, PyTorch with CUDA, this package with the ONNX, cuda-python and av (PyAV: m4a, mp4, webm, ...) extras.
# TensorRT is optional: build FROM an nvcr.io TensorRT image instead, or `pip install '.[tensorrt]'`
# where its libraries can be fetched. cuda-python stays below 13: CUDA 13 bindings fail every call on
# the 12.x drivers this CUDA 12.8 image targets, and the decoder would fall back from full-graph.
# Run (the workers' shared memory is anonymous: Docker's 64 MB /dev/shm is enough, no --shm-size):
#   docker run --gpus all -v $PWD:/data -v hf:/cache IMAGE /data/audio --out /data/out
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv libsndfile1 ffmpeg \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

WORKDIR /app
# Dependencies first so that code changes do not reinstall torch.
COPY pyproject.toml README.md ./
COPY transcribe/__init__.py transcribe/__init__.py
COPY engines/__init__.py engines/__init__.py
RUN pip install torch --index-url https://download.pytorch.org/whl/cu128 \
 && pip install -e '.[onnx,cuda,av]' 'cuda-python>=12.4,<13'
COPY transcribe transcribe
COPY engines engines

# Models fetched by registry name land in the Hugging Face cache: mount it to keep them.
ENV HF_HOME=/cache/huggingface
VOLUME ["/cache"]
ENTRYPOINT ["transcribe"]
CMD ["--help"]
