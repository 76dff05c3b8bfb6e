"""The `convdsl` command line: compile, run, explain, check."""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence, TextIO

import numpy as np

from . import __version__, compiler, peak, policy, tune
from .backends.iree import CompileError
from .compiler import compile as compile_module
from .compiler import iree_config_notes, load_problems
from .frontend import ConvSyntaxError, parse_file
from .module import ArgumentError, resolve_target
from .passes import STAGE_NAMES, LoweringError, Stage, run_pipeline
from .passes.explain import describe_binaries, describe_plan
from .passes.plan import ON_CPU, KernelPlan
from .problem import MAX_SIZE, ConvProblem, ProblemError
from .progress import CompileStep
from . import reference as ref  # through the module: a patched reference (tests) is seen
from .targets import BACKENDS, Target, TargetError
from .tuning.knobs import Knobs


def _progress(enabled: bool, message: str) -> None:
    """One line per step on a terminal; quiet when piped."""
    if enabled and sys.stderr.isatty():
        print(message, file=sys.stderr, flush=True)


def _step_text(step: CompileStep) -> str:
    if step.kind == "kernel":
        return f"lowering {step.index} of {step.total}: {step.name}"
    return f"{step.name}: {step.total} kernel{'s' if step.total != 1 else ''} in one module ..."


class _StatusLine:
    """One line on stderr, rewritten in place (carriage return) as compile steps arrive and blanked when done;
    only on a terminal, so pipes and logs get nothing."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.enabled = stream.isatty()
        self.shown = 0  # characters on the line now

    def step(self, step: CompileStep) -> None:
        if not self.enabled:
            return
        try:
            columns = os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, OSError, ValueError):  # no file descriptor, or not a real terminal
            columns = 0
        columns = columns or 80  # a terminal that reports no size (0 columns)
        text = _step_text(step)[:max(columns - 1, 20)]  # a wrapped line could not be rewritten in place
        self.stream.write("\r" + text.ljust(self.shown))
        self.stream.flush()
        self.shown = len(text)

    def clear(self) -> None:
        if self.enabled and self.shown:
            self.stream.write("\r" + " " * self.shown + "\r")
            self.stream.flush()
            self.shown = 0


@contextlib.contextmanager
def _status_line() -> Iterator[_StatusLine]:
    """A status line for compile steps, blanked however the block ends (an error's message starts clean)."""
    line = _StatusLine(sys.stderr)
    try:
        yield line
    finally:
        line.clear()


def _bytes_moved(p: ConvProblem) -> int:
    size = lambda shape, dt: int(np.prod(shape)) * np.dtype(ref.NUMPY_DTYPES[dt]).itemsize  # noqa: E731
    moved = sum(size(s, d) for s, d in zip(p.arg_shapes, p.arg_dtypes))
    return moved + size(p.result_shape, p.result_dtype)


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (also through links, or one that does not exist yet)."""
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
        return a.resolve() == b.resolve()
    except OSError:
        return False


def _check_output(out: Path, source: Path) -> None:
    """Refuse, before compiling, an OUT.vmfb whose writing would destroy the source or its own manifest."""
    if out.is_dir():
        raise ArgumentError(f"-o {out}: is a directory, expected OUT.vmfb")
    manifest = out.with_suffix(".json")
    if manifest == out:
        raise ArgumentError(f"-o {out}: the module and its manifest would both be written to {out}; expected "
                            "OUT.vmfb (the manifest goes to OUT.json)")
    for written, what in ((out, "the module"), (manifest, "the manifest")):
        if _same_file(written, source):
            raise ArgumentError(f"-o {out}: {what} would overwrite the source {source}; expected another OUT.vmfb")


# A zero-padded operand past this many bytes is worth a warning from `check` (and names the cost in `run`'s errors)
HUGE_PADDED_BYTES = 2**30
# ... where the padding (or the dilation's reach) makes it this many times the data it pads
PADDING_DOMINATES = 4


def _padded_operand(p: ConvProblem) -> tuple[str, int, int, str]:
    """(operand name, bytes, bytes unpadded, how its size comes about) of the zero-padded activation a kernel
    reads: x with its padding (forward, grad_weight), or dy spread over every position the flipped filter reads
    (grad_input, transposed).  A lowering that pads explicitly holds it as workspace."""
    itemsize = np.dtype(ref.NUMPY_DTYPES[p.dtype]).itemsize
    if p.op in ("forward", "grad_weight"):
        name, channels = "x", p.in_channels
        spatial = [i + lo + hi for i, lo, hi in zip(p.input, p.pad_lo, p.pad_hi)]
        how = f"input {list(p.input)} with padding {list(p.pad_lo)}/{list(p.pad_hi)}"
    else:
        name, channels = ("dy" if p.op == "grad_input" else "x"), p.out_channels
        spatial = [i + lo + (r - 1) * d for i, lo, r, d in zip(p.input, p.pad_lo, p.filter, p.dilation)]
        how = f"input {list(p.input)}, padding {list(p.pad_lo)} and the dilated filter's reach"
    if any(d > 1 for d in p.dilation):
        how += f", dilation {list(p.dilation)}"
    per_position = p.batch * p.groups * channels * itemsize
    unpadded = math.prod(p.input if name == "x" and p.op != "transposed" else p.output)
    return name, per_position * math.prod(spatial), per_position * unpadded, \
        f"{math.prod(spatial)} positions per channel ({how})"


def _padded_cost(p: ConvProblem) -> str:
    """'' or, for a huge zero-padded operand that is mostly padding, a phrase naming it and its size (for warnings
    and errors): a large tensor that is mostly data is the user's own choice of size."""
    name, size, unpadded, how = _padded_operand(p)
    if size < HUGE_PADDED_BYTES or size < PADDING_DOMINATES * unpadded:
        return ""
    return f"its zero-padded {name} spans {how}: about {size / 1e9:.3g} GB at batch {p.batch}"


def cmd_compile(args: argparse.Namespace) -> int:
    if args.artifact == "bundle":
        return _compile_bundle(args)
    out = Path(args.output or Path(args.file).with_suffix(".vmfb").name)
    _check_output(out, Path(args.file))
    t0 = time.perf_counter()
    _progress(True, f"compiling {args.file} for {args.target} ...")
    with _status_line() as status:
        mod = compile_module(args.file, target=args.target, arch=args.arch, batch=args.batch,
                             progress=status.step if status.enabled else None)
    _progress(True, f"compiled {len(mod.kernels)} kernels in {time.perf_counter() - t0:.1f} s")
    mod.save(out)
    print(f"wrote {out} and {out.with_suffix('.json')} ({len(mod.kernels)} kernels, target {mod.target})")
    return 0


def _compile_bundle(args: argparse.Namespace) -> int:
    """`compile --artifact bundle`: the stream kernels (convdsl.torch runs them on PyTorch's stream) in one file."""
    out = Path(args.output or Path(args.file).with_suffix(".convk").name)
    if out.is_dir():
        raise ArgumentError(f"-o {out}: is a directory, expected OUT.convk")
    if _same_file(out, Path(args.file)):
        raise ArgumentError(f"-o {out}: the bundle would overwrite the source {args.file}; expected another OUT.convk")
    t0 = time.perf_counter()
    _progress(True, f"compiling the stream kernels of {args.file} for {args.target} ...")
    built = compile_module(args.file, target=args.target, arch=args.arch, batch=args.batch, artifact="bundle")
    _progress(True, f"compiled {len(built.kernels)} stream kernels in {time.perf_counter() - t0:.1f} s")
    built.write(out)
    print(f"wrote {out} ({len(built.kernels)} stream kernels, target {built.target})")
    for name, reason in built.skipped:
        print(f"  no stream kernel for {name}: {reason}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    kernels = [args.kernel] if args.kernel else None
    t0 = time.perf_counter()
    _progress(True, f"compiling {args.file} for {args.target} ...")
    with _status_line() as status:
        mod = compile_module(args.file, target=args.target, arch=args.arch, batch=args.batch, kernels=kernels,
                             progress=status.step if status.enabled else None)
    _progress(True, f"compiled {len(mod.kernels)} kernels for {mod.target} in {time.perf_counter() - t0:.1f} s")
    # on the CPU, --bench reports each kernel's share of the machine's matmul peak, measured once and cached
    matmul_peak = _matmul_peak(mod.target) if args.bench and mod.target.backend == "cpu" else None
    passed = failed = 0
    width = max(12, *(len(n) for n in mod.kernels))  # the columns stay aligned for long kernel names
    # random_inputs depends on the seed and the arguments' shapes and dtypes only: kernels in a row that take the
    # same arguments (grad_input, transposed and forward of one conv) reuse one draw
    drawn: tuple[tuple, list[np.ndarray]] = ((), [])
    for name in mod.kernels:
        p = mod.problems[name]
        try:
            signature = (tuple(p.arg_shapes), tuple(p.arg_dtypes))
            if drawn[0] != signature:
                drawn = ((), [])  # the last draw freed before the next
                drawn = (signature, ref.random_inputs(p, seed=args.seed))
            inputs = drawn[1]
            want = ref.reference(p, *inputs) if args.check else None
        except MemoryError:
            values = sum(math.prod(s) for s in p.arg_shapes) + (math.prod(p.result_shape) if args.check else 0)
            what = "random inputs and float64 reference" if args.check else "random inputs"
            # at batch 1 a smaller --batch cannot help: the sizes themselves are the cost
            advice = "choose a smaller --batch" if p.batch > 1 else "its sizes need more than this machine has"
            raise ArgumentError(f"kernel {name}: its {what} need about {values * 8 / 1e9:.3g} GB of memory at batch "
                                f"{p.batch}, more than this machine can allocate: {advice}") from None
        t0 = time.perf_counter()
        try:
            got = mod[name](*inputs)
            elapsed = time.perf_counter() - t0
            if args.bench:
                elapsed = mod.loaded.time(name, inputs, repeat=args.repeat, out_shape=p.result_shape,
                                          out_dtype=p.result_dtype)
        except (RuntimeError, MemoryError) as err:  # IREE's failures (an allocation, most often) are RuntimeErrors
            detail = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
            cost = _padded_cost(p)
            raise ArgumentError(f"kernel {name}: the kernel failed on {mod.target}: {detail}"
                                + (f"; {cost}" if cost else "")) from None
        shapes = " ".join("x".join(map(str, s)) for s in p.arg_shapes) + " -> " + "x".join(map(str, p.result_shape))
        if matmul_peak is None:
            rate = f"{p.flops / elapsed / 1e12:8.3f} TFLOP/s"
        else:
            rate = f"{_fixed(p.flops / elapsed / 1e9, 2):>8} GFLOP/s"
        line = (f"{name:<{width}} {p.op:<11} {shapes:<40} {elapsed * 1e3:9.3f} ms {rate} "
                f"{_bytes_moved(p) / elapsed / 1e9:8.2f} GB/s")
        if matmul_peak is not None:
            line += f" {_share(p.flops / elapsed / 1e9, matmul_peak)} of matmul peak ({_significant(matmul_peak)} GFLOP/s)"
        if args.check:
            err = ref.relative_error(got, want)  # converts a chunk at a time
            ok = err <= ref.tolerance(p)
            passed, failed = passed + ok, failed + (not ok)
            line += f"  rel.err {err:.2e} (tol {ref.tolerance(p):.0e}) {'PASS' if ok else 'FAIL'}"
        print(line, flush=True)
    # without --check nothing was compared, so nothing "passed"
    print(f"{passed} passed, {failed} failed" if args.check else f"{len(mod.kernels)} kernels ran (unchecked: add --check)")
    return 1 if failed else 0


def _matmul_peak(target: Target) -> float:
    """The CPU's matmul GFLOP/s from the cache, else measured now (said on the terminal) and cached."""
    gflops = peak.cached(target)
    if gflops is None:
        n = peak.MATMUL_SIZE
        _progress(True, f"measuring the matmul peak of {target} (f32 linalg.matmul {n}x{n}x{n}; once, then "
                        "cached) ...")
        gflops = peak.measure(target)
        _progress(True, f"matmul peak: {_significant(gflops)} GFLOP/s")
    return gflops


def _fixed(value: float, decimals: int) -> str:
    """`value` with `decimals` decimals, or two significant digits where that shows more (0.0021, not 0.00): a
    tiny kernel's rate and share never read 0."""
    if 0 < value < 1:
        decimals = max(decimals, 1 - math.floor(math.log10(value)))
    return f"{value:.{decimals}f}"


def _significant(value: float) -> str:
    """`value` with at least three significant digits and one decimal (1.14, 0.114, 1234.5): a slow machine's
    peak, printed as 1.1, would put the share beside it off by 4% from the rate it is the share of."""
    decimals = max(1, 2 - math.floor(math.log10(value))) if value > 0 else 1
    return f"{value:.{decimals}f}"


def _share(gflops: float, of: float) -> str:
    """A percentage, right-aligned: 45.2%, 104.0%, 0.25%, 0.0021%."""
    return f"{_fixed(100 * gflops / of, 1)}%".rjust(6)


def _stream_path(plan: KernelPlan) -> str:
    """What convdsl.torch runs for the plan's problem on a CUDA device of its target's arch: the stream kernels
    (planned, not compiled) or, where they do not apply, the IREE module through DLPack.  (With TF32 allowed,
    PyTorch's f32 calls are the problem with compute = tf32.)"""
    if plan.stream is None:
        return f"the IREE module through DLPack (synchronised): {plan.stream_reason}"
    return plan.stream.describe()


def cmd_explain(args: argparse.Namespace) -> int:
    target = resolve_target(args.target, args.arch)
    problems = load_problems(args.file, args.batch)
    # the whole file's module, as `convdsl compile` builds it: its compile recorded what IREE took
    notes = iree_config_notes(problems, target) if target.backend != "cpu" else {}
    if args.kernel:
        problems = [p for p in problems if p.name == args.kernel]
        if not problems:
            raise ValueError(f"--kernel: no kernel named {args.kernel!r} in {args.file}")
    if args.stage != "all" and args.stage not in STAGE_NAMES:
        raise ValueError(f"--stage: expected all or one of {', '.join(STAGE_NAMES)}, got {args.stage!r}")

    def observe(name: str, stage: Stage) -> None:
        status.clear()  # the IR goes to stdout: no half-written status line in front of it
        if args.stage not in ("all", name):
            return
        if name == "gemm-cores" and not stage.binaries:
            # nothing compiled: the CPU, or GPU kernels that are all IREE's own (linalg) code
            if args.stage == name:
                print(f"// pass '{name}' does not apply here: no kernel for {target} has Triton GEMM cores")
            return
        print(f"// ----- after pass '{name}' -----")
        if name == "plan":
            for plan in stage.plans:
                print(describe_plan(plan))
                # the CPU has no knobs to come from anywhere: IREE configures its kernels itself
                print(f"  knobs: {plan.knobs_source}" if plan.knobs_source == ON_CPU
                      else f"  knobs: {plan.knobs.label()}, from the {plan.knobs_source}")
                line = _iree_config_line(plan.problem.name, plan.knobs, notes)
                if line:
                    print(f"  {line}")
                if target.backend == "cuda":
                    print(f"  from PyTorch (convdsl.torch): {_stream_path(plan)}")
        elif name == "gemm-cores":
            print(describe_binaries(stage.binaries))
        else:
            if name == "workspaces":
                for kernel, size in stage.workspaces:
                    print(f"// {kernel}: the plain function's transients ({size} bytes) are kept in the module")
                if not stage.workspaces:
                    print("// no plain function keeps its transients in the module (policy.module_keeps_workspace)")
            print(stage.module)

    plans = [compiler.plan(p, target) for p in problems]  # the plans `convdsl compile` builds both artifacts from
    with _status_line() as status:
        run_pipeline(problems, target, observe, progress=status.step if status.enabled else None, plans=plans)
    data_tiling = policy.cpu_data_tiling(problems, target)
    if target.backend == "cpu":
        print(f"// data tiling and matmul microkernels: {'on' if data_tiling else 'off'} (policy.cpu_data_tiling)")
        if data_tiling:
            print("// packed matmuls with a long reduction: every row tile that fits "
                  f"{policy.CPU_WORKGROUP_ROW_BYTES // 2**20} MiB by one column tile per workgroup, set between "
                  "--compile-to=executable-configurations and --compile-from=executable-configurations "
                  "(policy.cpu_packed_matmul_distribution)")
    print(f"// compile with: iree-compile kernel.mlir {' '.join(target.compile_flags(data_tiling))} -o kernel.vmfb")
    return 0


def _iree_config_line(name: str, knobs: Knobs, notes: Optional[dict]) -> str:
    """What the module's compile made of a kernel's knobs over IREE's configuration (scaled to fit the
    workgroup memory, or IREE's default kept and why); '' where the knobs set none."""
    if knobs.config_default:
        return ""
    if notes is None:
        return "IREE configuration: not compiled into the cache yet (`convdsl compile` records what IREE took)"
    note = notes.get(name)
    return note["note"] if note else ""


def cmd_check(args: argparse.Namespace) -> int:
    problems = parse_file(args.file)
    if not problems:  # compile, run and explain refuse such a file too (load_problems)
        raise ConvSyntaxError("no kernels: expected at least one line `kernel NAME = OP(CONV)`",
                              str(args.file), 1, 1)
    for p in problems:
        print(f"{p.name}: {p.describe()}")
        cost = _padded_cost(p)
        if cost:  # valid, but costly to run: said, not refused
            print(f"{args.file}: warning: kernel {p.name}: {cost}; the compiled kernel may need that much "
                  "workspace", file=sys.stderr)
    print(f"{args.file}: {len(problems)} kernels, no errors")
    return 0


TUNED_BACKENDS = ("cuda", "rocm")  # the CPU compiles with IREE's own configuration: no knobs to tune


def cmd_tune(args: argparse.Namespace) -> int:
    if args.target not in TUNED_BACKENDS:
        why = ("the CPU compiles with IREE's own configuration, so there is nothing to tune" if args.target == "cpu"
               else "")
        raise TargetError(f"--target: tuning applies to GPU targets ({', '.join(TUNED_BACKENDS)}), got "
                          f"{args.target!r}" + (f": {why}" if why else ""))
    target = resolve_target(args.target, args.arch)
    if args.phase == "candidates":
        path = tune.candidates(load_problems(args.file, args.batch), target, Path(args.out), jobs=args.jobs)
        print(f"wrote {path}; time the candidates on the GPU machine with:\n"
              f"  python3 benchmarks/gpu_bench.py --build {args.out} --out RESULTS\n"
              f"then: convdsl tune collect RESULTS/<device>-<date>.json --cases {path}")
        return 0
    if args.cases is None:
        raise ArgumentError("tune collect: --cases is required: the cases.json that `convdsl tune candidates` wrote "
                            "(e.g. --cases tune-build/cases.json)")
    chosen = tune.collect(Path(args.file), Path(args.cases), target)
    for name, (label, base, best) in chosen.items():
        print(f"{name:<24} {label:<12} {base:8.3f} ms -> {best:8.3f} ms")
    print(f"{len(chosen)} kernels tuned into the database for {target}")
    return 0


# a flag's number past this many digits is no size or seed anyone means (and int() refuses past 4300)
_MAX_FLAG_DIGITS = 40


def _whole(text: str) -> int:
    """A flag's whole number, or an ArgumentTypeError that shows at most the start of a long text."""
    shown = text if len(text) <= 40 else text[:37] + "..."
    digits = text.strip().lstrip("+-")
    if not digits.isdecimal() or not digits.isascii():
        raise argparse.ArgumentTypeError(f"expected a whole number, got {shown!r}")
    if len(digits.lstrip("0")) > _MAX_FLAG_DIGITS:
        raise argparse.ArgumentTypeError(f"expected a number of at most {_MAX_FLAG_DIGITS} digits, got one of "
                                         f"{len(digits.lstrip('0'))} digits")
    return int(text)


def _positive(text: str) -> int:
    value = _whole(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {value}")
    return value


def _seed(text: str) -> int:
    value = _whole(text)
    if value < 0:  # NumPy's generators take non-negative seeds only
        raise argparse.ArgumentTypeError(f"expected a non-negative whole number, got {value}")
    return value


def _batch(text: str) -> int:
    value = _positive(text)
    if value > MAX_SIZE:  # the language's limit on every size (problem.py), said of the flag
        raise argparse.ArgumentTypeError(f"expected at most {MAX_SIZE} (2^31 - 1), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="convdsl", description="A compiler for convolution gradients.")
    parser.add_argument("--version", action="version", version=f"convdsl {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log the convdsl loggers' DEBUG lines too (e.g. IREE's notes of the executable "
                             "configurations it substituted) to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser, default_target: str) -> None:
        p.add_argument("file", help="a .conv file")
        p.add_argument("--target", default=default_target, choices=("auto", *BACKENDS),
                       help=f"where the kernels run: auto (a CUDA GPU when present, else the CPU), "
                            f"{', '.join(BACKENDS)} (default: {default_target})")
        p.add_argument("--arch", default=None, help="sm_80, sm_89, sm_90, gfx942, ... for a GPU target (default: "
                       "sm_80 for cuda, gfx942 for rocm; with --target auto, the CUDA device's own); for the CPU an "
                       "LLVM CPU name, e.g. sapphirerapids, znver4, x86-64-v4 (default: host, the CPU compiling)")
        p.add_argument("--batch", type=_batch, default=None,
                       help="override every conv's batch size, `batch = ?` included (compiled for this batch)")

    c = sub.add_parser("compile", help="compile a .conv file to OUT.vmfb (+ OUT.json manifest), or to a bundle of "
                       "stream kernels for convdsl.torch")
    common(c, "cpu")
    c.add_argument("--artifact", default="vmfb", choices=("vmfb", "bundle"),
                   help="vmfb: the IREE module (default); bundle: the CUDA stream kernels (OUT.convk, loaded with "
                        "convdsl.stream.load_bundle)")
    c.add_argument("-o", "--output", default=None, help="OUT.vmfb to write, with OUT.json beside it (default: the "
                   ".conv file's name with .vmfb; .convk for a bundle)")
    c.set_defaults(fn=cmd_compile)

    r = sub.add_parser("run", help="run every kernel on random inputs; --check against the f64 reference")
    common(r, "auto")
    r.add_argument("--kernel", default=None, help="run only the kernel of this name (default: every kernel)")
    r.add_argument("--check", action="store_true",
                   help="compare each result with the float64 reference and report PASS/FAIL (exit 1 on a FAIL)")
    r.add_argument("--bench", action="store_true", help="time: median of --repeat runs after warm-up; on the CPU "
                   "with GFLOP/s and the share of the machine's matmul peak (measured on first use, then cached)")
    r.add_argument("--repeat", type=_positive, default=20, help="--bench: timed runs per kernel (at least 1)")
    r.add_argument("--seed", type=_seed, default=0, help="seed of the random inputs (default 0)")
    r.set_defaults(fn=cmd_run)

    e = sub.add_parser("explain", help="print the plan and the IR after each pass")
    common(e, "cpu")
    e.add_argument("--kernel", default=None, help="explain only the kernel of this name (default: every kernel)")
    e.add_argument("--stage", default="all", choices=("all", *STAGE_NAMES),
                   help="print only this pass's output (default: all)")
    e.set_defaults(fn=cmd_explain)

    t = sub.add_parser("tune", help="autotune: compile candidates here, time them on the GPU, collect the best")
    t.add_argument("phase", choices=("candidates", "collect"),
                   help="candidates: compile the candidate configurations; collect: store the fastest in the database")
    t.add_argument("file", help="candidates: a .conv file; collect: the results JSON from gpu_bench.py")
    t.add_argument("--target", default="cuda", help=f"the GPU target to tune for: {' or '.join(TUNED_BACKENDS)} "
                   "(default: cuda; the CPU has nothing to tune)")
    t.add_argument("--arch", default=None, help="sm_80, sm_90, gfx942, ... (default per target)")
    t.add_argument("--batch", type=_batch, default=None,
                   help="override every conv's batch size, `batch = ?` included (compiled for this batch)")
    t.add_argument("--out", default="tune-build", help="candidates: output folder")
    t.add_argument("--cases", default=None, help="collect: the cases.json that phase 1 wrote")
    t.add_argument("--jobs", type=int, default=2, help="candidates: compiles run in parallel (default 2)")
    t.set_defaults(fn=cmd_tune)

    k = sub.add_parser("check", help="validate a .conv file without compiling")
    k.add_argument("file", help="a .conv file")
    k.set_defaults(fn=cmd_check)
    return parser


@contextlib.contextmanager
def _verbose_logging(verbose: bool) -> Iterator[None]:
    """With `verbose`, every record of the "convdsl" loggers to stderr while the command runs; the logger is left as
    it was afterwards (main may be called more than once in a process)."""
    if not verbose:
        yield
        return
    logger = logging.getLogger("convdsl")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with _verbose_logging(args.verbose):
            return args.fn(args)
    except ConvSyntaxError as err:
        print(err, file=sys.stderr)
    except (ProblemError, TargetError, ArgumentError, CompileError, LoweringError, ValueError) as err:
        print(f"convdsl: error: {err}", file=sys.stderr)
    except FileNotFoundError as err:
        # the compiler takes only regular files as paths: a device or pipe that exists is not "missing"
        what = ("expected a regular .conv file, got a device, pipe or socket"
                if err.filename and os.path.exists(err.filename) else "no such file")
        print(f"convdsl: error: {err.filename}: {what}", file=sys.stderr)
    except IsADirectoryError as err:
        print(f"convdsl: error: {err.filename}: is a directory, expected a .conv file", file=sys.stderr)
    except OSError as err:  # unreadable input, unwritable output, ...
        print(f"convdsl: error: {err.filename or ''}: {err.strerror or err}", file=sys.stderr)
    except MemoryError:
        print("convdsl: error: out of memory (a smaller --batch, or fewer kernels with --kernel, needs less)",
              file=sys.stderr)
    except KeyboardInterrupt:
        print("convdsl: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
