"""Where does the full-graph decoder's capture crash? Runs on a lent GPU (`on_device.sh probe`).

On the first GPU session (H100, torch 2.11 cu130, cuda-bindings 13.3) capturing the transducer
decoder's full graph segfaulted inside torch's `capture_end`, which no fallback can catch, so
"auto" ran unrolled. The third session (2026-11-23) found the cause with this probe: cuDNN's
LSTM fails inside a conditional body's capture (CUDNN_STATUS_INTERNAL_ERROR), so the decoder
now steps torch's own LSTM cell on CUDA and "auto" is full-graph again. Each variant below runs in its
own process (a segfault ends only that one) and prints what its graph computed:

  inplace, alloc_mempool, alloc   one WHILE node counting x to 10; the body allocates or not,
                                  into a MemPool or torch's default (as NeMo's bodies do)
  nested                          a WHILE node in a WHILE node, both conditional handles made in
                                  the root graph (what cuda_conditional does now, as NeMo does)
  nested_bodyhandle               the inner handle made in the body graph (what it did when the
                                  crash was seen): if only this one crashes, that was the cause
  lstm, lstm_relaxed, lstm_nocudnn  the body runs an nn.LSTM step and a Linear (cuDNN and cuBLAS
                                  on a body stream, as the decoder's prediction net does);
                                  relaxed: that capture mode; nocudnn: torch's own LSTM kernels
  decoder, decoder_nopool,        the full-graph GPU test on every fixture; nopool: without the
  decoder_relaxed                 MemPool for allocations inside the bodies; relaxed: captured in
                                  relaxed mode (works only there: a call thread-local forbids)

A segfault in capture_end is what the CUDA driver does when a body's capture was invalidated
and the enclosing capture then ends (NVIDIA/cuda-python#2918); cuda_conditional prints the
body's error first ("capturing a CUDA-graph while-loop body failed: ..."): look for that line.
"""
import contextlib, faulthandler, subprocess, sys
faulthandler.enable()
import torch

def run_decoder(name):
    sys.path.insert(0, "tests")
    if "nopool" in name:
        torch.cuda.use_mem_pool = lambda *a, **k: contextlib.nullcontext()
    if "relaxed" in name:
        from engines import decode_graphs
        decode_graphs.FULL_GRAPH_CAPTURE_MODE = "relaxed"
    import test_decode_graphs as t
    from conftest import OFFLINE_VARIANTS
    for v in OFFLINE_VARIANTS:
        t.test_gpu_modes_equal_eager(v, "full-graph")
        print(name, v, "ok", flush=True)

def run_variant(name):
    if name.startswith("decoder"):
        return run_decoder(name)
    from engines import cuda_conditional as cc
    if "bodyhandle" in name:  # the old behaviour: a nested loop's handle made in the body graph
        orig = cc.WhileLoops._add_while_node
        def patched(self, stream, flag):
            d = self._depth; self._depth = 0
            try:
                return orig(self, stream, flag)
            finally:
                self._depth = d
        cc.WhileLoops._add_while_node = patched
    dev = torch.device("cuda", torch.cuda.current_device())  # use_mem_pool needs an index
    mode = "global" if "global" in name else "relaxed" if "relaxed" in name else "thread_local"
    loops = cc.WhileLoops(cc.import_cuda_python(), dev, mode)
    x = torch.zeros((), dtype=torch.int32, device=dev)
    y = torch.zeros((), dtype=torch.int32, device=dev)
    z = torch.zeros((), dtype=torch.int32, device=dev)
    flag = torch.ones((), dtype=torch.bool, device=dev)
    flag_i = torch.ones((), dtype=torch.bool, device=dev)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(dev); s.wait_stream(torch.cuda.current_stream())
    body_pool = torch.cuda.MemPool() if "mempool" in name or "lstm" in name else None
    limit = 10 if "nested" not in name else 3
    if "lstm" in name:
        if "nocudnn" in name:
            torch.backends.cudnn.enabled = False
        lstm, lin = torch.nn.LSTM(64, 64, 1).to(dev), torch.nn.Linear(64, 64).to(dev)
        h, c = torch.zeros(1, 4, 64, device=dev), torch.zeros(1, 4, 64, device=dev)
        emb, out = torch.randn(1, 4, 64, device=dev), torch.zeros(1, 4, 64, device=dev)
    def body():
        if "lstm" in name:
            o, (h2, c2) = lstm(emb, (h, c))
            h.copy_(h2); c.copy_(c2); out.copy_(lin(o))
        if "alloc" in name:
            x.copy_(x + 1)
            flag.copy_(x < limit)
        else:
            x.add_(1)
            torch.lt(x, limit, out=flag)
    with torch.cuda.stream(s):
        body(); x.zero_(); flag.fill_(True)
    torch.cuda.synchronize()
    with torch.inference_mode(), torch.cuda.graph(g, stream=s, capture_error_mode=mode):
        x.zero_(); z.zero_(); flag.fill_(True)
        ctx = torch.cuda.use_mem_pool(body_pool, dev) if body_pool is not None else contextlib.nullcontext()
        with ctx, loops.while_loop(flag):
            if "nested" in name:
                y.zero_(); flag_i.fill_(True)
                with loops.while_loop(flag_i):
                    y.add_(1); z.add_(1); torch.lt(y, 4, out=flag_i)
            body()
    print("captured", flush=True)
    g.replay(); torch.cuda.synchronize()
    print(name, "x =", int(x), "z =", int(z), flush=True)

if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):  # before anything touches CUDA: help works on any machine
        print(__doc__); sys.exit(0)
    if len(sys.argv) > 1:
        run_variant(sys.argv[1]); sys.exit(0)
    # Most telling first: the stage has 300 s for all of them.
    for v in ["decoder", "decoder_relaxed", "lstm", "lstm_relaxed", "lstm_nocudnn", "nested", "inplace", "alloc",
              "alloc_mempool", "nested_bodyhandle", "nested_alloc_mempool", "decoder_nopool"]:
        try:
            r = subprocess.run([sys.executable, __file__, v], capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired as e:
            print(f"== {v}: timed out after 60 s\n{(e.stdout or b'')[-800:]!r}", flush=True)
            continue
        err = "\n".join(l for l in r.stderr.splitlines() if "site-packages" not in l)
        cause = "\n".join(l for l in r.stderr.splitlines() if l.startswith("transcribe:"))  # the body's error
        print(f"== {v}: rc {r.returncode}\n{cause}\n{r.stdout[-800:]}\n{err[-1500:]}", flush=True)
