"""Models and how they run: checkpoints, encoders, decoders, tokenizers.

Importing this package caps oneDNN's shape-keyed caches (before any model code runs a oneDNN
op, which is when they read their size): oneDNN's primitive cache and ATen/ideep's LRU cache
keep, per input shape, the primitives (JIT kernels) of every packed linear and convolution,
up to 1,024 entries each by default. Batches of pieces have ever-new shapes (batch size x
frames: 93 shapes in 95 batches of 8,000 short files), so the CPU pipeline's main process grew
by ~30-45 KB per short file on tdt_tiny (+260-300 MiB after 8,000 files; live malloc'd memory,
which neither malloc_trim nor tracemalloc sees), flattening only near ~550 MB, where those
caches fill. A forward pass needs ~8 distinct primitives (3 convolutions, 5 linears) that the
layers then share, and another batch's shape is almost never the same, so a small cache keeps
every hit that happens: 64 entries hold RSS flat at no measurable cost in CPU time. A value set
in the environment wins.
"""
import os

ONEDNN_CACHE_ENTRIES = "64"

os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_CACHE_ENTRIES)
os.environ.setdefault("LRU_CACHE_CAPACITY", ONEDNN_CACHE_ENTRIES)
