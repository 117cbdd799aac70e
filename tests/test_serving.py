"""The serving layout (supo_jax.model.serving) on 8 simulated CPU devices: rollouts sample on
tensor groups of the training devices, with the same tokens and logprobs as the training
(FSDP) layout."""
import jax
import numpy as np
import pytest
from flax import nnx

from supo_jax.config import ConfigError, load_config
from supo_jax.model.policy import new_policy
from supo_jax.model.serving import check_tensor, serving_mesh, to_serving, valid_tensor_sizes
from supo_jax.model.sharding import make_mesh
from supo_jax.model.tiny import tiny_config
from supo_jax.sampling.sampler import Sampler, SamplingParams

pytestmark = pytest.mark.cpu_devices

CFG = tiny_config("qwen2", vocab_size=256, hidden=64, layers=2, heads=4, kv_heads=4, mlp=128)


def _sample(policy, temperature):
    s = Sampler(policy, 8, 128)
    s.append({i: list(range(1 + i, 9 + 3 * i)) for i in range(8)})
    out = s.generate(range(8), 24, {3}, SamplingParams(temperature), jax.random.key(0))
    return [out[i] for i in range(8)]


@pytest.mark.slow
@pytest.mark.parametrize("train", [(1, 8, 1), (2, 2, 2)])
def test_serving_layout_samples_what_the_training_layout_samples(train):
    """Tokens equal and logprobs within 1e-5 (float32) on tensor groups of 1, 2 and 4 of the 8
    devices, against the policy as training shards it; each weight split over its group's
    chips, every group holding a whole copy, the cache's rows over the groups."""
    policy = new_policy(CFG, mesh=make_mesh(*train), seed=3)
    ref = {t: _sample(policy, t) for t in (0.0, 1.0)}
    for tensor in (1, 2, 4):
        serving = to_serving(policy, tensor)
        assert dict(serving.mesh.shape) == {"data": 8 // tensor, "fsdp": 1, "tensor": tensor}
        assert set(serving.mesh.devices.flat) == set(policy.mesh.devices.flat)
        wq = serving.model.layers.wq[...]
        assert wq.addressable_shards[0].data.size * tensor == wq.size
        np.testing.assert_array_equal(np.asarray(wq), np.asarray(policy.model.layers.wq[...]))
        for temp, want in ref.items():
            got = _sample(serving, temp)
            assert [g.tokens for g in got] == [w.tokens for w in want]
            assert sum(len(g.tokens) for g in got) > 8 * 8
            np.testing.assert_allclose(np.concatenate([g.logprobs for g in got]),
                                       np.concatenate([w.logprobs for w in want]), atol=1e-5)


def test_serving_copy_is_cast_to_the_compute_dtype_and_leaves_training_alone():
    policy = new_policy(CFG, dtype="float32", compute_dtype="bfloat16", mesh=make_mesh(1, 8, 1))
    before = nnx.to_pure_dict(nnx.state(policy.model))
    serving = to_serving(policy, 2)
    after = nnx.to_pure_dict(nnx.state(serving.model))
    for path, x in jax.tree_util.tree_flatten_with_path(after)[0]:
        assert x.dtype == np.dtype("bfloat16"), path
    for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(policy.model))):
        assert x.dtype == np.float32
    np.testing.assert_array_equal(
        np.asarray(after["layers"]["w_up"]).astype(np.float32),
        np.asarray(before["layers"]["w_up"].astype(jax.numpy.bfloat16)).astype(np.float32))


def test_tensor_sizes_divide_devices_heads_and_kv_heads():
    gqa = tiny_config("qwen2", vocab_size=256, hidden=64, layers=1, heads=8, kv_heads=2, mlp=64)
    assert valid_tensor_sizes(gqa, 8) == [1, 2]
    assert valid_tensor_sizes(CFG, 8) == [1, 2, 4]
    with pytest.raises(ValueError, match=r"^rollout.tensor=4: .*2 kv heads; one of 1, 2 "):
        check_tensor(4, gqa, 8)
    with pytest.raises(ValueError, match="rollout.tensor=3"):
        check_tensor(3, CFG, 8)
    mesh = serving_mesh(make_mesh(2, 2, 2), 4)
    # groups of consecutive devices of the training mesh's order
    assert [d.id for d in mesh.devices[0, 0]] == [d.id for d in
                                                   make_mesh(2, 2, 2).devices.reshape(-1)[:4]]


def test_bad_rollout_tensor_is_one_line_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout.tensor=-1"):
        load_config(None, ["rollout.tensor=-1"])
    from supo_jax.rl.runs import serving_policy

    cfg = load_config(None, ["rollout.tensor=8"])
    policy = new_policy(CFG, mesh=make_mesh(1, 8, 1))
    with pytest.raises(ConfigError, match=r"^rollout.tensor=8: a tensor group must divide"):
        serving_policy(cfg, policy)
    # the default: the largest group dividing the devices, heads and kv heads
    assert serving_policy(load_config(None, []), policy).mesh.shape["tensor"] == 4
