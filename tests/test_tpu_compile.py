"""The project's programs compiled ahead of time for a TPU slice, on a machine without a TPU
(supo_jax.plan: libtpu describes the slice, XLA compiles for its chips; nothing runs)."""
import functools
import importlib.util
import time

import numpy as np
import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                       reason="libtpu is not installed (pip install \"jax[tpu]\"; CI installs "
                       "it with the test extra): no TPU to compile for"),
    pytest.mark.xdist_group("tpu_compile"),
]

TOPOLOGY = "v5litepod-4"
TINY = "tiny"      # the recipe's tiny policy, asked for by name
T_SHORT = 256      # rows of the train steps compiled only for their remat (the recipe's: 446)


def _recipe(*sets):
    from supo_jax.config import load_config
    return load_config(None, list(sets))


def _fits(p):
    assert "error" not in p, p.get("error")
    assert p["fits"] and 0 < p["bytes_per_chip"]["total"] < 16 << 30
    assert p["flops_per_chip"] > 0 and p["estimated_seconds"] > 0
    assert p["bound"] in ("compute", "hbm", "ici")


@pytest.mark.slow
def test_sampler_prefill_and_decode_compile_and_fit():
    """The CPU recipe's prefill (W = 446 tokens into 512 slots: the sampler rounds its cache up
    to a multiple of 128) and one decode chunk (64 steps) at its 32 sampler rows, tiny model
    sharded over the 4 chips of a v5e slice."""
    from supo_jax.plan import plan

    rep = plan(_recipe(), TOPOLOGY, model_config=TINY, programs=("prefill", "decode"))
    assert rep["chips"] == 4 and rep["mesh"]["fsdp"] == 4
    assert set(rep["programs"]) == {"prefill", "decode"}
    assert rep["shapes"]["sampler_rows"] == 32 and rep["shapes"]["cache_len"] == 512
    for p in rep["programs"].values():
        _fits(p)
    assert rep["programs"]["prefill"]["bytes_per_chip"]["alias"] > 0   # the donated cache
    # the decode at a fraction of its HBM roofline: the tiny policy's weights and KV cache
    # stay in VMEM (layout S(1)) across its 64 steps, and what the roofline reads from HBM
    # each step moves there instead (the planner says so)
    e = rep["estimates"]
    assert e["decode_over_roofline"] < 0.5
    assert e["decode_vmem_bytes_per_chip"] >= e["decode_roofline_bytes_per_chip"] > 0
    # docs/SCALING.md's plan block renders the committed plan of the same command: its shapes
    # and these programs' counts are today's (a change that moves them reruns the command)
    import json
    import os

    committed = json.load(open(os.path.join(os.path.dirname(__file__), "..", "experiments",
                                            "results", "tpu_plan_cpu_recipe", "plan.json")))
    assert committed["shapes"] == rep["shapes"]
    for name in ("prefill", "decode"):
        for k in ("flops_per_chip", "bytes_per_chip"):
            assert committed["programs"][name][k] == rep["programs"][name][k], (name, k)


@functools.lru_cache(maxsize=None)
def _train_step_plan(*sets):
    """The recipe's train step planned with `sets` (a program compiled once per module: the
    tests of tpu_compile run on one worker)."""
    from supo_jax.plan import plan

    return plan(_recipe(*sets), TOPOLOGY, model_config=TINY, programs=("train_step",))


@pytest.mark.slow
def test_train_step_compiles_and_fits():
    """The CPU recipe's train step (16 rows, AdamW state, donated parameters) with XLA
    attention and full remat, at rows of 256 tokens (libtpu's compile time grows with the row:
    12 s at 256, 30 s at the recipe's 446, which compile with its own remat, none, in the
    splash test below)."""
    rep = _train_step_plan("model.attention=xla", "model.remat=full",
                           f"optim.max_row_len={T_SHORT}")
    p = rep["programs"]["train_step"]
    _fits(p)
    assert p["bytes_per_chip"]["alias"] > 0        # parameters and optimizer state donated


@pytest.mark.slow
def test_train_step_with_splash_on_several_chips():
    """model.attention=auto (splash on TPU) inside the train step on 4 chips: the Mosaic
    kernel runs per batch shard under shard_map (XLA cannot partition it itself)."""
    from supo_jax.plan import plan

    rep = plan(_recipe(), TOPOLOGY, model_config=TINY, programs=("train_step",))
    _fits(rep["programs"]["train_step"])


@pytest.mark.slow
def test_remat_offload_qkvo_keeps_layer_inputs_and_projections_in_host_memory():
    """model.remat=offload_qkvo compiles for TPU with each layer's input and its q, k, v and
    attention-output projections in pinned host memory: host memory a chip at least those of
    a chip's rows (remat full: none; remat offload's layer inputs alone are compiled in
    test_plan_counts' remat search).
    Not fewer device temporaries at the recipe's shapes: the inputs (2 layers x 4 rows x 446 x 64
    floats, 0.9 MiB a chip) are smaller than the buffers that stream them back (5.4 MiB full,
    8.7 MiB offload, with the LM head chunked per row); offload pays where inputs are GiBs.
    Compiled at rows of 256 tokens (the test above's program, compiled once)."""
    got = {}
    for remat in ("full", "offload_qkvo"):
        rep = _train_step_plan("model.attention=xla", f"model.remat={remat}",
                               f"optim.max_row_len={T_SHORT}")
        p = rep["programs"]["train_step"]
        _fits(p)
        got[remat] = p["bytes_per_chip"]
    inputs = 2 * (16 // 4) * T_SHORT * 64 * 4      # layers x rows a chip x T x E, float32
    # offload_qkvo: the q, k, v and attention-output projections too (heads 4 x 16, kv heads 2)
    projections = 2 * (16 // 4) * T_SHORT * (64 + 2 * 32 + 64) * 4
    assert got["full"]["host_temp"] == 0
    assert got["offload_qkvo"]["host_temp"] >= inputs + projections


@pytest.mark.slow
def test_host_copy_and_training_layout_decodes_are_reported_beside():
    """--host-copy: the decode of one host's share of the rows on its own chips (v5e hosts
    hold 4 chips, each a quarter of the policy); --training-layout: the same rows' decode on
    the training (FSDP) mesh of all 16 chips, which gathers the weights every step. Both are
    reported beside the serving layout's decode and do not decide `fits`."""
    from supo_jax.plan import plan

    rep = plan(_recipe(), "v5litepod-16", model_config=TINY, programs=("decode",), host_copy=True,
               training_layout=True)
    assert rep["chips"] == 16 and rep["host_chips"] == 4
    assert rep["host_sampler_rows"] == rep["shapes"]["sampler_rows"] // 4
    p = rep["programs"]
    for name in ("decode", "decode_host_copy", "decode_training_layout"):
        _fits(p[name])
    whole = rep["serving"]["weight_bytes_per_chip"] * rep["serving"]["tensor"]
    assert p["decode_host_copy"]["bytes_per_chip"]["argument"] >= whole / 4
    e = rep["estimates"]
    assert e["training_layout_collective_bytes_per_step"] > 10 * e[
        "decode_collective_bytes_per_step"]
    assert rep["fits"]


@pytest.mark.slow
def test_ironwood_slices_count_tensorcores_and_a_device_gets_half_a_chip():
    """Ironwood (TPU7x): a slice's name counts TensorCores, two a chip, each a JAX device
    (tpu7x-8: 2x2x1, 4 chips on one host, 8 devices); the smallest slice's decode and prefill
    compile with each device's half of the chip's HBM, peak and bandwidths, and the run's
    chip-hours count chips, not devices."""
    from supo_jax.plan import CHIPS, TOPOLOGIES, format_plan, host_devices, plan, tpu_devices

    for name in (n for n in TOPOLOGIES if n.startswith("tpu7x")):
        devices = tpu_devices(name)
        assert len(devices) == int(name.split("-")[1]) and devices[0].device_kind == "TPU7x"
        assert len({tuple(d.coords) for d in devices}) == len(devices) // 2     # chips
        assert len(host_devices(name)) == min(8, len(devices))                 # 4 chips a host
    rep = plan(_recipe(f"optim.max_row_len={T_SHORT}"), "tpu7x-8", model_config=TINY,
               host_copy=True)      # every program of the run (~20 s)
    chip = CHIPS["tpu7x"]
    assert rep["chips"] == 8 and rep["devices_per_chip"] == 2 and rep["host_chips"] == 8
    assert rep["hbm_bytes_per_chip"] == chip["hbm_bytes"] // 2 == 96 << 30
    assert rep["hbm_bandwidth_per_chip"] == chip["hbm_bandwidth"] / 2
    assert rep["ici_bandwidth_per_chip"] == chip["ici_bandwidth"] / 2
    assert rep["peak_flops_per_chip"] <= chip["peak_flops"]["bfloat16"] / 2
    for p in rep["programs"].values():
        assert "error" not in p and p["fits"] and p["estimated_seconds"] > 0
    assert "8 devices (4 chips of 2 TensorCores" in format_plan(rep).splitlines()[0]
    run = rep["rl_step"]
    k = next(iter(run["run_chip_hours"]))
    assert run["run_chip_hours"][k] == pytest.approx(
        run[k]["step"] * run["run_steps"] * 4 / 3600)


def test_splash_batch_not_split_over_the_chips_names_the_settings():
    """A micro-batch of 2 rows cannot run splash per batch shard over 4 chips: the train
    step is reported as not compiling, with the settings that fix it."""
    from supo_jax.plan import plan

    rep = plan(_recipe("model.attention=splash", "optim.minibatch_rows=2", "optim.micro=1"),
               TOPOLOGY, model_config=TINY, programs=("train_step",))
    p = rep["programs"]["train_step"]
    assert not rep["fits"] and not p["fits"]
    assert "2 rows a micro-batch do not split over the mesh's data x fsdp = 4" in p["error"]
    assert "optim.minibatch_rows / optim.micro a multiple of 4" in p["error"]


@pytest.mark.parametrize("topology,mesh,match", [
    ("v9-8", [], "unknown TPU topology 'v9-8'"),
    (TOPOLOGY, ["mesh.fsdp=3"], "needs 3 devices, have 4"),
])
def test_bad_input_is_one_line_value_error(topology, mesh, match):
    from supo_jax.plan import plan

    with pytest.raises(ValueError, match=match) as e:
        plan(_recipe(*mesh), topology, model_config=TINY, programs=("decode",))
    assert "\n" not in str(e.value)


def test_missing_config_json_is_value_error(tmp_path):
    from supo_jax.plan import plan

    with pytest.raises(ValueError, match="no config.json in") as e:
        plan(_recipe(), TOPOLOGY, model_config=str(tmp_path))
    assert "\n" not in str(e.value)


def test_splash_kernel_compiles_through_mosaic():
    """model.attention=splash's kernel lowered for TPU chips (not interpreted): causal, packed
    segment ids, GQA (4 query heads over 2 key/value heads), rows of 446 tokens (padded to
    512 inside) and padding rows (segment id 0); forward and gradients. Each chip runs its
    rows (shard_map over the batch: XLA does not partition a Mosaic kernel itself)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from supo_jax.model import platform
    from supo_jax.model.attention import causal_attention
    from supo_jax.plan import CHIPS, tpu_devices

    mesh = Mesh(np.asarray(tpu_devices(TOPOLOGY)), ("fsdp",))
    b, t, h, kh, d = 8, 446, 4, 2, 16

    def attn(q, k, v, seg):
        qi = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (q.shape[0], t))
        return causal_attention(q, k, v, qi, seg, impl="splash")

    sharded = jax.shard_map(attn, mesh=mesh, in_specs=(P("fsdp"),) * 4, out_specs=P("fsdp"),
                            check_vma=False)
    grads = jax.grad(lambda *a: sharded(*a).astype(jnp.float32).sum(), (0, 1, 2))
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt,
                                                  sharding=NamedSharding(mesh, P("fsdp")))
    args = (spec((b, t, h, d), jnp.bfloat16), spec((b, kh, t, d), jnp.bfloat16),
            spec((b, kh, t, d), jnp.bfloat16), spec((b, t), jnp.int32))
    with platform.compiling_for("tpu", CHIPS["v5e"]["hbm_bytes"]):
        for fn in (sharded, grads):
            t0 = time.perf_counter()
            lowered = jax.jit(fn).lower(*args)
            assert "tpu_custom_call" in lowered.as_text()     # Mosaic, not the interpreter
            compiled = lowered.compile()
            assert compiled.cost_analysis()["flops"] > 0
            assert time.perf_counter() - t0 < 60


def test_plan_cli_bad_topology_exits_2(capsys):
    from supo_jax import cli

    assert cli.main(["plan", "--topology", "v9-8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown TPU topology 'v9-8'" in err[0]
