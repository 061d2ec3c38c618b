"""The kernels of a compiled XLA:GPU program, read from its optimized HLO text (`compiled.as_text()`).

A deviceless XLA:GPU compile (`clip_jax.runtime.xla_gpu`) has no cost analysis, but its text names every kernel the
GPU would run: each instruction of a computation that runs as a sequence (the entry, a while loop's body and
condition, a conditional's branches, a called computation) launches one, except the bookkeeping ones (parameters,
tuples, bitcasts, the loops themselves). `kernels(text)` lists them, each with

- its class: `gemm` (cuBLAS and Triton matrix products, cuDNN convolutions), `attention` (cuDNN's fused attention),
  `collective`, `custom_call` (a kernel of the program's own, written in Pallas: its Triton or Mosaic GPU call,
  `callee` its name) or `elementwise` (every fusion, copy and slice: the memory-bound rest), and its `dtype` (the
  products' operand type: bf16, f32, f8);
- FLOPs: a product's 2 x M x N x K from its shapes and contracting dimensions; fused attention's two (forward) or
  five (backward) [S_q, S_k] x D products per head; elementwise kernels count one FLOP per element written;
- bytes: what it reads and writes. A fusion that slices one layer out of a stacked `[layers, ...]` operand reads the
  slice, not the stack, and one that updates a slice in place writes the slice: per loop trip, as the GPU does; a
  Pallas kernel, whose body the text does not show, its operands and results whole;
- `runs`: how many times it runs per step (the trip counts of the loops it is in, multiplied);
- `op_name`: the model operation it comes from (the HLO's metadata), for a profile a person can read.

Only what the text states is used (read by `clip_jax.runtime.hlo_text`); nothing is timed here
(`clip_jax.plan.step_time` turns kernels into seconds).
"""

import dataclasses
import math
import re

from clip_jax.runtime.hlo_text import (TRIP_COUNT, Array, Computation, Instruction, arrays, closing, parse,
                                       shape_bytes, tuple_elements)

# Instructions that launch nothing: bookkeeping and control flow (its computations' kernels are counted). The
# "done" half of an asynchronous pair ("all-reduce-done", "fusion-done", ...) is not one either: the "start" is.
NOT_KERNELS = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call", "after-all",
    "opt-barrier", "add-dependency", "domain", "partition-id", "replica-id", "async-update",
})
COLLECTIVE_OPS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")  # $f8 is a suffix of the second
CONV_TARGET = "__cudnn$conv"
ATTENTION_TARGET = "__cudnn$fmha"
# Pallas kernels: Triton's (what `pallas_call` lowers to with Triton's compiler parameters) and Mosaic GPU's
KERNEL_CALL_TARGETS = ("__gpu$xla.gpu.triton", "mosaic_gpu")
_KERNEL_NAME = re.compile(r'\bname = "([^"]+)"')  # in a Triton call's backend_config
SLICING_OPS = ("dynamic-slice", "slice", "gather")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of the step (see the module's docstring)."""

    name: str
    kind: str  # "gemm", "attention", "collective", "custom_call", "elementwise"
    opcode: str  # the HLO opcode; a custom call's target; a fusion's kind
    dtype: str  # products: their operands' element type ("bf16", "f32", "f8"); otherwise the result's
    flops: float  # per run
    bytes: float  # read + written, per run
    runs: int  # per step
    op_name: str
    known: bool = True  # False: an instruction this reader has no rule for, costed as elementwise
    callee: str = ""  # a custom call's kernel: a Pallas kernel's name

    @property
    def step_flops(self) -> float:
        return self.flops * self.runs

    @property
    def step_bytes(self) -> float:
        return self.bytes * self.runs


# Top-level instructions that are memory-bound kernels of known kinds (fusions are classified by what they fuse).
ELEMENTWISE_OPS = frozenset({
    "fusion", "copy", "copy-start", "dynamic-slice", "dynamic-update-slice", "slice", "concatenate", "pad",
    "transpose", "reshape", "broadcast", "iota", "convert", "reduce", "reduce-window", "select-and-scatter", "sort",
    "scatter", "gather", "rng", "rng-bit-generator", "rng-get-and-update-state", "add", "multiply", "subtract",
    "divide", "select", "compare", "maximum", "minimum", "exponential", "log", "negate", "sqrt", "rsqrt", "abs",
    "and", "or", "not", "xor", "clamp", "is-finite", "power", "tanh", "cbrt", "sign", "floor", "ceil",
    "round-nearest-even", "round-nearest-afz", "shift-left", "shift-right-logical", "shift-right-arithmetic",
    "exponential-minus-one", "log-plus-one", "logistic", "reverse", "bitcast-convert", "reduce-precision",
    "dynamic-reshape", "real", "imag", "atan2", "remainder", "cosine", "sine", "erf",
})


def launched(computations: dict[str, Computation]) -> list[tuple[Instruction, Computation, int]]:
    """Every instruction of a parsed program that launches a kernel, with its computation and its runs per program
    run (loop trips multiplied), in program order."""
    entry = next((c for c in computations.values() if c.entry), None)
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    found: list[tuple[Instruction, Computation, int]] = []

    def visit(computation: Computation, runs: int) -> None:
        for instruction in computation.instructions.values():
            trips = TRIP_COUNT.search(instruction.attributes)
            for role, callee in instruction.called():
                if callee not in computations:
                    continue
                if role == "body":
                    visit(computations[callee], runs * (int(trips[1]) if trips else 1))
                elif role == "condition":
                    visit(computations[callee], runs * (int(trips[1]) + 1 if trips else 1))
                elif role == "branch" or (role in ("calls", "true_computation", "false_computation")
                                          and instruction.opcode in ("call", "async-start", "conditional")):
                    visit(computations[callee], runs)  # every branch counted: an upper bound
            if instruction.opcode not in NOT_KERNELS and not instruction.opcode.endswith("-done"):
                found.append((instruction, computation, runs))

    visit(entry, 1)
    return found


def kernels(hlo_text: str) -> list[Kernel]:
    """The kernels one run of the program launches (see the module's docstring), in program order."""
    computations = parse(hlo_text)
    return [_kernel(instruction, computation, computations, runs)
            for instruction, computation, runs in launched(computations)]


# -- collectives: the bytes of the whole buffer taking part ------------------------------------------------------

_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}")  # mesh['a'=8,'b'=1] {'a'}


def shape_bytes_by_dtype(shape: str) -> dict[str, int]:
    """The bytes of every array of a shape's text, {element type: bytes}."""
    total: dict[str, int] = {}
    for array in arrays(shape):
        total[array.dtype] = total.get(array.dtype, 0) + int(array.bytes)
    return total


def collective_bytes(instruction: Instruction) -> dict[str, int]:
    """The bytes of the whole buffer taking part in one collective, by element type: an all-gather's output, a
    reduce-scatter's input, an all-reduce's operand. An all-gather-start or reduce-scatter-start returns
    (operands, results); an all-reduce-start, like the synchronous ones, its results."""
    kind = instruction.opcode.removesuffix("-start")
    parts = tuple_elements(instruction.shape)
    paired = instruction.opcode.endswith("-start") and kind != "all-reduce" and len(parts) == 2
    if kind == "reduce-scatter":
        if paired:
            return shape_bytes_by_dtype(parts[0])
        group = group_size(instruction.attributes)
        return {dtype: n * group for dtype, n in shape_bytes_by_dtype(instruction.shape).items()}
    return shape_bytes_by_dtype(parts[1] if paired else instruction.shape)


def group_size(attributes: str) -> int:
    """How many devices take part in each group of a collective (its replica_groups, in any of their forms)."""
    iota = _GROUPS_IOTA.search(attributes)
    if iota:
        return int(iota[2])
    mesh = _GROUPS_MESH.search(attributes)
    if mesh:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh[1]))
        return math.prod(int(sizes[axis]) for axis in re.findall(r"'([^']+)'", mesh[2]))
    listed = _GROUPS_LIST.search(attributes)
    return len(listed[1].split(",")) if listed else 1


def _kernel(instruction: Instruction, computation: Computation, computations: dict[str, Computation],
            runs: int) -> Kernel:
    if instruction.opcode == "fusion-start":  # an asynchronous fusion: ((operands), result, context)
        instruction = dataclasses.replace(instruction, opcode="fusion", shape=tuple_elements(instruction.shape)[1])
    opcode, target = instruction.opcode, instruction.target
    operands = [computation.instructions.get(name) for name in instruction.operands]
    result = _payload(instruction)
    written = sum(a.bytes for a in result)
    read = sum(shape_bytes(o.shape) for o in operands if o is not None)
    common = dict(name=instruction.name, runs=runs, op_name=instruction.op_name)
    if opcode == "custom-call" and target.startswith(GEMM_TARGETS):
        lhs = arrays(operands[0].shape)[0]
        numbers = instruction.backend_config().get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
        depth = math.prod(lhs.dims[int(d)] for d in numbers.get("lhs_contracting_dimensions", [len(lhs.dims) - 1]))
        return Kernel(kind="gemm", opcode=target, dtype=_product_dtype(lhs.dtype),
                      flops=2.0 * result[0].elements * depth, bytes=read + written, **common)
    if opcode == "custom-call" and target.startswith(CONV_TARGET):
        return Kernel(kind="gemm", opcode=target, dtype=_product_dtype(arrays(operands[0].shape)[0].dtype),
                      flops=_convolution_flops(instruction, operands[1].shape, result[0]), bytes=read + written,
                      **common)
    if opcode == "custom-call" and target.startswith(ATTENTION_TARGET):
        return Kernel(kind="attention", opcode=target, dtype=_product_dtype(result[0].dtype),
                      flops=_attention_flops(instruction, operands), bytes=read + written, **common)
    if opcode == "custom-call" and target.startswith(KERNEL_CALL_TARGETS):
        written = sum(a.bytes for a in arrays(instruction.shape))  # every result: no library scratch to leave out
        return Kernel(kind="custom_call", opcode=target, dtype=result[0].dtype if result else "", flops=0.0,
                      bytes=read + written, callee=kernel_call_name(instruction), **common)
    if opcode.removesuffix("-start") in COLLECTIVE_OPS:
        return Kernel(kind="collective", opcode=opcode.removesuffix("-start"), dtype=result[0].dtype if result
                      else "", flops=0.0, bytes=float(sum(collective_bytes(instruction).values())), **common)
    if opcode == "fusion":
        fused = computations.get(dict(instruction.called()).get("calls", ""))
        if fused is not None:
            return _fusion_kernel(instruction, fused, operands, computations, common)
    if opcode in ("dynamic-slice", "slice"):
        return Kernel(kind="elementwise", opcode=opcode, dtype=result[0].dtype, flops=0.0, bytes=2 * written,
                      **common)
    if opcode == "dynamic-update-slice":
        update = shape_bytes(operands[1].shape) if operands[1] is not None else written
        return Kernel(kind="elementwise", opcode=opcode, dtype=result[0].dtype, flops=0.0, bytes=2 * update,
                      **common)
    return Kernel(kind="elementwise", opcode=opcode if opcode != "custom-call" else target,
                  dtype=result[0].dtype if result else "", flops=float(sum(a.elements for a in result)),
                  bytes=read + written, known=opcode in ELEMENTWISE_OPS, **common)


def kernel_call_name(instruction: Instruction) -> str:
    """A Pallas kernel's name: a Triton call's `name` (its kernel function's), else the last part of its op_name."""
    config = instruction.attributes.find("backend_config=")
    named = _KERNEL_NAME.findall(instruction.attributes[config:]) if config >= 0 else []
    return named[-1] if named else instruction.op_name.rsplit("/", 1)[-1]


def _payload(instruction: Instruction) -> list[Array]:
    """The result's arrays, without a library call's scratch buffer (cuBLAS's and cuDNN's last u8/s8 element)."""
    result = arrays(instruction.shape)
    if instruction.opcode == "custom-call" and len(result) > 1 and result[-1].dtype in ("s8", "u8"):
        result = result[:-1]
    return result


def _product_dtype(dtype: str) -> str:
    return "f8" if dtype.startswith("f8") else dtype


def _convolution_flops(instruction: Instruction, kernel_shape: str, output: Array) -> float:
    """2 x output elements x the kernel's taps x input features: the kernel's elements over its output features."""
    kernel = arrays(kernel_shape)[0]
    labels = re.search(r"dim_labels=\w+_(\w+)->", instruction.attributes)
    out_features = kernel.dims[labels[1].index("o")] if labels and "o" in labels[1] else kernel.dims[-1]
    return 2.0 * output.elements * kernel.elements / out_features


def _attention_flops(instruction: Instruction, operands: list) -> float:
    """cuDNN's fused attention: per batch and head, [S_q, D] x [D, S_k] and [S_q, S_k] x [S_k, D] forward; the
    backward recomputes the scores and takes three more products. A causal mask skips about half."""
    at = instruction.attributes.find("operand_layout_constraints={")
    if at >= 0:  # the operands as the library takes them, [B, S, H, D]
        open_at = at + len("operand_layout_constraints=")
        shapes = arrays(instruction.attributes[open_at:closing(instruction.attributes, open_at)])
    else:
        shapes = [arrays(o.shape)[0] for o in operands[:2] if o is not None]
    query, key = shapes[0], shapes[1]  # [B, S, H, D]
    batch, s_q, heads, depth = query.dims
    s_k = key.dims[1]
    products = 5 if "Backward" in instruction.target else 2
    causal = 0.5 if "CAUSAL" in instruction.attributes else 1.0
    return 2.0 * products * batch * heads * s_q * s_k * depth * causal


def _fusion_kernel(instruction: Instruction, fused: Computation, operands: list,
                   computations: dict[str, Computation], common: dict) -> Kernel:
    """A fusion: a product where it fuses a dot or a convolution (cuBLAS epilogues, Triton GEMMs), otherwise
    elementwise; its bytes as the fused computation touches them (slices of stacked operands, in-place updates)."""
    read = 0.0
    for number, operand in enumerate(operands):
        if operand is not None:
            parameter = fused.parameter(number)
            read += _bytes_read(fused, parameter, shape_bytes(operand.shape))
    written = _bytes_written(fused, fused.root, sum(a.bytes for a in _payload(instruction)))
    kind = instruction.backend_config().get("fusion_backend_config", {}).get("kind", "")
    dots = [i for i in fused.instructions.values() if i.opcode in ("dot", "convolution")]
    if dots:
        flops, dtype = 0.0, ""
        for dot in dots:
            lhs = arrays(fused.instructions[dot.operands[0]].shape)[0]
            out = arrays(dot.shape)[0]
            if dot.opcode == "dot":
                contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", dot.attributes)
                dims = [int(d) for d in contracting[1].split(",") if d] if contracting else [len(lhs.dims) - 1]
                flops += 2.0 * out.elements * math.prod(lhs.dims[d] for d in dims)
            else:
                flops += _convolution_flops(dot, fused.instructions[dot.operands[1]].shape, out)
            dtype = _product_dtype(lhs.dtype)
        return Kernel(kind="gemm", opcode=f"fusion:{kind or 'dot'}", dtype=dtype, flops=flops, bytes=read + written,
                      **common)
    elements = sum(a.elements for a in arrays(instruction.shape))
    return Kernel(kind="elementwise", opcode=f"fusion:{kind or 'loop'}",
                  dtype=(arrays(instruction.shape) or [Array("", ())])[0].dtype, flops=float(elements),
                  bytes=read + written, **common)


def _bytes_read(fused: Computation, parameter: Instruction | None, full: float) -> float:
    """What a fusion reads of one operand: the slices it takes where every use slices it (through bitcasts), none
    where it is only the buffer a dynamic-update-slice writes into in place, else all of it."""
    if parameter is None:
        return full
    uses = _uses_through_bitcasts(fused, parameter.name)
    if uses and all(use.opcode in SLICING_OPS and use.operands[0] == source for use, source in uses):
        return sum(shape_bytes(use.shape) for use, _ in uses)
    if uses and all(use.opcode == "dynamic-update-slice" and use.operands[0] == source for use, source in uses):
        return 0.0
    return full


def _uses_through_bitcasts(fused: Computation, name: str) -> list[tuple[Instruction, str]]:
    """(user, the name it uses) for every use of `name`, looking through bitcasts and reshapes."""
    found = []
    for user in fused.users(name):
        if user.opcode in ("bitcast", "reshape"):
            found += _uses_through_bitcasts(fused, user.name)
        else:
            found.append((user, name))
    return found


def _bytes_written(fused: Computation, root: Instruction, full: float) -> float:
    """What a fusion writes: the update of an in-place dynamic-update-slice root, each element of a tuple root
    alike, else its whole result."""
    if root.opcode == "dynamic-update-slice":
        return shape_bytes(fused.instructions[root.operands[1]].shape)
    if root.opcode == "tuple":
        return sum(_bytes_written(fused, fused.instructions[name], shape_bytes(fused.instructions[name].shape))
                   for name in root.operands)
    if root.opcode in ("bitcast", "copy") and root.operands and root.operands[0] in fused.instructions:
        inner = fused.instructions[root.operands[0]]
        if inner.opcode == "dynamic-update-slice":
            return _bytes_written(fused, inner, full)
    return full
