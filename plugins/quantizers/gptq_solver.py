"""GPTQ (Frantar et al. 2022): quantize a linear layer's weight column by column, each rounding error spread over
the columns not yet quantized in the way that least changes the layer's output on the calibration inputs.

Without act-order the columns are taken in order and a group's scale and zero come from its weights as they stand,
error updates included, when the solver reaches its first column. With act-order (``act_order=True``) the columns
are taken by decreasing Hessian diagonal (the inputs with the most energy first, while the most columns are left to
absorb their errors), and each group's scale and zero are fixed from the original weights before any column moves
("static groups"), so the result is stored in the original column order with the same layout and kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

GroupParams = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

_MAX_DAMP_RAISES = 4  # each raise multiplies the damping by 10


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    group_size: int,
    group_params: GroupParams,
    maxq: int = 15,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``weight`` to integers in ``[0, maxq]`` with one (scale, zero) per row and group of columns.

    Dequantized, ``W[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]``.

    :param weight: [N, K] weight of a linear layer (``y = x @ weight.T``).
    :param hessian: [K, K] sum of ``x x^T`` over the calibration rows of the layer's input. Columns whose diagonal
        is zero (inputs never seen) are dead: their weights are set to zero before quantizing.
    :param group_size: G, the number of consecutive columns sharing a scale and zero; must divide K.
    :param group_params: maps a group's current weights [N, G] to (scale [N], zero [N]); zero is rounded to an
        integer, which the returned ``zero`` holds.
    :param maxq: the largest quantized value (15 for int4).
    :param damp: fraction of the mean diagonal of the Hessian added to its diagonal; raised tenfold (a few times)
        if the Hessian is still not positive definite.
    :param block_size: columns per lazy batch update; rounded to whole groups. Affects speed, not the result.
    :param act_order: take the columns by decreasing Hessian diagonal, with static groups (module docstring).
    :returns: (q uint8 [N, K], scale float32 [N, K // G], zero uint8 [N, K // G]).
    """
    num_rows, num_cols = weight.shape
    if hessian.shape != (num_cols, num_cols):
        raise ValueError(f"hessian must be [{num_cols}, {num_cols}] for a weight of {num_cols} columns, "
                         f"got {list(hessian.shape)}")
    if group_size <= 0 or num_cols % group_size != 0:
        raise ValueError(f"group_size {group_size} must be positive and divide the {num_cols} input columns")
    W = weight.detach().to(torch.float32).clone()
    H = hessian.detach().to(device=W.device, dtype=torch.float32).clone()
    dead = H.diagonal() == 0
    H.diagonal()[dead] = 1.0
    W[:, dead] = 0.0
    scales = torch.empty(num_rows, num_cols // group_size, dtype=torch.float32, device=W.device)
    zeros = torch.empty_like(scales)
    perm = None
    if act_order:
        for g in range(num_cols // group_size):
            scale, zero = group_params(W[:, g * group_size:(g + 1) * group_size])
            scales[:, g], zeros[:, g] = scale.to(torch.float32), zero.to(torch.float32).round()
        perm = torch.argsort(H.diagonal(), descending=True, stable=True)
        W, H = W[:, perm], H[perm][:, perm]
        # Each (permuted) column's own group's scale and zero.
        col_scales, col_zeros = scales[:, perm // group_size], zeros[:, perm // group_size]
    U = _upper_cholesky_of_inverse(H, damp)

    Q = torch.empty_like(W)
    # Blocks hold whole groups, so a group's weights are fully up to date when its first column is reached.
    block_size = group_size * max(1, block_size // group_size)
    for start in range(0, num_cols, block_size):
        end = min(start + block_size, num_cols)
        W_blk, U_blk = W[:, start:end], U[start:end, start:end]  # W_blk is a view: updates land in W
        err_blk = torch.empty_like(W_blk)
        for i in range(end - start):
            col = start + i
            if perm is not None:
                scale, zero = col_scales[:, col], col_zeros[:, col]
            elif col % group_size == 0:
                scale, zero = group_params(W_blk[:, i:i + group_size])
                scale, zero = scale.to(torch.float32), zero.to(torch.float32).round()
                scales[:, col // group_size], zeros[:, col // group_size] = scale, zero
            w = W_blk[:, i]
            q = torch.clamp(torch.round(w / scale) + zero, 0, maxq)
            Q[:, col] = q
            err = (w - (q - zero) * scale) / U_blk[i, i]
            # Spread the error over the block's remaining columns (W_blk[:, i] itself is no longer read).
            W_blk[:, i + 1:] -= err.unsqueeze(1) * U_blk[i, i + 1:].unsqueeze(0)
            err_blk[:, i] = err
        W[:, end:] -= err_blk @ U[start:end, end:]  # the lazy update of the columns after the block
    if perm is not None:
        Q = Q[:, torch.argsort(perm)]
    return Q.to(torch.uint8), scales, zeros.to(torch.uint8)


def _upper_cholesky_of_inverse(H: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor of ``(H + d I)^-1``, with ``d = damp * mean(diag(H))`` raised until it exists."""
    mean_diag = H.diagonal().mean()
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    for attempt in range(_MAX_DAMP_RAISES + 1):
        damped = H + (damp * 10**attempt) * mean_diag * eye
        L, info = torch.linalg.cholesky_ex(damped)
        if info.item() == 0:
            U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
            if info.item() == 0:
                return U
    raise ValueError(f"the Hessian is not positive definite even with damping {damp * 10**_MAX_DAMP_RAISES:g} "
                     f"times its mean diagonal; is it finite and symmetric?")
