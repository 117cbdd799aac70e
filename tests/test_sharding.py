"""Mesh sharding on 8 simulated CPU devices (conftest sets the XLA flag; where the default
platform is not the CPU, conftest runs these tests in a subprocess with JAX_PLATFORMS=cpu)."""
import numpy as np
import pytest
from flax import nnx

import supo_jax
from supo_jax.model.sharding import make_mesh
from supo_jax.sampling.sampler import generate
from tests.helpers import make_hf_model

pytestmark = pytest.mark.cpu_devices


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen2"))
    make_hf_model("qwen2_bias_gqa", path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 4, 2), (1, 1, 8)])
def test_sharded_logits_and_sampling_match(ckpt, shape):
    mesh = make_mesh(*shape)
    sharded = supo_jax.load_policy(ckpt, mesh=mesh)
    plain = supo_jax.load_policy(ckpt)
    params = nnx.to_pure_dict(nnx.state(sharded.model, nnx.Param))
    wq = params["layers"]["wq"]
    assert wq.sharding.mesh.shape == mesh.shape
    assert len(wq.addressable_shards) == 8
    # really split: each device holds a fraction of the weight
    frac = wq.addressable_shards[0].data.size / wq.size
    assert frac < 1.0
    if shape[2] > 1:
        assert wq.sharding.spec[2] == "tensor"
    ids = np.random.RandomState(0).randint(0, sharded.config.vocab_size, (4, 24))
    np.testing.assert_allclose(np.asarray(sharded.logits(ids)), np.asarray(plain.logits(ids)),
                               atol=1e-4)
    prompts = [ids[i, : 5 + 3 * i].tolist() for i in range(4)]
    a = generate(sharded, prompts, 16)
    b = generate(plain, prompts, 16)
    assert [x.tokens for x in a] == [x.tokens for x in b]


def test_mesh_errors():
    with pytest.raises(ValueError, match="needs"):
        make_mesh(3, 1, 1)
    assert make_mesh(2, -1, 2).shape == {"data": 2, "fsdp": 2, "tensor": 2}


@pytest.mark.slow
def test_sampler_cache_sharded_over_rows_and_kv_heads(ckpt):
    """Sampling on the training mesh: the KV cache and the last logits are made sharded (rows
    over data x fsdp, kv heads over tensor; a device holds 1/8 of the cache), and a
    generation on them equals the unsharded one."""
    from supo_jax.sampling.sampler import Sampler

    mesh = make_mesh(2, 2, 2)
    pol = supo_jax.load_policy(ckpt, mesh=mesh)
    assert pol.config.num_kv_heads % 2 == 0
    s = Sampler(pol, 8, 64)
    k = s.cache.k
    assert k.sharding.spec[1] == ("data", "fsdp") and k.sharding.spec[2] == "tensor"
    assert k.addressable_shards[0].data.size == k.size // 8
    assert s.last_logits.sharding.spec[0] == ("data", "fsdp")
    ids = np.random.RandomState(1).randint(0, pol.config.vocab_size, (8, 12))
    a = generate(pol, ids.tolist(), 8)
    b = generate(supo_jax.load_policy(ckpt), ids.tolist(), 8)
    assert [x.tokens for x in a] == [x.tokens for x in b]


def test_sampler_rows_round_up_to_the_batch_axes():
    from supo_jax.config import load_config
    from supo_jax.rl.runs import sampler_rows

    cfg = load_config(None, ["rollout.rows=12"])
    assert sampler_rows(cfg, 100, None) == 12 and sampler_rows(cfg, 5, None) == 5
    assert sampler_rows(cfg, 100, make_mesh(2, 2, 2)) == 12       # data x fsdp = 4
    assert sampler_rows(cfg, 100, make_mesh(1, 8, 1)) == 16
    assert sampler_rows(cfg, 3, make_mesh(1, 8, 1)) == 8
