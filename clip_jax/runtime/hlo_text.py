"""Optimized HLO text (`compiled.as_text()`) read into computations and instructions, and the shapes it prints.

The reader keeps what `clip_jax.runtime.hlo_kernels` and `clip_jax.runtime.xla_gpu` ask of a compiled program:
each computation's instructions with their result shape, opcode, operands, called computations and attributes
(`op_name` metadata, a custom call's target, the backend config). Nothing else of HLO's grammar is needed.
"""

import dataclasses
import json
import math
import re

ELEMENT_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                 "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}

_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = (.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_NAME = re.compile(r"%([\w.\-]+)")
_CALLED = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')  # a while loop's, in its backend config
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def bytes(self) -> float:
        return self.elements * ELEMENT_BYTES.get(self.dtype, 1 if self.dtype.startswith("f8") else 4)


def arrays(shape: str) -> list[Array]:
    """Every array of a shape's text ("bf16[2,3]{1,0}", or a tuple of them), in order."""
    return [Array(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _ARRAY.findall(shape)]


def tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape's text, "(A, (B, C))" -> ["A", "(B, C)"]; an array is itself."""
    if not shape.startswith("("):
        return [shape]
    elements, depth, start = [], 0, 1
    for i, char in enumerate(shape):
        depth += char in "({[" and 1 or (-1 if char in ")}]" else 0)
        if (char == "," and depth == 1) or depth == 0:
            element = re.sub(r"/\*[^*]*\*/", "", shape[start:i]).strip()
            if element:
                elements.append(element)
            start = i + 1
        if depth == 0:
            break
    return elements


def shape_bytes(shape: str) -> float:
    return sum(a.bytes for a in arrays(shape))


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str  # the result's shape text
    opcode: str
    operand_text: str  # inside the parentheses: operand names, or a parameter's number
    attributes: str  # everything after the operand list
    root: bool = False

    @property
    def operands(self) -> tuple[str, ...]:
        return tuple(_NAME.findall(self.operand_text))

    def called(self) -> list[tuple[str, str]]:
        """(role, computation) pairs: body, condition, calls, to_apply, branch."""
        pairs = _CALLED.findall(self.attributes)
        branches = _BRANCHES.search(self.attributes)
        if branches:
            pairs += [("branch", b.strip().lstrip("%")) for b in branches[1].split(",") if b.strip()]
        return pairs

    @property
    def op_name(self) -> str:
        found = _OP_NAME.search(self.attributes)
        return found[1].replace("\\'", "'") if found else ""

    @property
    def target(self) -> str:
        found = _TARGET.search(self.attributes)
        return found[1] if found else ""

    def backend_config(self) -> dict:
        start = self.attributes.find("backend_config={")
        if start < 0:
            return {}
        try:
            return json.JSONDecoder().raw_decode(self.attributes[start + len("backend_config="):])[0]
        except ValueError:
            return {}


@dataclasses.dataclass
class Computation:
    name: str
    instructions: dict[str, Instruction]
    entry: bool = False

    @property
    def root(self) -> Instruction:
        return next(i for i in self.instructions.values() if i.root)

    def parameter(self, number: int) -> Instruction | None:
        return next((i for i in self.instructions.values()
                     if i.opcode == "parameter" and i.operand_text.strip() == str(number)), None)

    def users(self, name: str) -> list[Instruction]:
        return [i for i in self.instructions.values() if name in i.operands]


def _split_instruction(text: str) -> tuple[str, str, str, str] | None:
    """"SHAPE opcode(OPERANDS), ATTRIBUTES" -> its four parts (shapes and operand lists may nest brackets)."""
    if text.startswith("("):
        end = closing(text, 0)
        shape, rest = text[:end + 1], text[end + 1:].lstrip()
    else:
        shape, _, rest = text.partition(" ")
    match = re.match(r"([\w\-]+)\(", rest)
    if not match:
        return None
    open_at = match.end() - 1
    close_at = closing(rest, open_at)
    return shape, match[1], rest[open_at + 1:close_at], rest[close_at + 1:].lstrip(", ")


def closing(text: str, start: int) -> int:
    """The index of the bracket that closes the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "({[":
            depth += 1
        elif text[i] in ")}]":
            depth -= 1
            if depth == 0:
                return i
    return len(text) - 1


def parse(hlo_text: str) -> dict[str, Computation]:
    """The computations of an HLO module's text, by name."""
    computations: dict[str, Computation] = {}
    current = None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = computations[header[2]] = Computation(header[2], {}, entry=bool(header[1]))
            continue
        match = _INSTRUCTION.match(line) if current is not None else None
        parts = match and _split_instruction(match[3])
        if parts:
            instruction = Instruction(match[2], *parts, root=bool(match[1]))
            current.instructions[instruction.name] = instruction
    return computations
