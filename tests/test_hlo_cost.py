"""supo_jax.hlo_cost: flops, HBM bytes and interconnect bytes of compiled programs, read from
their optimized HLO, every loop body counted as many times as it runs.

Programs are compiled for the CPU (its devices named explicitly, so that a GPU machine compiles
the same HLO) and, where libtpu is installed, for the chips of a v5litepod-4 (compile only:
supo_jax.plan.tpu_devices), whose HLO differs (matmuls as convolutions, no known_trip_count,
async collective fusions)."""
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from supo_jax.hlo_cost import collective_bytes, group_size, hlo_cost, parse_instr, parse_shape

pytestmark = pytest.mark.xdist_group("hlo_cost")

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed: no TPU to compile for")
CPU = SingleDeviceSharding(jax.devices("cpu")[0])


def _sds(shape, dtype=jnp.float32, sharding=CPU):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _compile(f, *args, **jit_kwargs):
    return jax.jit(f, **jit_kwargs).lower(*args).compile()


def _xla(compiled) -> dict:
    cost = compiled.cost_analysis()
    return cost[0] if isinstance(cost, (list, tuple)) else cost


def _scan_matmuls(x, ws):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]


# -- loops ----------------------------------------------------------------------------------------

def test_scan_flops_count_every_iteration():
    """12 layers of [64,256] x [256,256]: 12 matmuls' flops, where XLA's cost analysis counts
    the loop body once (and a 1-step scan gives one matmul: the ratio is the trip count)."""
    one = 2 * 64 * 256 * 256
    c12 = _compile(_scan_matmuls, _sds((64, 256)), _sds((12, 256, 256)))
    c1 = _compile(_scan_matmuls, _sds((64, 256)), _sds((1, 256, 256)))
    cost, cost1 = hlo_cost(c12.as_text()), hlo_cost(c1.as_text())
    assert cost.flops == pytest.approx(12 * one, rel=0.01)
    assert cost1.flops == pytest.approx(one, rel=0.01)
    assert cost.flops / cost1.flops == pytest.approx(12, rel=1e-6)
    assert cost.loops[0]["trip_count"] == 12 and cost.loops[0]["multiplicity"] == 1
    assert cost.loops[0]["source"] == "known_trip_count"          # the CPU emits it
    assert _xla(c12)["flops"] == pytest.approx(one, rel=0.01)      # what this module fixes


def test_the_condition_bound_gives_the_trip_count_without_known_trip_count():
    """With backend_config's known_trip_count removed (TPU never prints it) the condition's
    `i < 12` gives the same count."""
    text = _compile(_scan_matmuls, _sds((64, 256)), _sds((12, 256, 256))).as_text()
    stripped = re.sub(r'"known_trip_count":\{"n":"\d+"\}', "", text)
    assert stripped != text
    cost = hlo_cost(stripped)
    assert (cost.loops[0]["trip_count"], cost.loops[0]["source"]) == (12, "bound")
    assert cost.flops == pytest.approx(12 * 2 * 64 * 256 * 256, rel=0.01)


def test_data_dependent_while_is_bounded_by_its_condition():
    """cond (i < 10) & ~done, done data-dependent (the decode's loop): no known trip count;
    the bound 10 is taken, source "bound"; the condition runs once more than the body."""
    def f(x, w):
        def cond(s):
            i, _, done = s
            return (i < 10) & ~done
        def body(s):
            i, h, _ = s
            h = jnp.tanh(h @ w)
            return i + 1, h, jnp.all(h > 0.5)
        return jax.lax.while_loop(cond, body, (0, x, False))[1]

    cost = hlo_cost(_compile(f, _sds((32, 128)), _sds((128, 128))).as_text())
    assert [(lp["trip_count"], lp["source"]) for lp in cost.loops] == [(10, "bound")]
    assert cost.flops == pytest.approx(10 * 2 * 32 * 128 * 128, rel=0.01)


def test_bound_with_a_start_a_step_and_a_downward_count():
    """i from 3 while i <= 10 (8 trips); i += 2 while i < 10 (5); i from 7 down while i > 0
    (7): init, step and direction read from the HLO (known_trip_count removed)."""
    def loop(init, cond, step):
        return lambda x: jax.lax.while_loop(
            lambda s: cond(s[0]), lambda s: (s[0] + step, s[1] @ s[1] * 0.5), (init, x))[1]

    for f, n in ((loop(3, lambda i: i <= 10, 1), 8), (loop(0, lambda i: i < 10, 2), 5),
                 (loop(7, lambda i: i > 0, -1), 7)):
        text = _compile(f, _sds((32, 32))).as_text()
        cost = hlo_cost(re.sub(r'"known_trip_count":\{"n":"\d+"\}', "", text))
        assert [(lp["trip_count"], lp["source"]) for lp in cost.loops] == [(n, "bound")]
        assert cost.flops == pytest.approx(n * 2 * 32 ** 3, rel=0.01)


def test_nested_loops_multiply():
    """A scan of 3 inside a scan of 5: the inner body runs 15 times."""
    def f(x, ws):
        def outer(h, _):
            return _scan_matmuls(h, ws) * 0.5, None
        return jax.lax.scan(outer, x, None, length=5)[0]

    cost = hlo_cost(_compile(f, _sds((16, 128)), _sds((3, 128, 128))).as_text())
    assert cost.flops == pytest.approx(15 * 2 * 16 * 128 * 128, rel=0.01)
    loops = sorted((lp["trip_count"], lp["multiplicity"]) for lp in cost.loops)
    assert loops == [(3, 5), (5, 1)]


# -- HBM bytes ------------------------------------------------------------------------------------

def test_loop_free_bytes_agree_with_xla():
    """Elementwise + matmuls without loops: XLA's own "bytes accessed" (within 2x; on the CPU
    they agree exactly) and its matmul flops."""
    def f(x, w, v):
        return (jax.nn.gelu(x @ w) @ v + 1.0).sum(0)

    c = _compile(f, _sds((64, 256)), _sds((256, 512)), _sds((512, 128)))
    cost, xla = hlo_cost(c.as_text()), _xla(c)
    assert 0.5 < cost.hbm_bytes / xla["bytes accessed"] < 2
    assert cost.flops == pytest.approx(2 * 64 * 256 * 512 + 2 * 64 * 512 * 128, rel=1e-6)
    assert cost.flops == pytest.approx(xla["flops"], rel=0.02)     # XLA adds elementwise ops
    assert cost.collective_bytes == 0 and cost.collectives == []


def test_convolution_flops_count_valid_window_positions():
    """Padding, strides and dilations: XLA's flops exactly (only the convolution has flops)."""
    def f(x, k):
        return jax.lax.conv_general_dilated(x, k, (2, 2), ((1, 2), (0, 1)), lhs_dilation=(1, 2),
                                            rhs_dilation=(2, 1),
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    c = _compile(f, _sds((2, 16, 16, 8)), _sds((3, 3, 8, 32)))
    assert hlo_cost(c.as_text()).flops == pytest.approx(_xla(c)["flops"], rel=1e-6)


def test_layer_scan_reads_one_layer_of_stacked_weights_an_iteration():
    """A scan over [L, d, d] weights dynamic-slices one layer an iteration: ~L*d*d*4 bytes of
    weights in all (the slice read, written, read by the matmul), not L*L*d*d*4."""
    L, d = 8, 512
    weights = L * d * d * 4
    cost = hlo_cost(_compile(_scan_matmuls, _sds((8, d)), _sds((L, d, d))).as_text())
    assert weights <= cost.hbm_bytes < 4 * weights < L * weights


def test_decode_writes_one_token_an_iteration_into_a_donated_cache():
    """64 steps each writing one [8,128] row into a donated [512,8,128] cache: the update's
    bytes an iteration (read, write), not the whole cache's."""
    S, H, D, steps = 512, 8, 128, 64

    def decode(cache, tok):
        return jax.lax.fori_loop(0, steps, lambda i, c: jax.lax.dynamic_update_slice(
            c, (tok * i)[None], (i, 0, 0)), cache)

    token, cache = H * D * 4, S * H * D * 4
    cost = hlo_cost(_compile(decode, _sds((S, H, D)), _sds((H, D)),
                             donate_argnums=(0,)).as_text())
    assert steps * 2 * token <= cost.hbm_bytes < steps * 4 * token < cache
    copied = hlo_cost(_compile(decode, _sds((S, H, D)), _sds((H, D))).as_text())
    assert copied.hbm_bytes >= 2 * cache      # not donated: XLA copies the cache once


# -- collectives ----------------------------------------------------------------------------------

def _collective_programs(mesh, n):
    """{name: (jitted function, argument, expected bytes a chip sends)} over mesh axis x."""
    rows = 64                       # each chip's shard of the [n*64, 256] f32 input
    shard = rows * 256 * 4
    x = jax.ShapeDtypeStruct((n * rows, 256), jnp.float32, sharding=NamedSharding(mesh, P("x")))

    def sm(f, out):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=out))

    return {
        "all-gather": (jax.jit(lambda a: a * 2, out_shardings=NamedSharding(mesh, P())), x,
                       n * shard * (n - 1) / n),                          # result * (n-1)/n
        "all-reduce": (sm(lambda a: jax.lax.psum(a, "x"), P()), x, 2 * shard * (n - 1) / n),
        "reduce-scatter": (sm(lambda a: jax.lax.psum_scatter(a, "x", tiled=True), P("x")), x,
                           shard * (n - 1) / n),
        "all-to-all": (sm(lambda a: jax.lax.all_to_all(a, "x", 0, 0, tiled=True), P("x")), x,
                       shard * (n - 1) / n),
        "collective-permute": (sm(lambda a: jax.lax.ppermute(
            a, "x", [(i, (i + 1) % n) for i in range(n)]), P("x")), x, shard),
    }


def _check_collectives(mesh, n):
    for op, (f, x, want) in _collective_programs(mesh, n).items():
        cost = hlo_cost(f.lower(x).compile().as_text())
        assert [c["op"] for c in cost.collectives] == [op], (op, cost.collectives)
        c = cost.collectives[0]
        assert c["bytes"] == pytest.approx(want) and c["executions"] == 1
        assert c["group_size"] == n
        assert cost.collective_bytes == pytest.approx(want), op


def test_collective_bytes_on_8_cpu_devices():
    _check_collectives(Mesh(np.array(jax.devices("cpu")[:8]), ("x",)), 8)


def test_collectives_over_one_axis_of_a_2d_mesh():
    """psum over a of a 2x4 mesh: groups of 2 ({{0,4},...}); the all-gather of b: groups of 4
    (TPU-style mesh[...], device_ids=(...) {'axis_1'} replica groups)."""
    mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("a", "b"))
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P("a", "b")))
    f = jax.shard_map(lambda t: jax.lax.psum(t, "a"), mesh=mesh, in_specs=P("a", "b"),
                      out_specs=P(None, "b"))
    [c] = hlo_cost(jax.jit(f).lower(x).compile().as_text()).collectives
    assert (c["op"], c["group_size"], c["bytes"]) == ("all-reduce", 2, 2 * 32 * 64 * 4 / 2)
    y = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P(None, "b")))
    c = jax.jit(lambda t: t + 1, out_shardings=NamedSharding(mesh, P())).lower(y).compile()
    [c] = hlo_cost(c.as_text()).collectives
    assert (c["op"], c["group_size"], c["bytes"]) == ("all-gather", 4, 64 * 64 * 4 * 3)


def test_replica_group_forms_and_ring_formulas():
    assert group_size("replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}", 8) == 4
    assert group_size("replica_groups=[2,4]<=[8], to_apply=%add", 8) == 4
    assert group_size("replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}", 8) == 2
    assert group_size("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, x=1", 8) == 4
    assert group_size("replica_groups=mesh['a'=2,'b'=4,'c'=2], device_ids=([2,4]T(1,0)) "
                      "{'b','c'}, dimensions={1}", 16) == 8
    assert group_size("replica_groups={}, to_apply=%add", 8) == 8
    assert collective_bytes("all-gather", 100, 4) == 300          # result 400 * 3/4
    assert collective_bytes("all-reduce", 100, 4) == 150
    assert collective_bytes("reduce-scatter", 100, 4) == 75
    assert collective_bytes("collective-permute", 100, 4) == 100
    assert collective_bytes("all-reduce", 100, 1) == 0


# -- parsing --------------------------------------------------------------------------------------

def test_shapes_layouts_and_memory_spaces():
    s = parse_shape("(f32[8,1,64]{2,0,1:T(8,128)S(1)}, bf16[2,16]{1,0:T(8,128)(2,1)}, "
                    "s32[]{:S(2)}, /*index=3*/pred[8]{0:T(512)(128)(4,1)}, (u8[3], token[]), "
                    "f8e4m3fn[4,4])")
    assert [a.dtype for a in s[:4]] == ["f32", "bf16", "s32", "pred"]
    assert s[0].dims == (8, 1, 64) and s[0].space == 1 and s[1].space == 0 and s[2].space == 2
    assert s[2].dims == () and s[2].bytes == 4 and s[3].bytes == 8 and s[1].bytes == 64
    assert s[4][0].bytes == 3 and s[4][1].bytes == 0 and s[5].bytes == 16
    ins = parse_instr('  ROOT %custom-call.38 = (f32[1,16,128]{2,1,0:T(8,128)S(1)}, '
                      '/*index=1*/u32[]{:S(2)}) custom-call(%all-gather.86, /*index=1*/%p.1), '
                      'custom_call_target="AsyncCollectiveStart", metadata={op_name="a(b)/c" '
                      'source_file="x.py"}, backend_config={"flag_configs":[]}')
    assert (ins.name, ins.op, ins.root, ins.target) == (
        "custom-call.38", "custom-call", True, "AsyncCollectiveStart")
    assert ins.operands == ["all-gather.86", "p.1"] and "op_name" not in ins.attrs


def test_synthetic_module_conditional_multiline_iota_groups_and_unknown_loop():
    """A hand-written module: a conditional (its costlier branch counted), an instruction
    whose attributes span lines (as Mosaic kernels' kernel_metadata do), iota replica groups,
    a loop with no bound (trip count 1, "unknown") and a custom call (listed, no flops)."""
    text = """HloModule m, num_partitions=8

%big (p: f32[64,64]) -> f32[64,64] {
  %p = f32[64,64]{1,0} parameter(0)
  ROOT %d = f32[64,64]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%small (q: f32[64,64]) -> f32[64,64] {
  ROOT %q = f32[64,64]{1,0} parameter(0)
}

%cond (t: (s32[], f32[64,64])) -> pred[] {
  %t = (s32[], f32[64,64]{1,0}) parameter(0)
  %flag = s32[] get-tuple-element(%t), index=0
  %o = s32[] constant(1)
  ROOT %ne = pred[] compare(%flag, %flag), direction=NE
}

%body (b: (s32[], f32[64,64])) -> (s32[], f32[64,64]) {
  %b = (s32[], f32[64,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %x = f32[64,64]{1,0} get-tuple-element(%b), index=1
  %k = f32[64,64]{1,0} custom-call(%x), custom_call_target="tpu_custom_call", \
frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 512}"
}}
  ROOT %r = (s32[], f32[64,64]{1,0}) tuple(%i, %k)
}

ENTRY %main (a: f32[64,64], c: pred[]) -> f32[64,64] {
  %a = f32[64,64]{1,0} parameter(0)
  %c = pred[] parameter(1)
  %sel = f32[64,64]{1,0} conditional(%c, %a, %a), branch_computations={%small, %big}
  %ar = f32[64,64]{1,0} all-reduce(%sel), channel_id=1, replica_groups=[2,4]<=[8], to_apply=%big
  %z = s32[] constant(0)
  %init = (s32[], f32[64,64]{1,0}) tuple(%z, %ar)
  %w = (s32[], f32[64,64]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[64,64]{1,0} get-tuple-element(%w), index=1
}
"""
    cost = hlo_cost(text)
    assert cost.flops == 2 * 64 ** 3                                 # the big branch, once
    assert [(c["op"], c["group_size"]) for c in cost.collectives] == [("all-reduce", 4)]
    assert cost.collective_bytes == 2 * 64 * 64 * 4 * 3 / 4
    assert [(lp["trip_count"], lp["source"]) for lp in cost.loops] == [(1, "unknown")]
    assert [(c["target"], c["executions"]) for c in cost.custom_calls] == [("tpu_custom_call", 1)]
    # the dot (in + out), the custom call (in + out), the compare; the all-reduce not counted
    # the dot's operands and output, the custom call's, the compare's (the condition runs
    # twice: trip count + 1); the all-reduce's bytes are collective_bytes
    assert cost.hbm_bytes == 3 * 64 * 64 * 4 + 2 * 64 * 64 * 4 + 2 * (4 + 4 + 1)


def test_synthetic_async_forms_count_once():
    """GPU-style async collectives: async-start(calls=%c holding the all-gather) and
    all-reduce-start count once, their -done nothing; a copy-start / copy-done prefetch moves
    its result once (read, write)."""
    text = """HloModule m, replica_count=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%ag (p: f32[16]) -> f32[64] {
  %p = f32[16]{0} parameter(0)
  ROOT %g = f32[64]{0} all-gather(%p), replica_groups={{0,1,2,3}}, dimensions={0}
}

ENTRY %main (a: f32[16]) -> (f32[64], f32[16], f32[16]) {
  %a = f32[16]{0} parameter(0)
  %st = ((f32[16]{0}), f32[64]{0}, s32[]) async-start(%a), calls=%ag
  %dn = f32[64]{0} async-done(%st)
  %ars = f32[16]{0} all-reduce-start(%a), replica_groups={{0,1}}, to_apply=%add
  %ard = f32[16]{0} all-reduce-done(%ars)
  %cs = (f32[16]{0:S(1)}, f32[16]{0}, u32[]) copy-start(%a)
  %cd = f32[16]{0:S(1)} copy-done(%cs)
  ROOT %t = (f32[64]{0}, f32[16]{0}, f32[16]{0:S(1)}) tuple(%dn, %ard, %cd)
}
"""
    cost = hlo_cost(text)
    assert [(c["op"], c["group_size"], c["bytes"]) for c in cost.collectives] == [
        ("all-gather", 4, 64 * 3), ("all-reduce", 2, 64)]
    assert cost.collective_bytes == 64 * 3 + 64
    assert cost.hbm_bytes == 2 * 64 and cost.alt_memory_bytes == 64   # the VMEM copy's write
    assert cost.flops == 0 and cost.loops == []


def test_sparsecore_offloaded_collectives_count_once():
    """Ironwood (libtpu for TPU7x) runs all-gathers on its SparseCores: call-start(...,
    async_execution_thread="sparsecore", to_apply=%c rooted in the all-gather), between
    PrepareAsyncCall custom calls, and a call-done (the form of a real tpu7x train step). The
    all-gather counts once, at its group's ring bytes; the plumbing moves nothing."""
    text = """HloModule m, replica_count=1, num_partitions=8

%called_computation.13 (param_0.1254: f32[1,8,32]) -> f32[1,64,32] {
  %param_0.1254 = f32[1,8,32]{2,0,1} parameter(0)
  ROOT %all-gather.118 = f32[1,64,32]{2,0,1} all-gather(%param_0.1254), channel_id=49, replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, dimensions={1}, use_global_device_ids=true, backend_config={"device_type":"DEVICE_TYPE_SPARSECORE"}
}

ENTRY %main (a: f32[1,8,32]) -> f32[1,64,32] {
  %a = f32[1,8,32]{2,0,1} parameter(0)
  %prepare_start = s32[]{:S(2)} custom-call(), custom_call_target="PrepareAsyncCallStart"
  %prepare_done = token[] custom-call(%prepare_start), custom_call_target="PrepareAsyncCallDone"
  %cs = ((f32[1,8,32]{2,0,1}, token[]), f32[1,64,32]{2,0,1}) call-start(%a, %prepare_done), async_execution_thread="sparsecore", to_apply=%called_computation.13
  ROOT %cd = f32[1,64,32]{2,0,1} call-done(%cs)
}
"""
    cost = hlo_cost(text)
    assert [(c["op"], c["group_size"], c["bytes"]) for c in cost.collectives] == [
        ("all-gather", 8, 64 * 32 * 4 * 7 / 8)]
    assert cost.collective_bytes == 64 * 32 * 4 * 7 / 8
    assert cost.flops == 0


def test_a_relayout_copy_of_stacked_weights_then_sliced_reads_the_slice():
    """libtpu for Ironwood (a 7B decode on tpu7x-8) relayouts a layer scan's stacked weights
    in a nested copy fusion and dynamic-slices that inside the matmul's fusion: nothing is
    materialized there, so a layer's slice is read, not the whole stack (hlo_cost counted all
    28 layers each iteration: 6.1 TB a decode chunk instead of 0.41 TB)."""
    text = """HloModule m

%copy_fusion (input: bf16[28,64,32]) -> bf16[28,64,32] {
  %input = bf16[28,64,32]{2,1,0:T(16,128)(2,1)} parameter(0)
  ROOT %copy.1 = bf16[28,64,32]{2,1,0:T(8,128)(2,1)} copy(%input)
}

%slice_fusion (p0: bf16[28,64,32], p1: s32[]) -> bf16[64,32] {
  %p0 = bf16[28,64,32]{2,1,0:T(16,128)(2,1)} parameter(0)
  %relayout = bf16[28,64,32]{2,1,0:T(8,128)(2,1)} fusion(%p0), kind=kLoop, output_to_operand_aliasing={{}: (0, {})}, calls=%copy_fusion
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = bf16[1,64,32]{2,1,0:T(8,128)(2,1)} dynamic-slice(%relayout, %p1, %zero, %zero), dynamic_slice_sizes={1,64,32}
  ROOT %b = bf16[64,32]{1,0:T(8,128)(2,1)} bitcast(%ds)
}

%mm (q0: bf16[28,64,32], q1: s32[], q2: bf16[8,64]) -> bf16[8,32] {
  %q0 = bf16[28,64,32]{2,1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %w = bf16[64,32]{1,0} fusion(%q0, %q1), kind=kLoop, calls=%slice_fusion
  %q2 = bf16[8,64]{1,0} parameter(2)
  ROOT %c = bf16[8,32]{1,0} convolution(%q2, %w), dim_labels=bf_io->bf
}

ENTRY %main (w: bf16[28,64,32], i: s32[], x: bf16[8,64]) -> bf16[8,32] {
  %w = bf16[28,64,32]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %x = bf16[8,64]{1,0} parameter(2)
  ROOT %f = bf16[8,32]{1,0} fusion(%w, %i, %x), kind=kOutput, calls=%mm
}
"""
    cost = hlo_cost(text)
    layer, x, out = 64 * 32 * 2, 8 * 64 * 2, 8 * 32 * 2
    assert cost.hbm_bytes == layer + 4 + x + out        # one layer's weights, not 28
    assert cost.flops == 2 * 8 * 64 * 32


def test_offload_moves_count_what_moves_on_the_hbm_side():
    """Remat offload's async moves (TPU: a layer's input into a host buffer of every layer's,
    S(5), and back): a dynamic-update-slice-start moves its update, not the whole buffer it
    updates, and a dynamic-slice-start its slice; the host side of each is not HBM traffic
    (one read of the update from HBM, one write of the slice into HBM)."""
    text = """HloModule m, replica_count=1

ENTRY %main (buf: f32[8,16], x: f32[1,16], i: s32[]) -> f32[1,16] {
  %buf = f32[8,16]{1,0:S(5)} parameter(0)
  %x = f32[1,16]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  %us = ((f32[8,16]{1,0:S(5)}, f32[1,16]{1,0}, s32[], s32[]), f32[8,16]{1,0:S(5)}, u32[]) dynamic-update-slice-start(%buf, %x, %i, %z)
  %ud = f32[8,16]{1,0:S(5)} dynamic-update-slice-done(%us)
  %ss = ((f32[8,16]{1,0:S(5)}, s32[], s32[]), f32[1,16]{1,0}, u32[]) dynamic-slice-start(%ud, %i, %z), dynamic_slice_sizes={1,16}
  ROOT %sd = f32[1,16]{1,0} dynamic-slice-done(%ss)
}
"""
    cost = hlo_cost(text)
    assert cost.hbm_bytes == 16 * 4 + 16 * 4 and cost.alt_memory_bytes == 0
    assert [(m["op"], m["bytes"]) for m in cost.memory_ops] == [
        ("dynamic-update-slice-start", 64), ("dynamic-slice-start", 64)]


# -- real TPU HLO (compile only) ------------------------------------------------------------------

@pytest.fixture(scope="module")
def tpu_mesh():
    from supo_jax.plan import tpu_devices
    return Mesh(np.array(tpu_devices("v5litepod-4")), ("x",))


@needs_libtpu
def test_tpu_matmuls_are_convolutions_and_their_flops_match_xla(tpu_mesh):
    """TPU emits matmuls as convolutions (batched ones with small batches as lhs-dilated
    convolutions): loop-free, the flops match XLA's cost analysis."""
    rep = NamedSharding(tpu_mesh, P())
    cases = [(lambda a, b: a @ b, [(64, 256), (256, 512)], 2 * 64 * 256 * 512),
             (lambda a, b: jnp.einsum("bqd,bkd->bqk", a, b), [(8, 32, 16), (8, 48, 16)],
              2 * 8 * 32 * 48 * 16),
             (lambda a, b: jnp.einsum("bhqd,bhkd->bhqk", a, b),
              [(2, 4, 128, 64), (2, 4, 256, 64)], 2 * 2 * 4 * 128 * 256 * 64)]
    for f, shapes, want in cases:
        c = _compile(f, *[_sds(s, jnp.bfloat16, rep) for s in shapes])
        text = c.as_text()
        assert " convolution(" in text and " dot(" not in text
        cost = hlo_cost(text)
        assert cost.flops == pytest.approx(want, rel=1e-6)
        assert cost.flops == pytest.approx(_xla(c)["flops"], rel=0.01)


@needs_libtpu
def test_tpu_collective_bytes(tpu_mesh):
    _check_collectives(tpu_mesh, 4)


@needs_libtpu
def test_tpu_nested_loops_and_async_collective_fusions(tpu_mesh):
    """5 steps of a 2-layer scan over fsdp-sharded f32 weights (HIGHEST precision: XLA does
    not shrink them to bf16) on 4 chips: no known_trip_count on TPU (the bounds give 5 and 2),
    each layer's two weights all-gathered once a step (one of them as an async collective
    fusion, printed three times: start, continuation, done), matmul flops per chip exact."""
    L, B, D, F, T = 2, 32, 64, 128, 5

    def f(x, w1, w2):
        def layer(h, w):
            return h + jnp.tanh(h @ w[0]) @ w[1], None
        return jax.lax.fori_loop(0, T, lambda i, h: jax.lax.scan(layer, h, (w1, w2))[0] * 0.5,
                                 x)

    sh = lambda *spec: NamedSharding(tpu_mesh, P(*spec))   # noqa: E731
    with jax.default_matmul_precision("highest"):
        text = _compile(f, _sds((B, D), sharding=sh("x")), _sds((L, D, F), sharding=sh(None, "x")),
                        _sds((L, F, D), sharding=sh(None, "x")), out_shardings=sh("x")).as_text()
    assert "known_trip_count" not in text and "AsyncCollectiveStart" in text
    cost = hlo_cost(text)
    assert sorted((lp["trip_count"], lp["source"], lp["multiplicity"]) for lp in cost.loops) == [
        (2, "bound", T), (5, "bound", 1)]
    assert cost.flops == pytest.approx(T * L * 2 * 2 * (B // 4) * D * F, rel=1e-6)
    # 2 weights x L layers x T steps, each chip receiving the 3 shards it lacks
    assert cost.collective_bytes == pytest.approx(T * L * 2 * D * F * 4 * 3 / 4)
    assert len(re.findall(r" all-gather\(", text)) > len(cost.collectives) == 2
    assert all(c["executions"] == T * L for c in cost.collectives)


@needs_libtpu
def test_tpu_reduce_scatter_fusion_in_a_layer_scan(tpu_mesh):
    """Weights sharded on their output dim: the backward-like partial sums leave as TPU's
    all-reduce-scatter fusion (an all-reduce dynamic-sliced), counted as a reduce-scatter,
    once a layer."""
    L, B, D, F = 4, 64, 256, 512

    def f(x, w1, w2):
        def layer(h, w):
            return h + jnp.tanh(h @ w[0]) @ w[1], None
        return jax.lax.scan(layer, x, (w1, w2))[0]

    sh = lambda *spec: NamedSharding(tpu_mesh, P(*spec))   # noqa: E731
    c = _compile(f, _sds((B, D), sharding=sh("x")), _sds((L, D, F), sharding=sh(None, None, "x")),
                 _sds((L, F, D), sharding=sh(None, "x")), out_shardings=sh("x"))
    cost = hlo_cost(c.as_text())
    assert cost.loops[0]["trip_count"] == L
    ops = sorted(c["op"] for c in cost.collectives)
    assert ops == ["all-gather", "reduce-scatter"]
    rs = next(c for c in cost.collectives if c["op"] == "reduce-scatter")
    assert rs["executions"] == L and rs["bytes"] == pytest.approx(B * D * 4 * 3 / 4)
    # tensor parallel: the whole batch times each chip's quarter of F, both matmuls
    assert cost.flops == pytest.approx(L * 2 * 2 * B * (F // 4) * D, rel=1e-6)
    # each layer reads its own slices of the stacked weights (TPU fuses the slice into a
    # fusion nested in the matmul's), not the stacks: at least L x 2 slices, less than
    # reading both whole stacks every layer would be
    piece = D * (F // 4) * 4
    assert L * 2 * piece <= cost.hbm_bytes < L * 2 * L * piece


def test_replica_group_members_in_every_printed_form():
    """The chips of each group (logical device ids), as the iota, explicit and mesh forms
    print them; a permute's pairs; a form not understood is None, not a guess."""
    from supo_jax.hlo_cost import replica_groups
    assert replica_groups("replica_groups={{0,1,2,3},{4,5,6,7}}, x", 8) == [[0, 1, 2, 3],
                                                                          [4, 5, 6, 7]]
    assert replica_groups("replica_groups=[2,4]<=[8], to_apply=%add", 8) == [[0, 1, 2, 3],
                                                                           [4, 5, 6, 7]]
    assert replica_groups("replica_groups=[4,2]<=[2,4]T(1,0), x", 8) == [[0, 4], [1, 5],
                                                                       [2, 6], [3, 7]]
    assert replica_groups("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, x", 8) == [
        [0, 2, 4, 6], [1, 3, 5, 7]]
    # the mesh's own device order: [4,2]T(1,0) lists 0,2,4,6,1,3,5,7 in mesh order
    assert replica_groups("replica_groups=mesh['a'=2,'b'=4] device_ids=([4,2]T(1,0)) {'b'}, "
                          "x", 8) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert replica_groups("replica_groups={}, to_apply=%add", 4) == [[0, 1, 2, 3]]
    assert replica_groups("source_target_pairs={{0,1},{1,2}}, x", 4) == [[0, 1], [1, 2]]
    assert replica_groups("replica_groups=[2,4]<=[3,3], x", 8) is None     # 9 ids, 8 chips?
    assert replica_groups("replica_groups=[2,4]<=[8]T(2), x", 8) is None   # no such permutation


@needs_libtpu
def test_replica_groups_name_the_mesh_chips_on_a_tpu_slice():
    """On a v6e-16 with its chips in a scrambled mesh order, each collective's first group,
    mapped through the mesh's devices in order (the program's logical ids), is the chips of
    the mesh axes it runs over: a psum over a, an all-gather over (b, c)."""
    from supo_jax.plan import tpu_devices
    devs = tpu_devices("v6e-16")
    order = np.array(devs)[[3, 1, 2, 0, 7, 5, 6, 4, 11, 9, 10, 8, 15, 13, 14, 12]]
    mesh = Mesh(order.reshape(2, 4, 2), ("a", "b", "c"))
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32,
                             sharding=NamedSharding(mesh, P(("a", "c"), "b")))
    f = jax.shard_map(lambda t: jax.lax.all_gather(jax.lax.psum(t, "a"), ("b", "c"), tiled=True),
                      mesh=mesh, in_specs=P(("a", "c"), "b"), out_specs=P(("a", "c"), None),
                      check_vma=False)
    cols = {c["op"]: c for c in hlo_cost(jax.jit(f).lower(x).compile().as_text()).collectives}
    flat = list(mesh.devices.flat)
    assert [flat[i].id for i in cols["all-reduce"]["group"]] == [d.id for d in mesh.devices[:, 0, 0]]
    assert [flat[i].id for i in cols["all-gather"]["group"]] == [d.id for d in
                                                                 mesh.devices[0].flat]


def test_collective_rate_counts_the_links_a_group_spans():
    """v6e-8 is a 2 x 4 torus without wraparound, 4 ports a chip sharing 800 GB/s
    bidirectional (100 GB/s a port each way): a ring along the 4-chip dimension uses its 2
    links (200 GB/s), along the 2-chip one 1 link, over both 3 links; a permute 1 link; a
    group whose chips are unknown gets every port (400 GB/s, the whole-slice figure)."""
    from supo_jax.plan import collective_rate
    coords = [(x, y) for y in range(4) for x in range(2)]      # logical id -> (x, y)
    dims, ici = [2, 4], 800e9
    rate = lambda op, g: collective_rate(op, g, coords, dims, ici, 4)
    assert rate("all-gather", [0, 2, 4, 6]) == pytest.approx(200e9)     # along y
    assert rate("all-reduce", [0, 1]) == pytest.approx(100e9)           # along x
    assert rate("reduce-scatter", list(range(8))) == pytest.approx(300e9)
    assert rate("collective-permute", [0, 2]) == pytest.approx(100e9)
    assert collective_rate("all-gather", None, coords, dims, ici, 4) == pytest.approx(400e9)


def test_fit_calibration_by_hand():
    """Two published times 1.5x and 2x the planner's no-overlap times: r = 1.75; each left out
    is predicted from the other's; a program's calibrated time is its no-overlap time x r, and
    `calibrate` gives the decode DECODE_CALIBRATION's, the forward passes TRAIN_CALIBRATION's,
    the serving copy its no-overlap time."""
    from supo_jax import plan
    pts = [{"point": "a", "seconds": 0.015, "no_overlap_seconds": 0.010},
           {"point": "b", "seconds": 0.040, "no_overlap_seconds": 0.020}]
    fit = plan.fit_calibration(pts)
    assert fit["factor"] == pytest.approx(1.75)
    a, b = fit["leave_one_out"]
    assert a["predicted_seconds"] == pytest.approx(0.020) and a["miss"] == pytest.approx(1 / 3)
    assert b["predicted_seconds"] == pytest.approx(0.030) and b["miss"] == pytest.approx(-0.25)
    assert plan.calibrated_seconds({"no_overlap_seconds": 0.5}, 1.75) == pytest.approx(0.875)
    assert plan.calibrated_seconds({"no_overlap_seconds": 0.5}, None) is None
    prog = {"estimated_seconds": 1.0, "no_overlap_seconds": 2.0}
    rep = {"programs": {n: dict(prog) for n in ("train_step", "prefill", "decode",
                                                "to_serving")}}
    plan.calibrate(rep)
    got = {n: p["calibrated_seconds"] for n, p in rep["programs"].items()}
    assert got == pytest.approx({"train_step": 2.0 * plan.TRAIN_CALIBRATION,
                                 "prefill": 2.0 * plan.TRAIN_CALIBRATION,
                                 "decode": 2.0 * plan.DECODE_CALIBRATION, "to_serving": 2.0})
    # a slice of a generation with a train fit of its own (Ironwood) takes that one
    rep = {"topology": "tpu7x-8", "programs": {"train_step": dict(prog)}}
    plan.calibrate(rep)
    assert rep["programs"]["train_step"]["calibrated_seconds"] == pytest.approx(
        2.0 * plan.TRAIN_CALIBRATIONS["tpu7x"]) != 2.0 * plan.TRAIN_CALIBRATION
    assert "TRAIN_CALIBRATIONS['tpu7x']" in rep["programs"]["train_step"]["calibrated_by"]
