"""What a compiled op or layer keeps for its backward, read from inductor's own partition, traced on a CPU.

    python tools/compiled_saved.py {ovq,kvm,vq} [--seq-len T] [--layout {auto,snapshot,versioned}]
                                   [--dtype {bf16,fp32}] [--heads H] [--dim D] [--top N]
    python tools/compiled_saved.py METHOD --layer [--qk-conv K] [same options]
    (both: [--rules {cuda,cpu}])

Training on CUDA runs an op compiled with ``torch.compile(fullgraph=True)`` through flex, and what its
forward graph hands the backward (AOTAutograd's min-cut partition, as inductor asks for it) lies in memory
from the forward to the backward: in a model, one such set per layer at the peak. This traces the op as
``profiles/gpu.toml``'s ``stages-<method>`` scenario sets it up (B = 1, the scenario's heads, head dim and
method options; inputs as the op scenarios draw them, requiring grad), lets inductor partition the joint
graph, and stops before any code is generated: nothing of the op runs, so 64k tokens take seconds. It
prints each kept tensor by the source line that made it, then the totals: the op's inputs kept, its output
kept, and what is kept beyond both (the op's own cost; causal SDPA's is its log-sum-exp, ``H T`` fp32) —
and what flex's backward reads and writes at once, its k and v and their gradients. With ``--layer`` the same
for the method's layer (any registered method: ``Method.example``, hidden ``H d``, through flex, the
scenario's method options for OVQ, KVM and VQ) on fp32 ``x [1, T, H d]`` under bf16 autocast (``--dtype
bf16``) or in fp32: its projections, q/k convolution (``--qk-conv``), rotations and output projection too.

The partition does not depend on the device, and with gradients the ops choose their state layout by rows,
not by the device (docs/design.md §5), so a CPU traces the CUDA program: the CPU's block size and routing
implementation differ, which changes a few small integer tensors. Where CUDA's rules and the CPU's differ
otherwise, the trace follows CUDA's (``--rules cuda``, the default; ``cpu``: the CPU's): bf16 state sums
accumulate in fp32 (CUDA's adds round in bf16), and a layer's bf16 autocast runs in fp32 the ops CUDA's
autocast runs so, ``layer_norm``, ``sum``, ``exp`` and more (``tools/cuda_rules.py``), where the CPU's keeps
their input's dtype. torch has no CPU backward for flex; for this trace alone the tool lets the op and
torch's ``flex_attention`` take the CPU program with gradients, in its own process (importing it patches
nothing: :func:`main` does). What it cannot tell: the forward's and backward's transient memory (a device's
peak: ``op-ovq`` of ``profiles/gpu.toml``).
"""
from __future__ import annotations

import argparse
import collections
import operator
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.cuda_rules import follow_cuda_rules  # noqa: E402

MB = 2**20


class _Partitioned(Exception):
    """Raised with the partitioned forward graph once inductor hands it over: nothing is compiled after it."""

    def __init__(self, graph, saved: slice):
        super().__init__("partitioned")
        self.graph, self.saved = graph, saved


def _let_cpu_flex_trace_a_backward() -> None:
    """The op refuses flex with gradients where flex has no backward, and so does torch's ``flex_attention``;
    this trace never runs the backward, so let both through."""
    import torch.nn.attention.flex_attention as flex

    import ovqflex.attention

    ovqflex.attention.flex_trains_on = lambda device: True
    flex._validate_device = lambda *tensors: None


def _partition_backend(gm, example_inputs):
    """A ``torch.compile`` backend: inductor's own partition of the joint graph, stopped at the forward."""
    from torch._guards import TracingContext
    from torch._inductor.compile_fx import compile_fx

    def stop(graph, inputs, **kwargs):
        meta = TracingContext.get().fw_metadata
        raise _Partitioned(graph, meta.tensors_saved_for_backwards_slice)

    return compile_fx(gm, example_inputs, inner_compile=stop)


def partitioned_forward(fn, *args) -> _Partitioned:
    """The partitioned forward graph of ``torch.compile(fn, fullgraph=True, dynamic=False)(*args)``."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=_partition_backend, fullgraph=True, dynamic=False)
    try:
        compiled(*args)
    except Exception as e:  # dynamo wraps what a backend raises
        cause = e
        while cause is not None and not isinstance(cause, _Partitioned):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        return cause
    raise RuntimeError("the compiled function ran without its forward graph being partitioned")


def _source_line(node) -> str:
    """The project's innermost source line that made ``node`` (else the innermost line at all)."""
    frames = [line.strip() for line in node.meta.get("stack_trace", "").splitlines() if line.strip()]
    places = [f for f in frames if f.startswith("File ")]
    ours = [f for f in places if str(ROOT) in f]
    place = (ours or places or ["(no trace)"])[-1]
    return place.replace(f'File "{ROOT}/', "").replace('", line ', ":").split(", in ")[0]


def _is_view(node) -> bool:
    """A view op, or one item of a view op's list (``unbind``, ``split``)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return _is_view(node.args[0])
    return bool(getattr(node.target, "is_view", False))


def _base(node):
    """The node whose memory ``node`` views (itself where it is no view): a saved view keeps all of it."""
    while _is_view(node):
        node = node.args[0]
    return node


def kept(part: _Partitioned) -> list[dict]:
    """One row per distinct memory the forward graph saves for the backward (a saved view counts as the tensor
    it views): ``node``, ``mb``, ``shape``, ``dtype``, ``kind`` (``"input"``: a graph input; ``"output"``:
    also the op's output; ``"kept"``), ``line``."""
    outputs = next(n for n in part.graph.graph.nodes if n.op == "output").args[0]
    user = {_base(n) for n in outputs[:part.saved.start] if n is not None}
    rows, seen = [], set()
    for saved in outputs[part.saved]:
        node = _base(saved)
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or node in seen:
            continue
        seen.add(node)
        kind = "input" if node.op == "placeholder" else "output" if node in user else "kept"
        rows.append(dict(node=node, mb=val.numel() * val.element_size() / MB, shape=tuple(val.shape),
                         dtype=str(val.dtype).removeprefix("torch."), kind=kind, line=_source_line(node)))
    return rows


def flex_kv_mb(part: _Partitioned) -> float:
    """MB of the k and v that the forward graph's flex calls take (what flex's backward reads)."""
    total = 0.0
    for node in part.graph.graph.nodes:
        if node.op == "call_function" and "flex_attention" in str(node.target):
            total += sum(a.meta["val"].numel() * a.meta["val"].element_size() for a in node.args[1:3]) / MB
    return total


def _op_case(args, scenario) -> tuple:
    """``(function, its input, H, D)``: the op on the scenario's inputs, compiled for training through flex."""
    from ovqflex.bench.scenarios.op import DTYPES, op_inputs

    _, op, extra, options = scenario.method_parts()
    H, D = args.heads or scenario.heads, args.dim or scenario.head_dim
    inputs = {n: x.requires_grad_(x.is_floating_point())
              for n, x in op_inputs(args.seq_len, H, D, extra, torch.device("cpu"), DTYPES[args.dtype]).items()}
    return (lambda t: op(**t, backend="flex", state_layout=args.layout, **options)), inputs, H, D


def _layer_case(args, scenario) -> tuple:
    """``(function, its input, H, D)``: the method's layer (``Method.example``: hidden ``H d``, flex, the scenario's
    method options for OVQ, KVM and VQ) on fp32 ``x [1, T, H d]``, under bf16 autocast for ``--dtype bf16``."""
    from ovqflex.methods import get_method

    method = get_method(args.method)
    H = args.heads or (scenario.heads if scenario else 8)
    D = args.dim or (scenario.head_dim if scenario else 64)
    options = dict(scenario.method_parts()[3], state_layout=args.layout) if scenario else {}
    names = method.option_names()
    options.update({k: v for k, v in dict(backend="flex", qk_conv=args.qk_conv).items() if k in names})
    layer = method.example(H, D, options)
    x = torch.randn(1, args.seq_len, H * D, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def run(x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            y = layer(x)
        return y[0] if isinstance(y, tuple) else y

    return run, x, H, D


def _at_least(minimum: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text}")
        return value
    return parse


_positive = _at_least(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("method", help="ovq, kvm or vq; with --layer, any method (ovqflex info lists them)")
    p.add_argument("--layer", action="store_true", help="the method's layer, not its op")
    p.add_argument("--seq-len", type=_positive, default=65536)
    p.add_argument("--layout", choices=["auto", "snapshot", "versioned"], default="auto")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                   help="the op's inputs; a layer's autocast (its parameters and x stay fp32)")
    p.add_argument("--heads", type=_positive, default=None, help="default: the scenario's (8)")
    p.add_argument("--dim", type=_positive, default=None, help="head dim; default: the scenario's (64)")
    p.add_argument("--qk-conv", type=_at_least(0), default=0, help="a layer's q/k convolution width (0: none)")
    p.add_argument("--top", type=_positive, default=12, help="source lines listed, largest first")
    p.add_argument("--rules", choices=["cuda", "cpu"], default="cuda",
                   help="whose device rules the trace follows where CUDA's and the CPU's differ (bf16 state sums, "
                        "autocast): default cuda, what trains on a GPU")
    args = p.parse_args(argv)

    from ovqflex.bench.runner import load_profile
    from ovqflex.methods import method_names

    if args.method not in method_names():
        p.error(f"method must be one of {method_names()}, got {args.method!r}")
    scenarios = {sc.name: sc for sc in load_profile(ROOT / "profiles" / "gpu.toml")["scenario"]}
    scenario = scenarios.get(f"stages-{args.method}")
    if scenario is None and not args.layer:
        p.error(f"the op of {args.method!r} has no stages scenario in profiles/gpu.toml: ovq, kvm or vq "
                f"(or --layer)")
    _let_cpu_flex_trace_a_backward()
    if args.rules == "cuda":
        follow_cuda_rules()
    fn, inputs, H, D = (_layer_case if args.layer else _op_case)(args, scenario)
    part = partitioned_forward(fn, inputs)
    rows = kept(part)

    by_line = collections.defaultdict(lambda: [0.0, 0, set()])
    for r in rows:
        if r["kind"] == "kept":
            entry = by_line[r["line"]]
            entry[0] += r["mb"]
            entry[1] += 1
            entry[2].add(f"{list(r['shape'])} {r['dtype']}")
    what = "layer" if args.layer else "op"
    print(f"{args.method} {what} T={args.seq_len} H={H} d={D} {args.dtype} {args.rules} rules layout={args.layout}: "
          f"the compiled {what}'s forward keeps {len(rows)} tensors for its backward")
    print(f"{'MB':>9}  {'n':>3}  source line: shapes")
    for line, (mb, n, shapes) in sorted(by_line.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{mb:9.1f}  {n:3d}  {line}: {', '.join(sorted(shapes))}")
    total = {kind: sum(r["mb"] for r in rows if r["kind"] == kind) for kind in ("input", "output", "kept")}
    sdpa = H * args.seq_len * 4 / MB
    print(f"inputs kept {total['input']:.1f} MB, output kept {total['output']:.1f} MB, kept beyond both "
          f"{total['kept']:.1f} MB (causal SDPA: {sdpa:.1f} MB, its log-sum-exp)")
    kv = flex_kv_mb(part)
    if kv:
        print(f"flex's backward reads its k, v ({kv:.1f} MB) and writes their gradients (as many MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
