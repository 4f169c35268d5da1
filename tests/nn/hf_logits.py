"""Our logits against a transformers model's on the same weights, in fp32."""

import copy

import torch


def assert_as_exact_as_hf(ours: torch.nn.Module, theirs: torch.nn.Module, ids: torch.Tensor) -> None:
    """Ours' fp32 logits within twice transformers' own fp32 error of its fp64 logits (root mean square; and the
    largest error within 4x): the two round differently (ours sums a norm's squares in the kernels' order,
    nn.training_kernels), so they are held to the exact values rather than to each other's bits."""
    with torch.no_grad():
        exact = copy.deepcopy(theirs).double()(ids).logits
        theirs_error = theirs(ids).logits.double() - exact
        logits = ours(ids)
        assert logits.shape == exact.shape and logits.dtype == torch.float32
        ours_error = logits.double() - exact
    rms = [error.square().mean().sqrt().item() for error in (ours_error, theirs_error)]
    largest = [error.abs().max().item() for error in (ours_error, theirs_error)]
    assert rms[0] <= 2 * rms[1] and largest[0] <= 4 * largest[1], (rms, largest)
