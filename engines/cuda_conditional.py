"""CUDA-graph conditional WHILE nodes through cuda-python, for the full-graph decoder mode.

torch (2.13) can capture an IF node (`CUDAGraph.begin_capture_to_if_node`) but exposes no
WHILE node, so the loop is built with the CUDA API itself, inside a torch capture:

    with torch.cuda.graph(g, ...):               # torch owns the outer capture
        ...                                      # captured as usual
        with loops.while_loop(flag):             # flag: 0-dim bool CUDA tensor
            body()                               # captured once into the node's body graph
                                                 # (the body must recompute `flag`)

`while_loop` launches a tiny NVRTC-compiled kernel that copies `flag` into the node's
conditional handle (`cudaGraphSetConditional`) before the node (enter the loop at all?) and at
the end of the body (run it again?), adds the node with `cuGraphAddNode`, and redirects
capture into its body graph on a second stream (`cudaStreamBeginCaptureToGraph`).

Both layouts of cuda-python are supported: `cuda.bindings.{runtime,driver,nvrtc}` (>= 12.6,
the only one in 13.x, whose graph calls take an extra edge-data argument) and the legacy
`cuda.{cudart,cuda,nvrtc}`. Conditional nodes need driver, bindings and torch's CUDA
runtime all >= 12.4.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

MIN_VERSION = (12, 4)  # first CUDA with cudaGraphConditionalHandleCreate + cudaGraphAddNode
INSTALL_HINT = "pip install 'transcribe[cuda]'"

_KERNEL_NAME = b"set_while_condition"
_KERNEL_SOURCE = r"""
typedef __device_builtin__ unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(
    cudaGraphConditionalHandle handle, unsigned int value);

extern "C" __global__ void set_while_condition(cudaGraphConditionalHandle handle, const bool *flag)
{
    cudaGraphSetConditional(handle, *flag ? 1u : 0u);
}
"""


class CudaPythonError(Exception):
    """A cuda-python call returned an error status (or capture was not in the expected state)."""


@dataclass(frozen=True)
class CudaPython:
    """The three cuda-python modules, whichever layout provided them, and the bindings version."""

    runtime: Any
    driver: Any
    nvrtc: Any
    version: tuple[int, int]

    @property
    def edge_data(self) -> bool:
        """CUDA 13 bindings take an edge-data list in cuGraphAddNode and
        cudaStreamUpdateCaptureDependencies; 12.x bindings do not."""
        return self.version >= (13, 0)


def _major_minor(text: str) -> tuple[int, int]:
    parts = (text.split(".") + ["0"])[:2]
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def import_cuda_python() -> CudaPython:
    """Import cuda-python lazily; ImportError names the package and the extra that installs it."""
    try:
        from cuda.bindings import __version__ as version
        from cuda.bindings import driver, nvrtc, runtime
    except ImportError:
        try:  # legacy layout (cuda-python < 12.6)
            from cuda import __version__ as version
            from cuda import cuda as driver
            from cuda import cudart as runtime
            from cuda import nvrtc
        except ImportError as e:
            raise ImportError(f"cuda-python is not installed: {INSTALL_HINT}") from e
    return CudaPython(runtime, driver, nvrtc, _major_minor(str(version)))


def check(result: Any) -> tuple:
    """cuda-python returns (status, *values): raise on a non-zero status, else return values.
    Every status enum (CUresult, cudaError_t, nvrtcResult) is an int whose success is 0."""
    status, *values = result if isinstance(result, tuple) else (result,)
    if int(status) != 0:
        raise CudaPythonError(f"cuda-python call failed: {status!r}")
    return tuple(values)


def unsupported_reason(api: CudaPython) -> str | None:
    """Why conditional WHILE nodes cannot be used here, or None when they can."""
    need = "%d.%d" % MIN_VERSION
    if api.version < MIN_VERSION:
        return f"cuda-python {api.version[0]}.{api.version[1]} < {need} has no conditional nodes: {INSTALL_HINT}"
    (version,) = check(api.driver.cuDriverGetVersion())
    driver = (version // 1000, version % 1000 // 10)
    if driver < MIN_VERSION:
        return f"CUDA driver {driver[0]}.{driver[1]} < {need} has no conditional nodes"
    if api.version[0] > driver[0]:  # CUDA 13 bindings on a 12.x driver: every runtime call fails
        return (f"cuda-python {api.version[0]}.{api.version[1]} needs a CUDA {api.version[0]} driver, found "
                f"{driver[0]}.{driver[1]}: pip install 'cuda-python>={need},<{driver[0] + 1}'")
    runtime = torch.version.cuda
    if runtime is None or _major_minor(runtime) < MIN_VERSION:
        return f"torch's CUDA runtime {runtime} < {need} cannot instantiate conditional nodes"
    return None


def _nvrtc(api: CudaPython, options: list[bytes], cubin: bool) -> bytes:
    """The kernel compiled by NVRTC with `options`: a cubin, or PTX (NUL-terminated)."""
    nvrtc = api.nvrtc
    (prog,) = check(nvrtc.nvrtcCreateProgram(_KERNEL_SOURCE.encode(), b"while_condition.cu", 0, [], []))
    try:
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
        if int(status) != 0:
            (size,) = check(nvrtc.nvrtcGetProgramLogSize(prog))
            log = b" " * size
            check(nvrtc.nvrtcGetProgramLog(prog, log))
            raise CudaPythonError(f"NVRTC could not compile the while-condition kernel: {log.decode(errors='replace')}")
        get_size, get = (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN) if cubin else (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX)
        (size,) = check(get_size(prog))
        image = b" " * size
        check(get(prog, image))
        return image
    finally:
        check(nvrtc.nvrtcDestroyProgram(prog))


def _compile_kernel(api: CudaPython, device: torch.device) -> tuple[Any, Any]:
    """NVRTC -> loaded module; returns (module, function). Machine code for the GPU at hand
    first: PTX from torch's newer NVRTC would not load on an older driver (minor-version
    compatibility covers machine code, not PTX JIT). An NVRTC that does not know the GPU
    (newer than it) gives PTX for its default architecture, which the driver compiles."""
    major, minor = torch.cuda.get_device_capability(device)
    try:
        return _load(api, _nvrtc(api, [f"--gpu-architecture=sm_{major}{minor}".encode()], cubin=True))
    except CudaPythonError:
        return _load(api, _nvrtc(api, [], cubin=False))


def _load(api: CudaPython, image: bytes) -> tuple[Any, Any]:
    buffer = np.frombuffer(image, dtype=np.uint8)  # a stable address for the driver call
    (module,) = check(api.driver.cuModuleLoadData(buffer.ctypes.data))
    (function,) = check(api.driver.cuModuleGetFunction(module, _KERNEL_NAME))
    return module, function


def report_body_failure(error: BaseException) -> None:
    """Say why a while body's capture failed, on stderr, before any capture is ended.

    When a conditional body's capture is invalidated (a call not allowed during capture), the
    CUDA driver frees the body graph its node still owns, and ending the enclosing capture then
    segfaults inside libcuda (NVIDIA/cuda-python#2918, NVBUG 6805256; either order of ending).
    torch ends it as the exception unwinds through `torch.cuda.graph`, so the process can die
    before the exception is ever printed: this line is then the only trace of the cause."""
    sys.stderr.write(f"transcribe: capturing a CUDA-graph while-loop body failed: {error!r}; ending the enclosing "
                     "capture may now crash the process inside the CUDA driver (NVIDIA/cuda-python#2918): "
                     "use --decoder-mode unrolled\n")
    sys.stderr.flush()


class WhileLoops:
    """Adds conditional WHILE nodes to the graph being captured on the current stream. `mode`:
    the bodies' capture mode (torch's capture_error_mode names; the enclosing capture's)."""

    def __init__(self, api: CudaPython, device: torch.device, mode: str = "thread_local"):
        self.api, self.device = api, device
        modes = api.runtime.cudaStreamCaptureMode
        self._mode = {"global": modes.cudaStreamCaptureModeGlobal, "thread_local": modes.cudaStreamCaptureModeThreadLocal,
                      "relaxed": modes.cudaStreamCaptureModeRelaxed}[mode]
        torch.cuda.synchronize(device)  # torch's context current before the first driver call
        self._module, self._kernel = _compile_kernel(api, device)
        # Kernel argument arrays: cuLaunchKernel reads them through raw pointers, so they are
        # kept alive for as long as this object (captures copy them at launch).
        self._args: list[np.ndarray] = []
        # The graph torch is capturing (outermost): every loop's conditional handle is created
        # in it, nested loops' too, as NeMo's label-looping decoder does.
        self._root: Any = None
        self._depth = 0

    def _set_condition(self, handle: Any, flag: torch.Tensor, stream: torch.cuda.Stream) -> None:
        flag_ptr = np.array([flag.data_ptr()], dtype=np.uint64)
        args = np.array([handle.getPtr(), flag_ptr.ctypes.data], dtype=np.uint64)  # void*[2]
        self._args += [flag_ptr, args]
        check(self.api.driver.cuLaunchKernel(self._kernel, 1, 1, 1, 1, 1, 1, 0, stream.cuda_stream,
                                             args.ctypes.data, 0))

    def _add_while_node(self, stream: torch.cuda.Stream, flag: torch.Tensor) -> tuple[Any, Any]:
        """Create handle + node after the current capture dependencies; return (handle, body)."""
        rt, drv = self.api.runtime, self.api.driver
        status, _, graph, *_ = check(rt.cudaStreamGetCaptureInfo(stream.cuda_stream))
        if status != rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusActive:
            raise CudaPythonError("a while node needs an active stream capture on the current stream")
        if self._depth == 0:
            self._root = graph
        (handle,) = check(rt.cudaGraphConditionalHandleCreate(self._root, 0, 0))
        self._set_condition(handle, flag, stream)  # decides whether the loop is entered at all
        _, _, graph, deps, *_ = check(rt.cudaStreamGetCaptureInfo(stream.cuda_stream))
        params = drv.CUgraphNodeParams()
        params.type = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = handle
        params.conditional.type = drv.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE
        params.conditional.size = 1
        (params.conditional.ctx,) = check(drv.cuCtxGetCurrent())
        # Driver API: the runtime's cudaGraphAddNode mis-handled phGraph_out in early bindings.
        edge = (None,) if self.api.edge_data else ()
        (node,) = check(drv.cuGraphAddNode(graph, deps, *edge, len(deps), params))
        flags = rt.cudaStreamUpdateCaptureDependenciesFlags.cudaStreamSetCaptureDependencies
        check(rt.cudaStreamUpdateCaptureDependencies(stream.cuda_stream, [node], *edge, 1, flags))
        return handle, params.conditional.phGraph_out[0]

    @contextlib.contextmanager
    def while_loop(self, flag: torch.Tensor) -> Iterator[None]:
        """Capture the block as the body of `while flag:`; the body must recompute `flag`."""
        if flag.dtype != torch.bool or flag.numel() != 1 or not flag.is_cuda:
            raise ValueError("the loop flag must be a one-element bool CUDA tensor")
        rt = self.api.runtime
        handle, body = self._add_while_node(torch.cuda.current_stream(self.device), flag)
        body_stream = torch.cuda.Stream(self.device)
        check(rt.cudaStreamBeginCaptureToGraph(body_stream.cuda_stream, body, None, None, 0, self._mode))
        ok = False
        self._depth += 1
        try:
            with torch.cuda.stream(body_stream):
                yield
                # A library may have swallowed the error of a call that invalidated the capture.
                status, *_ = check(rt.cudaStreamGetCaptureInfo(body_stream.cuda_stream))
                if status != rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusActive:
                    raise CudaPythonError(f"the while body's capture is no longer active ({status!r}): a call "
                                          "in the body is not allowed during stream capture")
                self._set_condition(handle, flag, body_stream)  # decides whether to run again
            ok = True
        except BaseException as e:
            report_body_failure(e)
            raise
        finally:
            self._depth -= 1
            ended = rt.cudaStreamEndCapture(body_stream.cuda_stream)
        if ok:  # an exception from the body wins over the end-capture status
            check(ended)
