"""Per-chip flops, HBM bytes and interconnect bytes of a compiled XLA program, read from its
optimized HLO text (`jax.jit(f).lower(...).compile().as_text()`), loops counted honestly.

    hlo_cost(compiled.as_text()) -> HloCost

Why not `compiled.cost_analysis()`: XLA counts a while loop's body once, whatever its trip count
(a layer scan of 28 layers reports the flops of one layer), and says nothing about bytes moved
between chips. Here every computation is walked from ENTRY with a multiplicity, the product of
the trip counts of the loops around it, and every figure is multiplied by it. The text is the
post-optimization, SPMD-partitioned module, so every figure is per chip. Pure Python: no jax.

Counting rules (formulas in the functions' docstrings):

- loops: a `while` runs its body n times and its condition n + 1 times (the last test exits).
  n is the while's backend_config `known_trip_count` (CPU and GPU emit it; TPU does not); else
  the bound of the condition: a `compare` of a loop-carried integer (a get-tuple-element of the
  condition's parameter, maybe through copy / convert / bitcast / a fusion's parameter) with an
  integer constant (in the condition, or inside a fusion it calls, or a fusion operand):
  `i < K` -> K - init, `i <= K` -> K - init + 1 (also `K > i`, `K >= i`, `i != K`), the least
  of several (`(i < K) & ~done`), divided by the step the body adds to i (else 1; counting
  down, `i > K`, works alike). init is the carried value's constant initial value where the
  while's operand tuple shows it, else 0 (our programs count from 0): the bound is an upper
  bound for a data-dependent loop such as the decode's `(step < steps) & ~all(done)`. No bound:
  1, source "unknown". Nested loops multiply. A `call` runs its computation once; a
  `conditional` one branch: the costliest (flops, then bytes) is counted.
- flops: matmuls and convolutions only, wherever they are (entry, loop bodies, fusions):
  `dot` 2 * prod(result dims) * prod(lhs contracting dims); `convolution` (TPU emits its matmuls
  as convolutions) 2 * output batch * output features * kernel input features * the number of
  kernel positions each output position meets real input at (padding and dilation holes left
  out, as XLA's own cost analysis counts them). Elementwise ops, reductions, transcendentals
  and custom calls (Mosaic kernels: listed in `custom_calls`) are not counted.
- hbm_bytes: at each instruction of a computation that runs on its own (entry, loop bodies and
  conditions, call / conditional branches; not inside fusions) the bytes of its operands plus
  its output, except what moves nothing (parameter, get-tuple-element, tuple, bitcast, constant,
  while / call / conditional themselves, *-done, ...) and collectives (collective_bytes). A
  slice (slice, dynamic-slice, gather) reads only what it outputs; an in-place update
  (dynamic-update-slice, scatter) reads and writes only its update (the buffer operand and the
  output each count the update's bytes: XLA updates in place; where it cannot, it copies the
  buffer first, and the copy counts); inside a fusion the same holds for a fused parameter
  consumed only by slices / in-place updates (a layer scan reads one layer of its stacked
  [L, ...] weights an iteration, a decode step writes one token of its KV cache), and a fused
  parameter passed straight to the fusion's output, or into a collective, moves nothing.
  Custom calls (Mosaic kernels) count their operands and output. Logical sizes (no tile
  padding), every memory space: `alt_memory_bytes` is the part of hbm_bytes in buffers placed
  in an on-chip memory space (layout `S(n)`, n not 0 or 5 = host; on TPU S(1) is VMEM), so
  hbm_bytes - alt_memory_bytes is a tighter HBM figure. XLA's TPU "bytes accessed" counts
  tile-padded sizes (a minor dim of 8 padded to 128), so it exceeds these for small dims.
- collective_bytes: what each chip sends over the interconnect per execution, n chips a group:
  all-gather result * (n-1)/n, all-reduce 2 * operand * (n-1)/n (ring), reduce-scatter and
  all-to-all operand * (n-1)/n, collective-permute its operand (see collective_bytes). n from
  replica_groups (see group_size); a collective-permute's group_size is its number of
  source-target pairs. *-start ops and async-start(calls=%c holding one) count once, *-done
  nothing; a collective inside a fusion counts with the fusion's multiplicity.

TPU quirks met in real libtpu output (tests/test_hlo_cost.py parses some):
- matmuls are `convolution`s with dim_labels=bf_io->bf (2-D) or 0bf_io0->0bf / window={size=1}
  (batched), and batched matmuls with small batches as lhs-dilated convolutions
  (window={size=8x2 stride=7x1 lhs_dilate=8x2}: one valid kernel position an output).
- while loops carry no known_trip_count: the bound in the condition gives it.
- collectives run as "async collective fusions": a fusion rooted in custom-call
  AsyncCollectiveStart holds the collective, continuation fusions (compute overlapped with the
  transfer) and a fusion rooted in AsyncCollectiveDone hold copies of it. The copies carry
  backend_config async_collective_fusion_config with flag_start != -1; only the start counts.
- reduce-scatter is a kCustom "all-reduce-scatter" fusion: an all-reduce whose result is only
  dynamic-sliced (emitter AllReduceScatterFusion); counted as a reduce-scatter.
- replica_groups are printed as mesh['axis_0'=4,'axis_1'=1] {'axis_0'}.
- Ironwood (TPU7x) offloads collectives to its SparseCores: `call-start(...),
  async_execution_thread="sparsecore", to_apply=%c` runs %c (rooted in the all-gather) beside
  the TensorCore's work, `call-done` ends it; the call is walked as a call (its collective
  counts once), and the PrepareAsyncCall custom calls around it move nothing.
- memory-space assignment prefetches into VMEM with copy-start / slice-start (counted: the
  result read and written once).
"""
from __future__ import annotations

import dataclasses
import math
import re

# bytes an element (s4/u4 pack two to a byte); token / opaque hold no data
DTYPE_BYTES = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2,
    "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8,
    "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1, "f8e4m3": 1, "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "token": 0,
    "opaque": 0,
}
HOST_MEMORY_SPACE = 5          # S(5): pinned host memory (remat offload), not on chip

# ops that move no bytes of their own (views, plumbing, control flow: their callees count)
FREE_OPS = frozenset({
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
    "partition-id", "replica-id", "opt-barrier", "while", "call", "conditional",
    "add-dependency", "domain", "async-update", "async-done",
})
COLLECTIVES = frozenset({"all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                         "ragged-all-to-all", "collective-permute", "collective-broadcast"})
SLICES = frozenset({"slice", "dynamic-slice", "gather"})
IN_PLACE = frozenset({"dynamic-update-slice", "scatter"})
# custom calls that allocate or annotate: no traffic of their own
FREE_CUSTOM_CALLS = frozenset({"AllocateBuffer", "AssumeGatherIndicesInBound"})


@dataclasses.dataclass(frozen=True)
class HloCost:
    """Per-chip figures of one execution of the program (see the module docstring)."""
    flops: float              # matmul / convolution flops, loop bodies times their trip counts
    hbm_bytes: float          # bytes read + written by top-level ops, times trip counts
    collective_bytes: float   # bytes each chip sends over the interconnect, times trip counts
    # {op, name, shape (result), group_size, bytes (one execution), executions, computation,
    #  group: the first replica group's logical device ids (a permute: its first pair), or None}
    collectives: list[dict]
    loops: list[dict]         # {name, body, trip_count, source, multiplicity}
    custom_calls: list[dict]  # {target, name, computation, executions}: flops not counted
    alt_memory_bytes: float = 0.0   # part of hbm_bytes in on-chip memory spaces (TPU VMEM)
    # each top-level op that moves bytes: {op (a fusion: "fusion:" its root's op), name,
    # shape (result), bytes (one execution), executions, computation}
    memory_ops: list = dataclasses.field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# shapes

@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]
    space: int = 0            # memory space: the layout's S(n)

    @property
    def bytes(self) -> float:
        return DTYPE_BYTES.get(self.dtype, 4) * math.prod(self.dims)


_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\})?")


def parse_shape(text: str):
    """An Array, or a tuple of shapes for a tuple shape ('(f32[2]{0}, /*index=1*/s32[])')."""
    text = re.sub(r"/\*.*?\*/", "", text).strip()
    if text.startswith("("):
        return tuple(parse_shape(part) for part in _split_top(text[1:-1]) if part.strip())
    m = _ARRAY.match(text)
    if not m:
        return ()
    dims = tuple(int(d) if d.isdigit() else 0     # dynamic '<=8': its bound; unbounded '?': 0
                 for d in (x.strip().lstrip("<=") for x in m.group(2).split(",")) if d)
    space = re.search(r"S\((\d+)\)", m.group(3) or "")
    return Array(m.group(1), dims, int(space.group(1)) if space else 0)


def leaves(shape) -> list[Array]:
    """The arrays of a shape, tuples flattened in order."""
    return [shape] if isinstance(shape, Array) else [a for s in shape for a in leaves(s)]


def shape_bytes(shape) -> float:
    return sum(a.bytes for a in leaves(shape))


def _alt_bytes(shape) -> float:
    """The bytes of a shape held in an on-chip memory space (not 0, not host)."""
    return sum(a.bytes for a in leaves(shape) if a.space not in (0, HOST_MEMORY_SPACE))


def _brackets(text: str, start: int = 0):
    """(index, character, depth after it) of text[start:], outside quotes: depth counts the
    (, [ and { open there."""
    depth, quote = 0, False
    for i in range(start, len(text)):
        ch = text[i]
        if ch == '"' and (i == 0 or text[i - 1] != "\\"):
            quote = not quote
        elif not quote:
            depth += (ch in "([{") - (ch in ")]}")
            yield i, ch, depth


def _split_top(text: str, sep: str = ",") -> list[str]:
    """Split at `sep` outside (), [], {} and quotes."""
    out, start = [], 0
    for i, ch, depth in _brackets(text):
        if ch == sep and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    return out


def _close(text: str, i: int) -> int:
    """The index just past the bracket that closes the one at text[i] (quotes skipped)."""
    for j, ch, depth in _brackets(text, i):
        if depth == 0 and ch in ")]}":
            return j + 1
    return len(text)


# ---------------------------------------------------------------------------------------------
# module

@dataclasses.dataclass
class Instr:
    name: str
    shape: object             # Array or tuple
    shape_text: str
    op: str
    operands: list[str]       # operand instruction names
    operand_text: str         # raw text inside op(...) (a constant's value)
    attrs: str                # attributes after the operands, metadata removed
    root: bool

    def attr(self, key: str) -> str | None:
        """A computation-valued attribute (calls=%c), a plain one (direction=LT) or a quoted
        one (custom_call_target="x": unquoted)."""
        m = re.search(r"(?:^|[\s,])" + re.escape(key) + r'=(?:"([^"]*)"|%?([\w.\-]+))',
                      self.attrs)
        return (m.group(1) if m.group(1) is not None else m.group(2)) if m else None

    @property
    def target(self) -> str:
        """A custom call's target."""
        return self.attr("custom_call_target") or ""

    def computations(self, key: str) -> list[str]:
        """A list-valued computation attribute (branch_computations={%a, %b})."""
        m = re.search(r"(?:^|[\s,])" + re.escape(key) + r"=\{([^}]*)\}", self.attrs)
        return re.findall(r"%?([\w.\-]+)", m.group(1)) if m else []


@dataclasses.dataclass
class Computation:
    name: str
    entry: bool
    instrs: list[Instr]
    by_name: dict
    root: Instr | None = None
    _users: dict | None = None
    _params: dict | None = None

    def users(self, name: str) -> list[tuple[Instr, int]]:
        """(user, operand index) of every use of instruction `name` here."""
        if self._users is None:
            self._users = {}
            for ins in self.instrs:
                for k, o in enumerate(ins.operands):
                    self._users.setdefault(o, []).append((ins, k))
        return self._users.get(name, [])

    def param(self, index: int) -> Instr | None:
        """The parameter(index) instruction."""
        if self._params is None:
            self._params = {ins.operand_text.strip(): ins for ins in self.instrs
                            if ins.op == "parameter"}
        return self._params.get(str(index))


_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s+\(.*\{\s*$")
_INSTR = re.compile(r"^\s+(ROOT\s+)?%?([\w.\-]+)\s*=\s*")


def _strip_block(attrs: str, key: str) -> str:
    """attrs without `key={...}` (metadata: its quoted strings may hold anything)."""
    i = attrs.find(key + "={")
    if i < 0:
        return attrs
    return attrs[:i] + attrs[_close(attrs, i + len(key) + 1):]


def parse_instr(line: str) -> Instr | None:
    """One instruction line: `[ROOT] %x = SHAPE op(%a, %b), attr=..., ...`."""
    m = _INSTR.match(line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        end = _close(rest, 0)
    else:
        sp = rest.find(" ")
        end = sp if sp >= 0 else len(rest)
    shape_text, rest = rest[:end], rest[end:]
    om = re.match(r"\s*([a-z][\w\-]*)\(", rest)
    if not om:
        return None
    close = _close(rest, om.end() - 1)
    operand_text = rest[om.end():close - 1]
    attrs = _strip_block(rest[close:], "metadata")
    return Instr(name=m.group(2), shape=parse_shape(shape_text), shape_text=shape_text,
                 op=om.group(1), operands=re.findall(r"%([\w.\-]+)", operand_text),
                 operand_text=operand_text, attrs=attrs, root=bool(m.group(1)))


def _bracket_state(text: str, depth: int = 0, quote: bool = False) -> tuple[int, bool]:
    """(brackets still open, inside a quoted string) after text, from the state given."""
    prev = ""
    for ch in text:
        if ch == '"' and prev != "\\":
            quote = not quote
        elif not quote:
            depth += (ch in "([{") - (ch in ")]}")
        prev = ch
    return depth, quote


def _logical_lines(text: str):
    """The lines of text, an instruction whose attributes hold line breaks (a Mosaic kernel's
    kernel_metadata) joined into one."""
    pending, state = [], (0, False)
    for line in text.splitlines():
        if not pending and (not line.startswith(" ") or
                            sum(map(line.count, "([{")) == sum(map(line.count, ")]}"))):
            yield line                  # a header, a closing brace, a complete instruction
            continue
        pending.append(line)
        state = _bracket_state(line, *state) if len(pending) > 1 else _bracket_state(line)
        if state[0] <= 0 and not state[1]:
            yield "\n".join(pending)
            pending = []
    if pending:
        yield "\n".join(pending)


def parse_module(text: str) -> tuple[dict[str, Computation], str | None, int]:
    """({name: computation}, the entry's name, devices in the program: num_partitions x
    replica_count of the HloModule line)."""
    comps: dict[str, Computation] = {}
    entry, cur, devices = None, None, 1
    for line in _logical_lines(text):
        if line.startswith("HloModule"):
            parts = (re.search(r"num_partitions=(\d+)", line),
                     re.search(r"replica_count=(\d+)", line))
            devices = math.prod(int(p.group(1)) for p in parts if p)
            continue
        if cur is None:
            h = _HEADER.match(line)
            if h:
                cur = Computation(h.group(2), bool(h.group(1)), [], {})
                comps[cur.name] = cur
                entry = cur.name if cur.entry else entry
            continue
        if line.startswith("}"):
            cur = None
            continue
        ins = parse_instr(line)
        if ins is not None:
            cur.instrs.append(ins)
            cur.by_name[ins.name] = ins
            if ins.root:
                cur.root = ins
    for c in comps.values():
        if c.root is None and c.instrs:
            c.root = c.instrs[-1]
    return comps, entry, devices


# ---------------------------------------------------------------------------------------------
# flops

def dot_flops(ins: Instr, comp: Computation) -> float:
    """2 * prod(result dims) * prod(lhs contracting dim sizes)."""
    lhs = comp.by_name.get(ins.operands[0]) if ins.operands else None
    m = re.search(r"lhs_contracting_dims=\{([\d,\s]*)\}", ins.attrs)
    if lhs is None or not isinstance(lhs.shape, Array):
        return 0.0
    k = math.prod(lhs.shape.dims[int(d)] for d in (m.group(1).split(",") if m else []) if d.strip())
    return 2.0 * math.prod(leaves(ins.shape)[0].dims) * k


def _window(attrs: str, n: int) -> dict[str, list]:
    """window={size=3x3 stride=2x1 pad=1_1x0_0 lhs_dilate=.. rhs_dilate=..} per spatial dim."""
    m = re.search(r"window=\{([^}]*)\}", attrs)
    fields = dict(kv.split("=", 1) for kv in (m.group(1).split() if m else []) if "=" in kv)

    def get(key, default):
        return [(tuple(int(v) for v in x.split("_")) if "_" in x else int(x))
                for x in fields[key].split("x")] if key in fields else [default] * n
    return {"size": get("size", 1), "stride": get("stride", 1), "pad": get("pad", (0, 0)),
            "lhs_dilate": get("lhs_dilate", 1), "rhs_dilate": get("rhs_dilate", 1)}


def _valid_positions(in_size, out_size, size, stride, pad_low, lhs_dilate, rhs_dilate) -> int:
    """Sum over output positions o of the kernel positions k whose input position
    p = o * stride + k * rhs_dilate - pad_low lands on real input (0 <= p <= (in - 1) *
    lhs_dilate, p a multiple of lhs_dilate: not padding, not a dilation hole), as XLA counts
    one spatial dimension."""
    last, total = (in_size - 1) * lhs_dilate, 0
    for k in range(size):
        c = k * rhs_dilate - pad_low
        lo, hi = max(0, -(c // stride)), min(out_size - 1, (last - c) // stride)  # 0<=p<=last
        if lhs_dilate == 1:
            total += max(hi - lo + 1, 0)
        elif (hi - lo) * size > 4_000_000:   # too long to count exactly: every position
            total += max(hi - lo + 1, 0)
        else:
            total += sum((o * stride + c) % lhs_dilate == 0 for o in range(lo, hi + 1))
    return total


def conv_flops(ins: Instr, comp: Computation) -> float:
    """2 * output batch * output features * kernel input features * prod over spatial dims of
    the valid kernel positions summed over output positions (dim_labels lhs_rhs->out: b/f
    batch/feature, i/o kernel input/output feature, digits spatial dims)."""
    m = re.search(r"dim_labels=([\w]+)_([\w]+)->([\w]+)", ins.attrs)
    ops = [comp.by_name.get(o) for o in ins.operands[:2]]
    if not m or None in ops:
        return 0.0
    lhs_l, rhs_l, out_l = m.groups()
    lhs, rhs, out = ops[0].shape, ops[1].shape, leaves(ins.shape)[0]
    spatial = sorted(c for c in out_l if c.isdigit())
    w = _window(ins.attrs, len(spatial))
    valid = 1
    for d, c in enumerate(spatial):
        pad = w["pad"][d] if isinstance(w["pad"][d], tuple) else (w["pad"][d], 0)
        valid *= _valid_positions(lhs.dims[lhs_l.index(c)], out.dims[out_l.index(c)],
                                  w["size"][d], w["stride"][d], pad[0], w["lhs_dilate"][d],
                                  w["rhs_dilate"][d])
    return (2.0 * out.dims[out_l.index("b")] * out.dims[out_l.index("f")]
            * rhs.dims[rhs_l.index("i")] * valid)


# ---------------------------------------------------------------------------------------------
# collectives

def group_size(attrs: str, devices: int) -> int:
    """Chips a replica group: replica_groups={{0,1,2,3},...} (the first group's length),
    [G,S]<=[N] or [G,S]<=[a,b]T(1,0) (iota form: S), mesh['x'=4,'y'=2] {'x'} or
    mesh[...], device_ids=(...) {'x'} (the named axes' product), {} or absent (every chip of
    the program)."""
    m = re.search(r"replica_groups=\{\{([^}]*)\}", attrs)
    if m:
        return len([x for x in m.group(1).split(",") if x.strip()])
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", attrs)
    if m:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        return math.prod(sizes.get(a, 1) for a in re.findall(r"'([^']+)'", m.group(2)))
    return devices


def _iota(text: str) -> list[int] | None:
    """The ids of an iota tile assignment: `[a,b,...]` (0..prod-1 in order) or
    `[a,b,...]T(p,q,...)` (reshaped to [a,b,...], transposed by the permutation, flattened)."""
    m = re.fullmatch(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", text)
    if not m:
        return None
    dims = [int(x) for x in m.group(1).split(",")]
    perm = [int(x) for x in m.group(2).split(",")] if m.group(2) else list(range(len(dims)))
    if sorted(perm) != list(range(len(dims))):
        return None
    strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]
    pd, ps = [dims[p] for p in perm], [strides[p] for p in perm]
    out = []
    for flat in range(math.prod(dims)):
        rest, idx = flat, 0
        for d, st in zip(reversed(pd), reversed(ps)):
            idx += (rest % d) * st
            rest //= d
        out.append(idx)
    return out


def replica_groups(attrs: str, devices: int) -> list[list[int]] | None:
    """The chips (the program's logical device ids) of every replica group, in the forms
    group_size reads; a collective-permute's source_target_pairs as [source, target] pairs.
    None for a form not understood (the caller then knows only the group's size)."""
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
    if m:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
    m = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}", attrs)
    if m:
        groups = [[int(x) for x in g.split(",") if x.strip()]
                  for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
        return [g for g in groups if g] or [list(range(devices))]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=(\[[\d,]+\](?:T\([\d,]+\))?)", attrs)
    if m:
        ids, count, size = _iota(m.group(3)), int(m.group(1)), int(m.group(2))
        if ids is None or len(ids) != count * size:
            return None
        return [ids[i:i + size] for i in range(0, len(ids), size)]
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](.*?)\{([^}]*)\}", attrs)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, dims = [a for a, _ in axes], [int(n) for _, n in axes]
        ids = list(range(math.prod(dims)))
        dev = re.search(r"device_ids=\(([^)]*\)?)\)", m.group(2))
        if dev:
            text = dev.group(1)
            ids = _iota(text) if "[" in text else [int(x) for x in text.split(",") if x.strip()]
            if ids is None or len(ids) != math.prod(dims):
                return None
        grouped = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3)) if a in names]
        others = [i for i in range(len(dims)) if i not in grouped]
        strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]

        def combos(axes_):
            out = [0]
            for a in axes_:
                out = [o + k * strides[a] for o in out for k in range(dims[a])]
            return out
        return [[ids[base + off] for off in combos(grouped)] for base in combos(others)]
    if "replica_groups" not in attrs or re.search(r"replica_groups=\{\s*\}", attrs):
        return [list(range(devices))]
    return None


def collective_bytes(op: str, operand_bytes: float, n: int) -> float:
    """Bytes a chip sends (= receives) for one execution, its group of n chips, by ring:
    all-gather operand * (n-1) (= result * (n-1)/n); all-reduce 2 * operand * (n-1)/n
    (reduce-scatter then all-gather); reduce-scatter, all-to-all operand * (n-1)/n;
    collective-permute / -broadcast operand."""
    if op in ("collective-permute", "collective-broadcast"):
        return operand_bytes
    if n <= 1:
        return 0.0
    if op == "all-gather":
        return operand_bytes * (n - 1)
    if op == "all-reduce":
        return 2.0 * operand_bytes * (n - 1) / n
    return operand_bytes * (n - 1) / n


def _collective_op(op: str) -> str | None:
    """The collective an op is ('all-gather-start' -> 'all-gather'), else None."""
    base = op[:-len("-start")] if op.endswith("-start") else op
    return base if base in COLLECTIVES else None


# ---------------------------------------------------------------------------------------------
# the walk

@dataclasses.dataclass
class _Acc:
    flops: float = 0.0
    hbm: float = 0.0
    alt: float = 0.0
    coll: float = 0.0
    collectives: list = dataclasses.field(default_factory=list)
    loops: list = dataclasses.field(default_factory=list)
    custom_calls: list = dataclasses.field(default_factory=list)
    memory_ops: list = dataclasses.field(default_factory=list)

    def add(self, other: "_Acc"):
        self.flops += other.flops
        self.hbm += other.hbm
        self.alt += other.alt
        self.coll += other.coll
        self.collectives += other.collectives
        self.loops += other.loops
        self.custom_calls += other.custom_calls
        self.memory_ops += other.memory_ops

    def mem(self, nbytes: float, alt: float, mult: float, comp=None, ins=None, op=None):
        self.hbm += nbytes * mult
        self.alt += alt * mult
        if ins is not None and nbytes:
            self.memory_ops.append({"op": op or ins.op, "name": ins.name,
                                    "shape": ins.shape_text, "bytes": nbytes,
                                    "executions": mult, "computation": comp.name})


def _source(comp: Computation, name: str, through=("bitcast",)) -> Instr | None:
    """The instruction `name` is a view of (followed back through `through` ops)."""
    ins = comp.by_name.get(name)
    while ins is not None and ins.op in through and ins.operands:
        ins = comp.by_name.get(ins.operands[0])
    return ins


class _Walker:
    def __init__(self, text: str):
        self.comps, self.entry, self.devices = parse_module(text)

    def run(self) -> HloCost:
        acc = _Acc()
        if self.entry is not None:
            self.walk(self.comps[self.entry], 1.0, acc, [])
        return HloCost(flops=acc.flops, hbm_bytes=acc.hbm, collective_bytes=acc.coll,
                       collectives=acc.collectives, loops=acc.loops,
                       custom_calls=acc.custom_calls, alt_memory_bytes=acc.alt,
                       memory_ops=acc.memory_ops)

    # -- computations that run on their own: bytes at each instruction -----------------------
    def walk(self, comp: Computation, mult: float, acc: _Acc, callers: list):
        """callers: [(computation, instruction)] that called this one (to map parameters)."""
        for ins in comp.instrs:
            self.visit(comp, ins, mult, acc, callers)

    def visit(self, comp, ins: Instr, mult: float, acc: _Acc, callers: list):
        op = ins.op
        here = (callers + [(comp, ins)] if op in ("call", "async-start", "call-start",
                                                  "conditional") else None)
        called = self.comps.get(ins.attr("to_apply" if op in ("call", "call-start")
                                         else "calls") or "")
        if op == "while":
            self.loop(comp, ins, mult, acc, callers)
        elif op in ("call", "async-start", "call-start") and called is not None:
            self.walk(called, mult, acc, here)
        elif op == "conditional":
            self.conditional(ins, mult, acc, here)
        elif _collective_op(op):
            self.collective(comp, ins, _collective_op(op), mult, acc)
        elif op in FREE_OPS or op.endswith("-done"):
            pass
        elif op == "fusion" and called is not None:
            root = called.root
            acc.mem(*self.fusion_bytes(comp, ins, called), mult, comp, ins,
                    "fusion:" + (root.op if root is not None else "?"))
            self.walk_fused(called, mult, acc)
        elif op.endswith("-start"):              # copy-start, slice-start: prefetches
            acc.mem(*self.async_bytes(comp, ins), mult, comp, ins)
        else:
            if op == "custom-call":
                self.custom_call(comp, ins, mult, acc)
                if ins.target in FREE_CUSTOM_CALLS:
                    return
            acc.mem(*self.plain_bytes(comp, ins), mult, comp, ins)
            acc.flops += self.flops(comp, ins) * mult

    def loop(self, comp, ins: Instr, mult: float, acc: _Acc, callers: list):
        """Body x n, condition x (n + 1)."""
        n, source = self.trip_count(comp, ins, callers)
        acc.loops.append({"name": ins.name, "body": ins.attr("body"), "trip_count": n,
                          "source": source, "multiplicity": mult})
        here = callers + [(comp, ins)]
        for key, times in (("condition", n + 1), ("body", n)):
            if ins.attr(key) in self.comps:
                self.walk(self.comps[ins.attr(key)], mult * times, acc, here)

    def conditional(self, ins: Instr, mult: float, acc: _Acc, here: list):
        """One branch runs: the costliest (flops, then bytes), each walked once."""
        names = ins.computations("branch_computations") or [
            n for n in (ins.attr("true_computation"), ins.attr("false_computation")) if n]
        best = None
        for name in (n for n in names if n in self.comps):
            sub = _Acc()
            self.walk(self.comps[name], mult, sub, here)
            if best is None or (sub.flops, sub.hbm + sub.coll) > (best.flops, best.hbm + best.coll):
                best = sub
        if best is not None:
            acc.add(best)

    # -- fused computations: flops and collectives inside, bytes at the fusion ---------------
    def walk_fused(self, comp: Computation, mult: float, acc: _Acc):
        for ins in comp.instrs:
            called = self.comps.get(ins.attr("calls") or ins.attr("to_apply") or "")
            if ins.op in ("fusion", "call") and called is not None:
                self.walk_fused(called, mult, acc)
            elif _collective_op(ins.op):
                if self.counts_in_fusion(comp, ins):
                    op = _collective_op(ins.op)
                    if op == "all-reduce" and self.only_sliced(comp, ins):
                        op = "reduce-scatter"      # TPU's all-reduce-scatter fusion
                    self.collective(comp, ins, op, mult, acc)
            elif ins.op == "custom-call":
                self.custom_call(comp, ins, mult, acc)
            else:
                acc.flops += self.flops(comp, ins) * mult

    @staticmethod
    def counts_in_fusion(comp: Computation, ins: Instr) -> bool:
        """A TPU async collective is printed in its start fusion (root custom-call
        AsyncCollectiveStart), again in each continuation fusion and in its done fusion (those
        copies carry async_collective_fusion_config flag_start != -1): count the start."""
        if '"async_collective_fusion_config"' not in ins.attrs:
            return True
        root = comp.root
        return (root is not None and root.op == "custom-call"
                and root.target == "AsyncCollectiveStart") or '"flag_start":"-1"' in ins.attrs

    @staticmethod
    def only_sliced(comp: Computation, ins: Instr) -> bool:
        """Every use of the all-reduce's result (through get-tuple-element) is a dynamic-slice:
        each chip keeps its shard, a reduce-scatter."""
        uses = comp.users(ins.name)
        for user, _ in uses:
            if user.op == "get-tuple-element":
                if not all(u.op == "dynamic-slice" for u, _ in comp.users(user.name)):
                    return False
            elif user.op != "dynamic-slice":
                return False
        return bool(uses)

    def collective(self, comp, ins: Instr, op: str, mult: float, acc: _Acc):
        operand = sum(shape_bytes(comp.by_name[o].shape) for o in ins.operands
                      if o in comp.by_name)
        if op in ("collective-permute", "collective-broadcast"):
            n = len(re.findall(r"\{\d+,\d+\}", ins.attrs)) or None
        else:
            n = group_size(ins.attrs, self.devices)
        b = collective_bytes(op, operand, n or 1)
        acc.coll += b * mult
        groups = replica_groups(ins.attrs, self.devices)
        acc.collectives.append({"op": op, "name": ins.name, "shape": ins.shape_text,
                                "group_size": n, "bytes": b, "executions": mult,
                                "computation": comp.name,
                                "group": groups[0] if groups else None})

    def custom_call(self, comp, ins: Instr, mult: float, acc: _Acc):
        acc.custom_calls.append({"target": ins.target,
                                 "name": ins.name, "computation": comp.name,
                                 "executions": mult})

    def flops(self, comp, ins: Instr) -> float:
        if ins.op == "dot":
            return dot_flops(ins, comp)
        if ins.op == "convolution":
            return conv_flops(ins, comp)
        return 0.0

    # -- bytes ---------------------------------------------------------------------------------
    @staticmethod
    def _operand(comp, name):
        o = comp.by_name.get(name)
        return o.shape if o is not None else ()

    def plain_bytes(self, comp, ins: Instr) -> tuple[float, float]:
        """Operands + output; a slice's source counts what it outputs; an in-place update's
        buffer and output count the update."""
        out = ins.shape
        total, alt = shape_bytes(out), _alt_bytes(out)
        update = self.update_bytes(comp, ins) if ins.op in IN_PLACE else None
        if update is not None:
            total, alt = update, update if _alt_bytes(out) else 0.0
        for k, o in enumerate(ins.operands):
            s = self._operand(comp, o)
            if k == 0 and ins.op in SLICES:
                b = shape_bytes(out)
                total, alt = total + b, alt + (b if _alt_bytes(s) else 0.0)
            elif k == 0 and update is not None:
                total, alt = total + update, alt + (update if _alt_bytes(s) else 0.0)
            else:
                total, alt = total + shape_bytes(s), alt + _alt_bytes(s)
        return total, alt

    def update_bytes(self, comp, ins: Instr) -> float:
        """The update of a dynamic-update-slice (operand 1) or scatter (its last operands)."""
        if ins.op == "dynamic-update-slice":
            return shape_bytes(self._operand(comp, ins.operands[1]))
        k = len(ins.operands) // 2              # scatter(buffers.., indices, updates..)
        return sum(shape_bytes(self._operand(comp, o)) for o in ins.operands[k + 1:])

    def async_bytes(self, comp, ins: Instr) -> tuple[float, float]:
        """copy-start / slice-start / dynamic-(update-)slice-start (memory-space moves): what
        moves (a slice's result, an update's update) read once from its source and written
        once to its destination, each side only where it is not host memory (remat offload:
        the host side of the move is not HBM traffic)."""
        if ins.op == "dynamic-update-slice-start" and len(ins.operands) > 1:
            src = self._operand(comp, ins.operands[1])
            dst = self._operand(comp, ins.operands[0])
            moved = src
        else:
            done = [u for u, _ in comp.users(ins.name) if u.op.endswith("-done")]
            moved = done[0].shape if done else (leaves(ins.shape) or [()])[0]
            src = self._operand(comp, ins.operands[0]) if ins.operands else ()
            dst = moved
        b = shape_bytes(moved)

        def side(shape):
            arrays = leaves(shape)
            return 0.0 if arrays and all(a.space == HOST_MEMORY_SPACE for a in arrays) else b
        return side(src) + side(dst), (b if _alt_bytes(dst) else 0.0) + (
            b if _alt_bytes(src) else 0.0)

    def fusion_bytes(self, comp, ins: Instr, called: Computation) -> tuple[float, float]:
        """Each operand as its fused parameter is used (param_bytes), plus each output element
        (output_bytes). A fusion holding an async collective's start or done moves only the
        collective's bytes (collective_bytes)."""
        root = called.root
        if root is not None and root.op == "custom-call" and \
                root.target.startswith("AsyncCollective"):
            return 0.0, 0.0
        total = alt = 0.0
        for k, o in enumerate(ins.operands):
            s = self._operand(comp, o)
            p = called.param(k)
            b = shape_bytes(s) if p is None else self.param_bytes(called, p, shape_bytes(s))
            total, alt = total + b, alt + (b if _alt_bytes(s) else 0.0)
        b, a = self.output_bytes(called, ins.shape)
        return total + b, alt + a

    def param_bytes(self, comp: Computation, p: Instr, full: float) -> float:
        """What a fusion reads of operand `p`: the outputs of the slices it feeds, the updates
        of the in-place updates it is the buffer of, what a nested fusion it feeds reads of it
        (the same rules, inside), nothing where it only passes to the output or into a
        collective; else all of it."""
        total, todo = 0.0, [p]
        while todo:
            cur = todo.pop()
            for user, k in comp.users(cur.name):
                if user.op == "bitcast":
                    todo.append(user)
                elif user.op in SLICES and k == 0:
                    total += shape_bytes(user.shape)
                elif user.op in IN_PLACE and k == 0:
                    total += self.update_bytes(comp, user)
                elif user.op == "fusion" and user.attr("calls") in self.comps:
                    # a nested fusion (TPU: the layer's weight slice fused into its matmul's
                    # operand): what that fusion reads of its parameter
                    inner = self.comps[user.attr("calls")]
                    q = inner.param(k)
                    if q is None:
                        return full
                    if self.is_view(inner, q):     # a bitcast of it is that fusion's result
                        todo.append(user)
                    else:
                        total += self.param_bytes(inner, q, full)
                elif user.op == "tuple" and user.root:
                    pass                         # passed through to the output: aliased
                elif _collective_op(user.op) or (
                        user.op == "custom-call" and user.target.startswith("AsyncCollective")):
                    pass                         # the collective's bytes
                else:
                    return full
        return min(total, full)

    @staticmethod
    def is_view(comp: Computation, p: Instr) -> bool:
        """comp's root is `p`, a bitcast of it, or a copy of it (a nested fusion that only
        reinterprets p, or changes its layout: libtpu for Ironwood relayouts a layer scan's
        stacked weights in a nested copy fusion whose result is then sliced; inside the
        outer fusion nothing is materialized, and only what the slice takes is read)."""
        root = _source(comp, comp.root.name) if comp.root is not None else None
        if root is not None and root.op == "copy" and root.operands:
            root = _source(comp, root.operands[0])
        return root is not None and root.name == p.name

    def output_bytes(self, comp: Computation, shape) -> tuple[float, float]:
        """Bytes a fusion writes: each element of its root (a tuple's elements), except a
        fused parameter passed through (aliased) and a collective's result; an in-place update
        of a fused parameter writes its update."""
        root = comp.root
        if root is None:
            return shape_bytes(shape), _alt_bytes(shape)
        elems = root.operands if root.op == "tuple" else [root.name]
        outs = list(shape) if root.op == "tuple" and isinstance(shape, tuple) else [shape]
        total = alt = 0.0
        for name, out in zip(elems, outs):
            src = _source(comp, name)
            if src is None or src.op == "parameter":
                continue
            if src.op in IN_PLACE:
                buf = _source(comp, src.operands[0])
                b = self.update_bytes(comp, src) if buf is not None and buf.op == "parameter" \
                    else shape_bytes(out)
            elif self.from_collective(comp, src):
                continue
            else:
                b = shape_bytes(out)
            total, alt = total + b, alt + (b if _alt_bytes(out) else 0.0)
        return total, alt

    @staticmethod
    def from_collective(comp: Computation, ins: Instr) -> bool:
        """ins is a collective's result or a view / slice of one."""
        while ins is not None:
            if _collective_op(ins.op):
                return True
            if ins.op not in ("bitcast", "get-tuple-element", "dynamic-slice", "copy") \
                    or not ins.operands:
                return False
            ins = comp.by_name.get(ins.operands[0])
        return False

    # -- trip counts ---------------------------------------------------------------------------
    def trip_count(self, comp, ins: Instr, callers: list) -> tuple[int, str]:
        """(n, source): known_trip_count, else the condition's bound, else (1, "unknown").
        Bound: for `i < K` (exclusive; `i <= K` is K + 1, `i != K` is K) with i starting at
        init and stepping by s > 0, ceil((K - init) / s); for `i > K` stepping down by s,
        ceil((init - K) / s). init: the constant the while's operand starts i at, else 0 for
        an upward loop (our loops count from 0); s: the constant the body adds to i, else 1.
        Several bounds (`(i < K) & ~done`): the least."""
        m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
        if m:
            return int(m.group(1)), "known_trip_count"
        cond, body = self.comps.get(ins.attr("condition")), self.comps.get(ins.attr("body"))
        n = None
        for index, k, upward in (self.bounds(cond, []) if cond is not None else []):
            init = self.initial(comp, ins.operands[0], index, callers) if ins.operands else None
            step = (self.step(body, index) if body is not None else None) or (1 if upward else -1)
            if upward and step > 0:
                trips = -(-(k - (init or 0)) // step)
            elif not upward and step < 0 and init is not None:
                trips = -(-(init - k) // -step)
            else:
                continue
            n = max(trips, 0) if n is None else min(n, max(trips, 0))
        return (1, "unknown") if n is None else (n, "bound")

    def bounds(self, comp: Computation, chain: list) -> list[tuple[int, int, bool]]:
        """[(tuple index of the loop variable i, K, upward)]: the compares in `comp` (and in
        the fusions it calls; chain: [(caller, fusion)] to map their parameters) of a
        loop-carried integer with a constant, as exclusive bounds: i < K (upward) or i > K."""
        out = []
        for ins in comp.instrs:
            if ins.op == "fusion" and ins.attr("calls") in self.comps:
                out += self.bounds(self.comps[ins.attr("calls")], chain + [(comp, ins)])
            elif ins.op == "compare" and len(ins.operands) == 2:
                a, b = (self.resolve(comp, o, chain) for o in ins.operands)
                d = ins.attr("direction")
                if a and b and a[0] == "const":  # K > i  ==  i < K
                    a, b, d = b, a, {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(d, d)
                if not (a and b and a[0] == "gte" and b[0] == "const"):
                    continue
                k = b[1]
                if d in ("LT", "LE", "NE"):
                    out.append((a[1], k + (d == "LE"), True))
                elif d in ("GT", "GE"):
                    out.append((a[1], k - (d == "GE"), False))
        return out

    def step(self, body: Computation, index: int) -> int | None:
        """The constant c of the body's `i + c` for loop-state element `index` (an add in the
        body's root tuple, maybe inside a fusion), else None."""
        root = body.root
        if root is None or root.op != "tuple" or index >= len(root.operands):
            return None
        comp, name, chain = body, root.operands[index], []
        ins = _source(comp, name, ("bitcast", "copy", "convert"))
        while ins is not None and ins.op == "fusion" and ins.attr("calls") in self.comps:
            chain = chain + [(comp, ins)]
            comp = self.comps[ins.attr("calls")]
            ins = _source(comp, comp.root.name, ("bitcast", "copy", "convert")) if comp.root \
                else None
        if ins is None or ins.op not in ("add", "subtract") or len(ins.operands) != 2:
            return None
        a, b = (self.resolve(comp, o, chain) for o in ins.operands)
        if ins.op == "add" and a and a[0] == "const":
            a, b = b, a
        if a == ("gte", index) and b and b[0] == "const":
            return b[1] if ins.op == "add" else -b[1]
        return None

    def resolve(self, comp: Computation, name: str, chain: list):
        """("const", K) for an integer constant, ("gte", i) for element i of the condition's
        parameter (the loop state), through copy / convert / bitcast / fusion parameters."""
        ins = comp.by_name.get(name)
        while ins is not None and ins.op in ("copy", "convert", "bitcast", "reshape"):
            ins = comp.by_name.get(ins.operands[0]) if ins.operands else None
        if ins is None:
            return None
        if ins.op == "constant":
            try:
                return "const", int(ins.operand_text.strip())
            except ValueError:
                return None
        if ins.op == "get-tuple-element":
            src = comp.by_name.get(ins.operands[0])
            if src is not None and src.op == "parameter" and not chain:
                return "gte", int(ins.attr("index"))
        if ins.op == "parameter" and chain:
            caller, fusion = chain[-1]
            k = int(ins.operand_text.strip())
            return self.resolve(caller, fusion.operands[k], chain[:-1]) \
                if k < len(fusion.operands) else None
        return None

    def initial(self, comp: Computation, name: str, index: int, callers: list) -> int | None:
        """The constant initial value of element `index` of the loop state `name`, where the
        while's operand is a tuple() of it (through call parameters), else None."""
        ins = comp.by_name.get(name)
        if ins is None:
            return None
        if ins.op == "tuple" and index < len(ins.operands):
            v = self.resolve(comp, ins.operands[index], [])
            return v[1] if v and v[0] == "const" else None
        if ins.op == "parameter" and callers:
            caller, call = callers[-1]
            k = int(ins.operand_text.strip())
            if call.op in ("call", "async-start") and k < len(call.operands):
                return self.initial(caller, call.operands[k], index, callers[:-1])
        return None


def hlo_cost(hlo_text: str) -> HloCost:
    """The per-chip cost of the program of optimized HLO text (compiled.as_text()): see the
    module docstring for what is counted and how."""
    return _Walker(hlo_text).run()
