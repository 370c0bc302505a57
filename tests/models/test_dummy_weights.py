"""Random weights must not depend on the device or the order they are asked for."""

import torch

from rtxcore.models.dummy import DummySource


def test_dummy_weights_are_deterministic_per_tensor():
    a = dict(DummySource("tiny").weights())
    b = dict(DummySource("tiny").weights(dtype=torch.float32))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    other_seed = dict(DummySource("tiny", seed=1).weights())
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], other_seed["model.layers.0.mlp.up_proj.weight"])
    # Different tensors of the same shape get different values.
    assert not torch.equal(a["model.layers.0.mlp.gate_proj.weight"], a["model.layers.0.mlp.up_proj.weight"])
