"""Compiling fixed-shape code (docs/design.md §3 backends, §4.2-4.3 static-shape routing), and what
OVQ's and KVM's static routing share: ``ROUTING_IMPLS`` and :func:`resolve_routing`, :func:`stable_rank`,
:func:`chunk_bounds`, chunk-major buffers (:func:`chunks_first`), :func:`static_rows` and the
per-process router cache (:func:`static_router`); and what keeps a length symbolic under dynamic shapes
(:func:`is_symbolic`, :func:`bucket_rows`, :func:`plain_int`, :func:`plain_options`, :func:`size_min`,
:func:`pad_to`, :func:`narrow_rows`; docs/design.md §3.5).

``torch.compile(..., dynamic=False)`` makes one graph per input shape, and dynamo allows a
function only ``recompile_limit`` graphs (8 by default). Past it, a ``fullgraph=True`` function
raises ``FailOnRecompileLimitHit`` and any other falls back to eager, unfused code without an
error. The project's compiled code meets a new shape for every context length (a static
routing step's state buffer grows with it; a flex program's block count does), so an
evaluation over several lengths would pass 8. The limit is raised process-wide to
:data:`RECOMPILE_LIMIT` the first time such code compiles or a layer is made
(:func:`prepare_compile`, which also mends a CPU code-generation bug of inductor's threaded
scatter-add, :func:`patch_inductor_cpu_atomic_add`). :func:`graphed` replays a fixed-buffer step
from one CUDA graph (the static decode's ``"graph"`` path).
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import operator
import sys
from collections import OrderedDict
from typing import Callable, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import has_static_value

#: Routing implementations of OVQ and KVM: ``"auto"`` (``"static"`` on CUDA, ``"loop"`` elsewhere), the
#: chunk loop, or the compiled static-shape step (on CUDA the whole run replayed from one CUDA graph).
ROUTING_IMPLS = ("auto", "loop", "static")

#: dynamo's process-wide recompile limit once the project's compiled code has run
RECOMPILE_LIMIT = 64


@torch.library.custom_op("ovqflex::realize", mutates_args=())
def realize(x: Tensor) -> Tensor:
    """Identity that inductor keeps as an extern kernel, so its output is a real buffer in x's dtype
    (a graph's pointwise producer of x cannot fuse into its consumers). Eager: a copy of x."""
    return x.clone()


@realize.register_fake
def _(x):
    return torch.empty_like(x)


realize.register_autograd(lambda ctx, grad: grad)  # identity: a captured bias keeps its gradient


def eager_kernels(op: str, dtype: torch.dtype | None = None):
    """Decorator: ``fn(x, *rest) -> Tensor`` of x's shape (no grad) registered as the custom op ``op``,
    its result returned contiguous in ``dtype`` (None: x's), with the fake that says so.

    Compiled code calls it as one opaque call that runs ATen's kernels on real input buffers, as eager
    code does, so the result has the eager bits. Fused by inductor instead, a norm or layer norm
    reduces in another order (on the CPU a compiled ``F.normalize`` moved 21% of OVQ's unit keys by up
    to 6e-8, a compiled ``LN_s`` 34% of KVM's memory keys by up to 2e-6), and a fused producer of a bf16
    x may skip its rounding (pytorch/pytorch#179561): enough to flip a near-tie route. Routing reads
    such values (keys, dictionary rows), so compiled code routes as the eager op and the loops do."""
    def wrap(fn):
        @functools.wraps(fn)
        def contiguous(x: Tensor, *rest) -> Tensor:  # the fake's layout, whatever x's strides
            return fn(x, *rest).contiguous()

        custom = torch.library.custom_op(op, mutates_args=())(contiguous)
        custom.register_fake(lambda x, *rest: x.new_empty(x.shape, dtype=dtype or x.dtype))
        return custom
    return wrap


@functools.lru_cache(maxsize=512)
def device_constant(values: tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``torch.tensor(values, dtype, device)`` made once per values, dtype and device, for eager code to
    read and never write: onto a GPU ``torch.tensor`` copies from the host and synchronizes the stream,
    which in the middle of an op's launches stalls the host until everything queued before has run.
    Made outside ``inference_mode``, so a tensor first made while generating also serves training."""
    with torch.inference_mode(False):
        return torch.tensor(values, dtype=dtype, device=device)


def raise_recompile_limit() -> None:
    """Raise dynamo's ``recompile_limit`` to at least :data:`RECOMPILE_LIMIT` (never lower it)."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)


_INDUCTOR_PATCHED = False


def patch_inductor_cpu_atomic_add() -> bool:
    """Mend a CPU code-generation bug of torch's inductor (seen in torch 2.13; pytorch/pytorch#191837):
    in a 2-D tiled (transposing) CPU kernel, a scatter-add run by several threads (``atomic_add``: an
    embedding's or an ``index_add``'s backward fused with pointwise work whose buffers are laid out
    another way, e.g. a LongVQ block's EMA gradient in ``[D, B*T]`` meeting the token embedding's)
    maps its index into the tile twice, so it adds at wrong rows and past the end of the buffer:
    heap corruption (``double free or corruption``) or silently wrong gradients.

    ``CppTile2DKernel.store`` maps the index and hands it to the vector kernel's store, whose threaded
    ``atomic_add`` path re-derives it through the tile's ``index_expr``, which maps it again. The
    mended store hands that path the unmapped index (mapped once, there); every other store is
    unchanged, and a torch whose store maps once already computes the same. Applied once per process
    (:func:`prepare_compile`); returns whether it is in place (False when this torch's inductor lacks
    the parts it mends: nothing is changed then)."""
    global _INDUCTOR_PATCHED
    if _INDUCTOR_PATCHED:
        return True
    try:
        from torch._inductor import config as inductor_config
        from torch._inductor.codegen.cpp import CppTile2DKernel, CppVecKernel
    except ImportError:
        return False
    store = CppTile2DKernel.__dict__.get("store")
    if store is None or not all(hasattr(CppTile2DKernel, a) for a in ("need_vec_transpose", "rename_indexing")):
        return False

    def mended_store(self, name, index, value, mode=None):
        threaded = inductor_config.cpp.dynamic_threads or getattr(self, "num_threads", 1) != 1
        if mode == "atomic_add" and threaded and not self.need_vec_transpose(self.rename_indexing(index)):
            return CppVecKernel.store(self, name, index, value, mode)  # maps the index once, in index_expr
        return store(self, name, index, value, mode)

    CppTile2DKernel.store = mended_store
    if inductor_config.post_grad_custom_post_pass is None:
        # kernels compiled and cached on disk before the mend keep the bug: a no-op pass whose uuid
        # enters inductor's cache key sends this process's graphs to fresh entries
        from torch._inductor.custom_graph_pass import CustomGraphPass

        class MendedCacheKey(CustomGraphPass):
            def __call__(self, graph) -> None:
                return None

            def uuid(self) -> str:
                return "ovqflex: CppTile2DKernel atomic_add index mapped once (pytorch/pytorch#191837)"

        inductor_config.post_grad_custom_post_pass = MendedCacheKey()
    _INDUCTOR_PATCHED = True
    return True


_FLEX_NAMES_MENDED = False


def patch_inductor_cpu_flex_split_names() -> bool:
    """Mend a CPU code-generation bug of torch's inductor flex kernel (seen in torch 2.13): the score and
    mask code of a CPU flex kernel is generated with its query and kv split sizes as size arguments named
    like the others (``ks0``, ``ks1``, ...), and those two names are then replaced by the kernel's own
    variables (``cur_qSplitSize``, ``cur_kvSplitSize``) with a plain text replace, which also rewrites any
    longer name that starts with them (``ks17`` becomes ``cur_kvSplitSize7``, undeclared). With a
    symbolic length (the second length a compiled layer meets) the score and mask code reads a dozen
    sizes, and the C++ kernel failed to build: every state layer (OVQ, KVM, VQ, LongVQ) compiled under
    ``no_grad`` with ``flex`` on the CPU.

    The mended code generation names the two split sizes by those variables from the start (the template's
    ``KernelGroup``, made inside its ``modification``, gets them as its first size arguments), so the
    replace changes nothing. A kernel that built before is generated unchanged. Applied once per process
    with :func:`patch_inductor_cpu_atomic_add` (:func:`prepare_compile`); returns whether it is in place
    (False when this torch's inductor lacks the parts it mends: nothing is changed then)."""
    global _FLEX_NAMES_MENDED
    if _FLEX_NAMES_MENDED:
        return True
    template = sys.modules.get("torch._inductor.codegen.cpp_flex_attention_template")
    modification = getattr(template, "CppFlexAttentionTemplate", object).__dict__.get("modification")
    if modification is None:
        return False

    def mended_modification(self, *args, **kwargs):
        from torch._inductor.codegen import cpp  # (loaded by then: the template imports it)

        block_vars = getattr(self, "block_vars", None)
        group = getattr(cpp, "KernelGroup", None)
        if group is None or block_vars is None or len(block_vars) != 2:
            return modification(self, *args, **kwargs)

        class NamedSplits(group):
            def __init__(self_):
                super().__init__()
                self_.args.sizevars[block_vars[0]] = "cur_qSplitSize"
                self_.args.sizevars[block_vars[1]] = "cur_kvSplitSize"

        cpp.KernelGroup = NamedSplits  # what `modification` imports from the module when it runs
        try:
            return modification(self, *args, **kwargs)
        finally:
            cpp.KernelGroup = group

    template.CppFlexAttentionTemplate.modification = mended_modification
    _FLEX_NAMES_MENDED = True
    return True


#: inductor's CPU modules the project mends, each with its mend: mended as soon as the module has run
#: (importing inductor's CPU code generator takes ~1.5 s, which a process that never compiles for the CPU
#: does not pay)
_MENDS = {"torch._inductor.codegen.cpp": patch_inductor_cpu_atomic_add,
          "torch._inductor.codegen.cpp_flex_attention_template": patch_inductor_cpu_flex_split_names}


class _MendOnImport(importlib.abc.MetaPathFinder):
    """Finds one of :data:`_MENDS`' modules for the import system and mends it as soon as it has run. One
    entry of ``sys.meta_path`` per module, removed once it has found it."""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            _MENDS[name]()

        spec.loader.exec_module = exec_module
        return spec


def prepare_compile() -> None:
    """What the project's compiled code needs from torch before it compiles: dynamo's recompile limit
    raised (:func:`raise_recompile_limit`) and inductor's CPU code generator mended
    (:func:`patch_inductor_cpu_atomic_add`, :func:`patch_inductor_cpu_flex_split_names`): each at once if
    its module is loaded, else when it is first imported (:class:`_MendOnImport`). A mend is a change to
    torch's code, so nothing undoes it: a ``torch._dynamo.reset()`` (which drops dynamo's compile
    callbacks) between making a layer and compiling it leaves it in place. Layers call this when made,
    the fixed-shape helpers when they first compile; cheap after the first call."""
    raise_recompile_limit()
    if _INDUCTOR_PATCHED and _FLEX_NAMES_MENDED:
        return
    waiting = {f.name for f in sys.meta_path if isinstance(f, _MendOnImport)}
    for name, mend in _MENDS.items():
        if name in sys.modules:
            mend()
        elif name not in waiting:
            sys.meta_path.insert(0, _MendOnImport(name))


def compile_fixed_shapes(fn: Callable) -> Callable:
    """``fn`` compiled with ``fullgraph=True, dynamic=False``: one graph per input shape (and per
    value of its non-tensor arguments), at most :data:`RECOMPILE_LIMIT` of them. Compiles on the
    first call, which raises the limit; later calls cost one check on the host."""
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            prepare_compile()
            compiled = torch.compile(fn, fullgraph=True, dynamic=False)
        return compiled(*args, **kwargs)

    return call


def replay_or_run(graph: "torch.cuda.CUDAGraph | None", run: Callable[[], None]) -> None:
    """Replay ``graph`` (the capture of ``run``), or call ``run`` when there is none or the stream is
    being captured already (the caller's own graph, e.g. ``torch.compile(mode="reduce-overhead")``:
    ``run``'s launches then join that graph)."""
    if graph is None or torch.cuda.is_current_stream_capturing():
        run()
    else:
        graph.replay()


def capture_cuda_graph(run: Callable[[], None], device: torch.device) -> "torch.cuda.CUDAGraph":
    """``run`` (fixed buffers, no host sync) captured in one CUDA graph on ``device``: warmed up
    once on a side stream first (which compiles what it compiles, outside the capture). Replay
    the graph to run it again. ``ValueError`` naming the device unless it is a CUDA device."""
    if device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs a CUDA device, got {device}")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: CUDA calls of other threads (a data loader's pinned copies) do not void this capture
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        run()
    return graph


def graphed(step: Callable[..., Tensor], device: torch.device) -> Callable[..., Tensor]:
    """``step(*args) -> Tensor`` (fixed shapes, no host sync, its other buffers written in place)
    replayed from one CUDA graph on ``device``: ``fn(*args)`` with the same argument shapes.

    The first call runs ``step`` once for real (the warm-up of :func:`capture_cuda_graph`, which
    compiles a compiled ``step``) on copies of its tensor arguments, captures it and returns the
    warm-up's result. Each later call copies its tensor arguments into those copies and replays the
    graph; its other arguments (e.g. a list of caches, whose buffers the graph reads and writes)
    must be the very objects of the first call (``ValueError`` otherwise). The tensor returned by a
    replay is the graph's output buffer: the next call overwrites it. Whatever changes the buffers
    between calls must write them in place (a new tensor in their place is not seen by the graph)."""
    captured: dict = {}

    def run(*args) -> Tensor:
        if not captured:
            inputs = tuple(a.clone() if isinstance(a, Tensor) else a for a in args)
            outputs = []
            graph = capture_cuda_graph(lambda: outputs.append(step(*inputs)), device)
            captured.update(graph=graph, inputs=inputs, output=outputs[1])
            return outputs[0]  # the capture records without running: the warm-up ran the step
        if len(args) != len(captured["inputs"]):
            raise ValueError(f"a graphed step takes the {len(captured['inputs'])} arguments it was captured with, "
                             f"got {len(args)}")
        for i, (kept, a) in enumerate(zip(captured["inputs"], args)):
            if isinstance(kept, Tensor):
                if not isinstance(a, Tensor) or a.shape != kept.shape or a.dtype != kept.dtype:
                    raise ValueError(f"a graphed step's argument {i} must be a {kept.dtype} tensor of shape "
                                     f"{tuple(kept.shape)} (as captured), got {a!r:.80}")
                kept.copy_(a)
            elif a is not kept:
                raise ValueError(f"a graphed step's argument {i} must be the object it was captured with "
                                 f"(the graph reads and writes its buffers), got another {type(a).__name__}")
        captured["graph"].replay()
        return captured["output"]

    return run


def row_index(rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(b, h, rows)``: the index of each token's row ``rows [B, H, L]`` in a ``[B, H, R, ...]`` buffer, for
    ``index_put_`` and indexing (what a static step's fused absorb writes through)."""
    B, H = rows.shape[:2]
    return (torch.arange(B, device=rows.device)[:, None, None], torch.arange(H, device=rows.device)[None, :, None],
            rows)


def stable_rank(key: Tensor) -> Tensor:
    """Rank ``[..., L]`` int64 of each entry of ``key [..., L]`` in its stable ascending sort along
    the last dim: ``rank < n`` marks the loop's ``sort(stable).indices[..., :n]`` with ``n`` a device value.

    Counted, not sorted: an entry's rank is the number of entries before it in that order (smaller,
    or equal and at a lower index; NaN after every number, as the sort puts it). One ``[..., L, L]``
    comparison that a compiled step fuses into a single reduction, where a sort and the scatter that
    inverts its permutation are two more launches per chunk step."""
    L = key.shape[-1]
    idx = torch.arange(L, device=key.device)
    earlier = idx[None, :] < idx[:, None]                            # [L (i), L (j)]: j before i
    ki, kj = key.unsqueeze(-1), key.unsqueeze(-2)                    # [..., L, 1], [..., 1, L]
    nan_i, nan_j = ki.isnan(), kj.isnan()
    before = torch.where(nan_i, ~nan_j | earlier, (kj < ki) | ((kj == ki) & earlier))
    return before.sum(-1)


def chunk_bounds(sizes: list[int], n_chunks: int, device) -> Tensor:
    """``[n_chunks, 2]`` int64 ``(N_c, N_{c+1})`` per chunk on ``device`` (``sizes``: at least
    ``n_chunks + 1`` entries): one 16-byte row each, so every step reads an aligned input."""
    return torch.tensor([sizes[c:c + 2] for c in range(n_chunks)], dtype=torch.long, device=device).view(n_chunks, 2)


def resolve_routing(impl: str, device: torch.device) -> str:
    """The routing implementation that runs on ``device``: ``"loop"`` or ``"static"``.

    ``"auto"`` is ``"static"`` on CUDA, where the loop's chunk steps change shape and each is a handful
    of tiny launches (launch-bound: 512 chunks at 64k tokens), and ``"loop"`` elsewhere, where a
    static step, reading every row of the padded dictionary, is no faster. ``ValueError`` naming
    ``impl`` unless it is one of :data:`ROUTING_IMPLS`."""
    if impl not in ROUTING_IMPLS:
        raise ValueError(f"impl must be one of {list(ROUTING_IMPLS)}, got {impl!r}")
    if impl == "auto":
        return "static" if torch.device(device).type == "cuda" else "loop"
    return impl


def chunks_first(x: Tensor, n_chunks: int, chunk_size: int) -> Tensor:
    """The first ``n_chunks`` chunks of ``x [B, H, T, *]`` as a chunk-major view ``[n_chunks, B, H, L, *]``:
    what a static router copies its input into, so chunk ``c`` (``buffer[c]``) has the same shape and
    strides whatever ``T`` is, and one compiled step serves every length."""
    x = x[:, :, :n_chunks * chunk_size].unflatten(2, (n_chunks, chunk_size))
    return x.movedim(2, 0)


def tokens_from_chunks(xc: Tensor, T: int, fill) -> Tensor:
    """``[B, H, T, *]`` from chunk-major ``xc [n, B, H, L, *]`` (``n L <= T``): its tokens first, then
    ``fill`` (a new tensor)."""
    n, B, H, L = xc.shape[:4]
    out = xc.new_full((B, H, T, *xc.shape[4:]), fill)
    out[:, :, :n * L] = xc.movedim(0, 2).flatten(2, 3)
    return out


def static_rows(n: int) -> int:
    """Rows of a static routing buffer that holds ``n`` (its live rows and the spare): ``n`` rounded up
    to a power of two. The padding rows are dead like the spare (masked, never read live); the
    rounding lets every length whose dictionary falls in one bucket share one compiled step (an OVQ
    dictionary of ``N = 2048`` rows: every length from 2k tokens on)."""
    return 1 << max(n - 1, 0).bit_length()


def is_symbolic(n: int) -> bool:
    """Whether ``n`` is a symbolic int: a size derived from a dynamic dimension under ``torch.compile``
    (dynamo shows it to traced code as a plain ``int``) whose value the graph's guards have not yet pinned
    to one. Its range has more than one value (guards that bound it, e.g. a bucket's ``33 <= n <= 64``,
    leave it symbolic); a plain int's has one. The check adds no guard and works in eager code too."""
    return not has_static_value(n)


def plain_int(x: int) -> int:
    """``x`` as a plain int. Under ``torch.compile(dynamic=True)`` an int that reaches traced code as an
    argument (an option of a dataclass passed in) is symbolic, which Python code that plans from it (a
    loop, a constant function) cannot use; this specializes it to its value, with a guard on that value,
    so another value compiles anew. A plain int is returned as is."""
    return operator.index(x)  # (dynamo specializes a symbolic int it indexes with; int() would keep it symbolic)


def plain_float(x: float) -> float:
    """``x`` (a float or an int) as a plain float; :func:`plain_int`'s counterpart (``dynamic=True`` makes a
    float attribute of a module symbolic too). Exact: the ratio of two ints."""
    numerator, denominator = x.as_integer_ratio()  # (dynamo specializes a symbolic float here; float() does not)
    return numerator / denominator


_Options = TypeVar("_Options")


def plain_options(options: _Options) -> _Options:
    """``options`` (a dataclass instance: an op's options, dataclasses in it included) with every symbolic
    number specialized to its value (:func:`plain_int`, :func:`plain_float`), each under a guard.

    ``torch.compile(dynamic=True)`` makes symbolic the ints and floats of keyword options a compiled
    function closes over (``lambda *x: op(*x, **kw)``; seen in torch 2.13, where a module's attributes and
    an options object passed in stay plain). An option is the method's structure, not a size that varies
    from call to call: a graph generic over a chunk size, a dictionary cap or a block size costs compile
    time (every shape built on it is a formula of it) and gains nothing, since another value is another
    program. An op therefore takes its options through this (``recurrences.checks.options_of``), and a graph
    serves one set of options; another set compiles a graph of its own. Options with no symbolic number are
    returned as they are (eager code, where nothing is symbolic: at once)."""
    if not torch.compiler.is_compiling():
        return options
    fields = options.__dataclass_fields__  # (dataclasses.fields does not trace under torch.compile)
    plain = {}
    for name in fields:
        value = getattr(options, name)
        if value is None:  # (torch 2.11's dynamo cannot trace hasattr on NoneType: a graph break)
            continue
        if hasattr(type(value), "__dataclass_fields__"):
            new = plain_options(value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and is_symbolic(value):
            new = plain_int(value) if isinstance(value, int) else plain_float(value)
        else:
            continue
        if new is not value:
            plain[name] = new
    if not plain:
        return options
    return type(options)(**{name: plain.get(name, getattr(options, name)) for name, f in fields.items() if f.init})


def size_min(a: int, b: int) -> int:
    """``min(a, b)`` of two sizes, either of which may be symbolic: decided by a comparison, so under
    ``torch.compile`` with a symbolic length the result is ``a`` or ``b`` itself, under a guard on which one
    is smaller (none where that is statically known). Python's ``min`` would give the expression
    ``Min(a, b)``, which every shape derived from it then carries, and sympy's reasoning on such nested
    expressions dominated a symbolic trace's time (docs/design.md §3.5). Plain ints: ``min``."""
    return a if a <= b else b


def size_max(a: int, b: int) -> int:
    """``max(a, b)`` of two sizes, decided by a comparison like :func:`size_min`."""
    return a if a >= b else b


def pad_to(x: Tensor, dim: int, n: int, value: float = 0) -> Tensor:
    """``x`` padded with ``value`` along ``dim`` up to length ``n`` (at least its own): ``x`` itself when
    it is ``n`` long already. A symbolic length always pads, by a symbolic amount that may be 0, rather
    than guard on whether it fills ``n`` (a recompile for the lengths that do); see :func:`_pad_symbolic`.

    ``value``'s default is the int 0, not 0.0: under ``torch.compile(dynamic=True)`` torch 2.13's dynamo
    reads a float default (from ``__defaults__``, which may change) as a symbolic float input; one used as a
    plain number rather than computed with (a padding value is) makes dynamo trace the whole frame again
    (``TensorifyScalarRestartAnalysis``), about 40% of the OVQ op's first compile. An int default stays plain
    (docs/design.md §3.5)."""
    length = x.shape[dim]
    if not is_symbolic(length):
        return x if length == n else F.pad(x, _widths(x, dim, 0, n - length), value=value)
    return _pad_symbolic(x, _widths(x, dim, 0, n - length), value)


def narrow_rows(x: Tensor, dim: int, start: int, length: int) -> Tensor:
    """``x.narrow(dim, start, length)``: a view for a plain ``length``. For a symbolic one a cropped copy
    (a negative padding, whose backward is a padding): whether a narrowed view is contiguous depends on
    the rows filling ``x`` (the real rows of a buffer padded to whole blocks: lengths that fill their
    blocks), and torch guards on that, so the graph would recompile for them."""
    if not is_symbolic(length):
        return x.narrow(dim, start, length)
    return _pad_symbolic(x, _widths(x, dim, -start, start + length - x.shape[dim]), 0.0)


def _widths(x: Tensor, dim: int, before: int, after: int) -> list[int]:
    """``F.pad``'s widths (last dim first) that pad ``dim`` of ``x`` by ``before`` and ``after``."""
    return [0, 0] * (x.dim() - 1 - dim % x.dim()) + [before, after]


def _pad_symbolic(x: Tensor, widths: list[int], value: float) -> Tensor:
    """``F.pad`` by symbolic widths that may all be 0. Eager ``constant_pad_nd`` returns a padding of 0
    with its input's strides where its meta function says contiguous, so in a graph run by eager kernels
    (``aot_eager``) a later ``view`` of the result, or of its gradient, would fail: both the input and the
    incoming gradient are made contiguous first (free where they are: in a fused graph they are)."""
    return _ContiguousGrad.apply(F.pad(x.contiguous(), widths, value=value))


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (see :func:`_pad_symbolic`)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def bucket_rows(n: int, cap: int) -> int:
    """A symbolic ``n`` rounded up to a power of two, at most ``cap`` (0 stays 0), as a plain int. Found by
    comparisons, so a graph guards the range of lengths the bucket holds, not one length; a plain ``n``
    is returned as is."""
    if not is_symbolic(n) or n == 0:
        return n
    bucket = 1
    while bucket < n and bucket < cap:
        bucket *= 2
    return min(bucket, cap)


#: Static routers kept per process, least recently used dropped first. Each holds an fp32 copy of its
#: input's keys ``[B, H, T, D]``, its dictionary and routes, and on CUDA its graph's memory pool.
STATIC_ROUTERS_KEPT = 4

_ROUTERS: OrderedDict = OrderedDict()
_Router = TypeVar("_Router")


def static_router(key: tuple, make: Callable[[], _Router]) -> _Router:
    """The static router cached under ``key`` (every argument its construction takes: input shape,
    device, chunk size, sizes, options), made by ``make()`` on a miss. Building one allocates its
    buffers and, on CUDA, warms up and captures its CUDA graph, so an op that routes every call (a
    training step, an evaluation at a few lengths) builds each once. At most
    :data:`STATIC_ROUTERS_KEPT` are kept; :func:`clear_static_routers` frees them."""
    router = _ROUTERS.pop(key, None)
    if router is None:
        router = make()
    _ROUTERS[key] = router
    while len(_ROUTERS) > STATIC_ROUTERS_KEPT:
        _ROUTERS.popitem(last=False)
    return router


def clear_static_routers() -> None:
    """Drop every cached static router (their buffers and CUDA graphs are freed once unreferenced)."""
    _ROUTERS.clear()
