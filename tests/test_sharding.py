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
