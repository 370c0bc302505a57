"""The GPTQ solver: lower output error than round-to-nearest on correlated inputs, RTN exactly when the inputs are
uncorrelated, dead input columns, damping, and the shapes and ranges of what it returns."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rtx_plugins.quantizers.gptq_solver import gptq_quantize

MAXQ = 15


def minmax_group_params(w: torch.Tensor, maxq: int = MAXQ) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric min/max scale and zero of each row of a group [N, G]."""
    lo, hi = w.amin(dim=1), w.amax(dim=1)
    scale = ((hi - lo) / maxq).clamp(min=1e-8)
    zero = torch.round(-lo / scale).clamp(0, maxq)
    return scale, zero


def rtn_quantize(weight: torch.Tensor, group_size: int, maxq: int = MAXQ):
    """Round-to-nearest with the same group parameters, for comparison."""
    qs, scales, zeros = [], [], []
    for start in range(0, weight.shape[1], group_size):
        group = weight[:, start:start + group_size]
        scale, zero = minmax_group_params(group, maxq)
        qs.append(torch.clamp(torch.round(group / scale[:, None]) + zero[:, None], 0, maxq))
        scales.append(scale)
        zeros.append(zero)
    return torch.cat(qs, dim=1).to(torch.uint8), torch.stack(scales, dim=1), torch.stack(zeros, dim=1).to(torch.uint8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    zero = zero.to(torch.float32).repeat_interleave(group_size, dim=1)
    return (q.to(torch.float32) - zero) * scale.repeat_interleave(group_size, dim=1)


def output_error(x: torch.Tensor, weight: torch.Tensor, quantized, group_size: int) -> float:
    """||x (W - Wq)^T||, the change in the layer's output over the calibration rows."""
    return (x @ (weight - dequantize(*quantized, group_size)).T).norm().item()


def make_layer(num_rows: int, num_cols: int, num_samples: int, correlation: float, seed: int):
    """A weight [num_rows, num_cols], calibration inputs [num_samples, num_cols] and their Hessian (float64)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_rows, num_cols, generator=gen)
    z = torch.randn(num_samples, num_cols, generator=gen)
    mixing = torch.randn(num_cols, num_cols, generator=gen) / num_cols**0.5
    x = (1 - correlation) * z + correlation * (z @ mixing)
    return weight, x, x.double().T @ x.double()


def test_beats_round_to_nearest_on_correlated_inputs():
    weight, x, hessian = make_layer(64, 256, num_samples=512, correlation=1.0, seed=0)
    gptq = gptq_quantize(weight, hessian, 32, minmax_group_params)
    rtn = rtn_quantize(weight, 32)
    assert output_error(x, weight, gptq, 32) < 0.8 * output_error(x, weight, rtn, 32)


@pytest.mark.parametrize("diagonal", ["identity", "random"])
def test_diagonal_hessian_is_round_to_nearest(diagonal):
    # Uncorrelated inputs give the inverse Hessian no off-diagonal terms, so no error is propagated: the result is
    # RTN's exactly, not merely as good.
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    hessian = torch.eye(64) if diagonal == "identity" else torch.diag(torch.rand(64) + 0.1)
    q, scale, zero = gptq_quantize(weight, hessian, 16, minmax_group_params)
    rtn_q, rtn_scale, rtn_zero = rtn_quantize(weight, 16)
    assert torch.equal(q, rtn_q) and torch.equal(scale, rtn_scale) and torch.equal(zero, rtn_zero)


@pytest.mark.parametrize("maxq", [15, 7])
def test_output_shapes_dtypes_and_ranges(maxq):
    weight, _, hessian = make_layer(24, 96, num_samples=200, correlation=0.5, seed=2)
    q, scale, zero = gptq_quantize(weight, hessian, 32, lambda w: minmax_group_params(w, maxq), maxq=maxq)
    assert q.shape == (24, 96) and q.dtype == torch.uint8 and int(q.max()) <= maxq
    assert scale.shape == zero.shape == (24, 3)
    assert scale.dtype == torch.float32 and bool((scale > 0).all())
    assert zero.dtype == torch.uint8 and int(zero.max()) <= maxq


def test_group_params_sees_each_group_once_in_order():
    weight, _, hessian = make_layer(8, 64, num_samples=100, correlation=0.5, seed=3)
    widths = []

    def recording_group_params(w):
        widths.append(w.shape)
        return minmax_group_params(w)

    gptq_quantize(weight, hessian, 16, recording_group_params, block_size=32)
    assert widths == [torch.Size([8, 16])] * 4


def test_block_size_does_not_change_the_result():
    weight, x, hessian = make_layer(32, 128, num_samples=256, correlation=0.9, seed=4)
    results = [gptq_quantize(weight, hessian, 16, minmax_group_params, block_size=b) for b in (16, 48, 128, 1000)]
    errors = [output_error(x, weight, r, 16) for r in results]
    assert max(errors) - min(errors) < 1e-4 * errors[0]
    for q, _, _ in results[1:]:
        assert (q != results[0][0]).float().mean() < 1e-3  # float summation order may flip a rare tie


def test_dead_input_columns_quantize_to_zero():
    weight, x, _ = make_layer(16, 64, num_samples=128, correlation=0.8, seed=5)
    dead = [0, 17, 40, 63]
    x[:, dead] = 0
    hessian = x.double().T @ x.double()
    q, scale, zero = gptq_quantize(weight, hessian, 16, minmax_group_params)
    restored = dequantize(q, scale, zero, 16)
    assert bool(torch.isfinite(restored).all())
    assert bool((restored[:, dead] == 0).all())
    assert output_error(x, weight, (q, scale, zero), 16) < output_error(x, weight, rtn_quantize(weight, 16), 16)


def test_all_zero_hessian_gives_zero_weights():
    weight = torch.randn(4, 32)
    q, scale, zero = gptq_quantize(weight, torch.zeros(32, 32), 8, minmax_group_params)
    assert bool((dequantize(q, scale, zero, 8) == 0).all())


def test_indefinite_hessian_is_damped_until_it_factors():
    # Eigenvalues 3 and -1: the default damping is far too small, a raised one is enough.
    hessian = torch.tensor([[1.0, 2.0], [2.0, 1.0]])
    q, _, _ = gptq_quantize(torch.tensor([[0.3, -0.7]]), hessian, 2, minmax_group_params)
    assert q.shape == (1, 2)


def test_negative_definite_hessian_raises():
    with pytest.raises(ValueError, match="not positive definite"):
        gptq_quantize(torch.randn(4, 8), -torch.eye(8), 4, minmax_group_params)


def test_group_size_must_divide_columns():
    with pytest.raises(ValueError, match="divide"):
        gptq_quantize(torch.randn(4, 48), torch.eye(48), 32, minmax_group_params)


def test_hessian_shape_must_match():
    with pytest.raises(ValueError, match="hessian"):
        gptq_quantize(torch.randn(4, 48), torch.eye(32), 16, minmax_group_params)


# GPTQ is greedy, not optimal: it carries no guarantee of beating RTN on every layer. With a single output row and
# groups of 2-4 columns it can be several times worse (error pushed into a group's later columns falls outside the
# range its scale was fitted to, and is clipped). Over 32-64 rows and groups of 8 or more it held: sampling 4000
# layers of this test's own distribution while writing it, the worst was 0.995x RTN and the median 0.69x (another
# input distribution's worst was 1.013x). Groups of 4 already reached 1.16x, so they are left out.
@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    num_rows=st.integers(32, 64),
    group_size=st.sampled_from([8, 16, 32]),
    num_groups=st.integers(1, 4),
    num_samples=st.integers(1, 128),
    correlation=st.floats(0.0, 1.0),
    magnitude=st.sampled_from([0.01, 1.0, 100.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_never_clearly_worse_than_round_to_nearest(
    num_rows, group_size, num_groups, num_samples, correlation, magnitude, seed
):
    weight, x, hessian = make_layer(num_rows, group_size * num_groups, num_samples, correlation, seed)
    weight = weight * magnitude
    gptq_error = output_error(x, weight, gptq_quantize(weight, hessian, group_size, minmax_group_params), group_size)
    rtn_error = output_error(x, weight, rtn_quantize(weight, group_size), group_size)
    assert gptq_error <= 1.05 * rtn_error + 1e-6


def test_act_order_with_a_diagonal_hessian_is_round_to_nearest_in_the_original_column_order():
    # No error to propagate, and static groups are RTN's own: whatever order the columns are taken in (a random
    # diagonal orders them anew), the result is RTN's, column for column.
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    hessian = torch.diag(torch.rand(64, generator=torch.Generator().manual_seed(3)) + 0.1)
    q, scale, zero = gptq_quantize(weight, hessian, 16, minmax_group_params, act_order=True)
    rtn_q, rtn_scale, rtn_zero = rtn_quantize(weight, 16)
    assert torch.equal(q, rtn_q) and torch.equal(scale, rtn_scale) and torch.equal(zero, rtn_zero)


@pytest.mark.parametrize("seed", [0, 1])
def test_act_order_beats_in_order_gptq_when_a_few_inputs_carry_most_of_the_energy(seed):
    weight, x, _ = make_layer(64, 256, num_samples=512, correlation=0.5, seed=seed)
    energy = torch.ones(256)
    energy[torch.randperm(256, generator=torch.Generator().manual_seed(100 + seed))[:16]] = 8.0
    x = x * energy
    hessian = x.double().T @ x.double()
    in_order = gptq_quantize(weight, hessian, 32, minmax_group_params)
    act_order = gptq_quantize(weight, hessian, 32, minmax_group_params, act_order=True)
    # Measured 0.67-0.74 of in-order GPTQ's output error over four such layers.
    assert output_error(x, weight, act_order, 32) < 0.85 * output_error(x, weight, in_order, 32)
