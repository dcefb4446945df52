"""ResNet-20 for 32x32-class images (He et al. 2016, Sec. 4.2), with an explicit normalisation choice."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .._validate import check_choice, check_int

__all__ = ["ResNet20", "BasicBlock"]

NORMS = ("group", "batch")
_he_normal = nnx.initializers.variance_scaling(2.0, "fan_in", "normal")


def _norm(kind: str, channels: int, groups: int, rngs: nnx.Rngs) -> nnx.Module:
    if kind == "group":
        return nnx.GroupNorm(channels, num_groups=groups, epsilon=1e-5, rngs=rngs)
    return nnx.BatchNorm(channels, momentum=0.9, epsilon=1e-5, rngs=rngs)


def _apply_norm(norm: nnx.Module, x: jax.Array, deterministic: bool | None) -> jax.Array:
    if isinstance(norm, nnx.BatchNorm):
        return norm(x, use_running_average=deterministic)
    return norm(x)


class BasicBlock(nnx.Module):
    """Two 3x3 convolutions with a parameter-free shortcut (He et al.'s "option A").

    ``y = relu(norm(conv(relu(norm(conv(x))))) + shortcut(x))``; when the block halves the
    resolution and doubles the channels, the shortcut subsamples ``x[:, ::2, ::2]`` and
    zero-pads the new channels, so shortcuts add no parameters (as in the CIFAR ResNets).

    Args:
      in_channels, out_channels: widths (``out_channels`` is ``in_channels`` or twice it).
      stride: 1, or 2 to halve height and width.
      norm: ``"group"`` or ``"batch"``; norm_groups: groups of GroupNorm.
      rngs: ``nnx.Rngs``.
    """

    def __init__(
        self, in_channels: int, out_channels: int, stride: int, norm: str, norm_groups: int, *, rngs: nnx.Rngs
    ):
        pad = ((1, 1), (1, 1))  # PyTorch-style symmetric padding: 28 -> 14 -> 7 with stride 2
        self.conv1 = nnx.Conv(
            in_channels,
            out_channels,
            (3, 3),
            strides=stride,
            padding=pad,
            use_bias=False,
            kernel_init=_he_normal,
            rngs=rngs,
        )
        self.norm1 = _norm(norm, out_channels, norm_groups, rngs)
        self.conv2 = nnx.Conv(
            out_channels, out_channels, (3, 3), padding=pad, use_bias=False, kernel_init=_he_normal, rngs=rngs
        )
        self.norm2 = _norm(norm, out_channels, norm_groups, rngs)
        self.stride = stride
        self.extra_channels = out_channels - in_channels

    def __call__(self, x: jax.Array, deterministic: bool | None = None) -> jax.Array:
        """``x [B, H, W, in]`` -> ``[B, ceil(H / stride), ceil(W / stride), out]``."""
        y = jax.nn.relu(_apply_norm(self.norm1, self.conv1(x), deterministic))
        y = _apply_norm(self.norm2, self.conv2(y), deterministic)
        shortcut = x[:, :: self.stride, :: self.stride, :] if self.stride > 1 else x
        if self.extra_channels:
            lo = self.extra_channels // 2
            shortcut = jnp.pad(shortcut, ((0, 0), (0, 0), (0, 0), (lo, self.extra_channels - lo)))
        return jax.nn.relu(y + shortcut)


class ResNet20(nnx.Module):
    """ResNet-20: conv 3x3 (16) -> 3 stages x 3 basic blocks (16, 32, 64 channels) -> global
    average pool -> linear (He et al. 2016, Sec. 4.2, n = 3, 6n + 2 = 20 layers).

    This is the GRACE/EventGraD CIFAR-10 network; this project trains it on Fashion-MNIST
    (``in_channels=1``), its offline CIFAR-class stand-in. Any input size works (the network is
    fully convolutional until the global pool); 28x28 maps go 28 -> 14 -> 7.

    **Normalisation.** ``norm="group"`` (default) uses GroupNorm (Wu & He 2018): it has no
    running statistics, so the model's state is its parameters alone; every worker computes
    the same function of its inputs in training and evaluation; and it does not depend on the
    per-worker batch, which shrinks as workers are added. BatchNorm under data parallelism keeps
    per-worker running statistics that drift apart unless synchronised (an extra collective
    per layer that compressed-gradient methods do not account for); ``norm="batch"`` is there
    for parity with the papers: its ``nnx.BatchStat`` state must then be carried by the training
    step (``nnx.split(model, nnx.Param, nnx.BatchStat, ...)``), and ``deterministic=True``
    selects the running averages. Either way the learnable parameters are identical in number
    (a scale and a bias per channel).

    Parameters (shortcuts are parameter-free)::

        conv: 9 * (16 c + 6 * 16*16 + 16*32 + 5 * 32*32 + 32*64 + 5 * 64*64) = 144 c + 267,264
        norm: 2 * (16 * 7 + 32 * 6 + 64 * 6) = 1,376       fc: 64 k + k

    i.e. 269,722 for ``c = 3, k = 10`` (GRACE Table II lists 269,467 for its TensorFlow model)
    and 269,434 for ``c = 1``, in 19 + 38 + 2 = 59 tensors (GRACE: 51).

    Args:
      num_classes: ``k``, number of logits.
      in_channels: ``c``, input channels (1 for (Fashion-)MNIST, 3 for CIFAR).
      norm: ``"group"`` or ``"batch"``.
      norm_groups: GroupNorm groups per layer (must divide 16); 8 gives 2/4/8 channels per
        group in the three stages.
      rngs: ``nnx.Rngs``.
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        *,
        norm: str = "group",
        norm_groups: int = 8,
        rngs: nnx.Rngs,
    ):
        check_int(num_classes, "num_classes")
        check_int(in_channels, "in_channels")
        check_choice(norm, "norm", NORMS)
        check_int(norm_groups, "norm_groups")
        if 16 % norm_groups:
            raise ValueError(f"norm_groups must divide 16 (the narrowest stage); got {norm_groups}")
        self.norm_kind = norm
        self.stem = nnx.Conv(
            in_channels, 16, (3, 3), padding=((1, 1), (1, 1)), use_bias=False, kernel_init=_he_normal, rngs=rngs
        )
        self.stem_norm = _norm(norm, 16, norm_groups, rngs)
        blocks = []
        width = 16
        for stage, out in enumerate((16, 32, 64)):
            for i in range(3):
                stride = 2 if (stage > 0 and i == 0) else 1
                blocks.append(BasicBlock(width, out, stride, norm, norm_groups, rngs=rngs))
                width = out
        self.blocks = nnx.List(blocks)
        self.head = nnx.Linear(64, num_classes, rngs=rngs)

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None, rngs: Any = None) -> jax.Array:
        """``x [B, H, W, in_channels]`` -> logits ``[B, num_classes]``.

        Args:
          deterministic: with ``norm="batch"``, ``True`` uses (and does not update) the running
            statistics; unused with GroupNorm. ResNet-20 has no dropout.
          rngs: accepted for a uniform model interface; unused.
        """
        del rngs
        x = jax.nn.relu(_apply_norm(self.stem_norm, self.stem(x), deterministic))
        for block in self.blocks:
            x = block(x, deterministic)
        return self.head(x.mean(axis=(-3, -2)))
