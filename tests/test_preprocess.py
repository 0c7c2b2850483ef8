"""Letterbox geometry, its inverse, and NCHW packing, checked on real pixels."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.preprocess import Letterbox, letterbox, letterbox_nchw, to_nchw, unletterbox

# (src_h, src_w): landscape, portrait, square, very wide, very tall, larger and smaller than the input.
SOURCES = [
    (480, 640),
    (640, 480),
    (272, 640),
    (1080, 1920),
    (1920, 1080),
    (300, 1000),
    (100, 100),
    (416, 416),
]
NETS = [(416, 416), (384, 640)]


def _to_net(boxes: np.ndarray, lb: Letterbox) -> np.ndarray:
    """Forward map source -> letterboxed pixels (what the network sees)."""
    pad = np.array([lb.pad_x, lb.pad_y, lb.pad_x, lb.pad_y], np.float32)
    return boxes * np.float32(lb.scale) + pad


@pytest.mark.parametrize("src_hw", SOURCES)
@pytest.mark.parametrize("net_hw", NETS)
def test_letterbox_round_trip(src_hw: tuple[int, int], net_hw: tuple[int, int]) -> None:
    src_h, src_w = src_hw
    image = np.zeros((src_h, src_w, 3), np.uint8)
    out, lb = letterbox(image, net_hw)
    assert out.shape == (*net_hw, 3) and out.dtype == np.uint8
    assert (lb.src_w, lb.src_h) == (src_w, src_h)
    # Aspect kept: the image fills one side exactly.
    assert lb.scale == pytest.approx(min(net_hw[0] / src_h, net_hw[1] / src_w))

    rng = np.random.default_rng(src_h * 7919 + src_w)
    xy1 = rng.uniform(0, [src_w * 0.8, src_h * 0.8], size=(50, 2))
    wh = rng.uniform(1, [src_w * 0.2, src_h * 0.2], size=(50, 2))
    boxes = np.concatenate([xy1, xy1 + wh], axis=1).astype(np.float32)
    back = unletterbox(_to_net(boxes, lb), lb)
    assert back.dtype == np.float32 and back.shape == boxes.shape
    np.testing.assert_allclose(back, boxes, atol=0.5)


@pytest.mark.parametrize("src_hw", SOURCES)
def test_letterbox_places_pixels_and_padding(src_hw: tuple[int, int]) -> None:
    """A drawn rectangle lands where the Letterbox says; padding is the pad value, centred."""
    src_h, src_w = src_hw
    image = np.full((src_h, src_w, 3), 30, np.uint8)
    box = np.array([[src_w * 0.25, src_h * 0.5, src_w * 0.75, src_h * 0.9]], np.float32)
    x1, y1, x2, y2 = box[0].astype(int)
    image[y1:y2, x1:x2] = 250
    out, lb = letterbox(image, (416, 416), pad_value=114)

    # Content rows/cols are 30 or 250 (or blends); padding is exactly 114.
    content = (out != 114).any(axis=2)
    rows, cols = np.nonzero(content)
    top, bottom = rows.min(), rows.max() + 1
    left, right = cols.min(), cols.max() + 1
    assert (top, left) == (lb.pad_y, lb.pad_x)
    assert abs((416 - bottom) - top) <= 1 and abs((416 - right) - left) <= 1  # centred
    assert (out[:top] == 114).all() and (out[bottom:] == 114).all()
    assert (out[:, :left] == 114).all() and (out[:, right:] == 114).all()
    assert top == 0 or left == 0  # the image fills the input along at least one axis

    # The bright rectangle's extent in the network image maps back to the drawn box.
    ys, xs = np.nonzero(out[..., 0] > 140)
    found_net = np.array([[xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]], np.float32)
    found_src = unletterbox(found_net, lb)
    np.testing.assert_allclose(found_src, box, atol=1.5 / lb.scale)


def test_letterbox_exact_fit_skips_padding() -> None:
    image = np.random.default_rng(0).integers(0, 255, (416, 416, 3), dtype=np.uint8)
    out, lb = letterbox(image, (416, 416))
    assert lb == Letterbox(scale=1.0, pad_x=0.0, pad_y=0.0, src_w=416, src_h=416)
    np.testing.assert_array_equal(out, image)


def test_letterbox_rejects_grey_image() -> None:
    with pytest.raises(ValueError, match=r"HxWx3"):
        letterbox(np.zeros((10, 10), np.uint8), (32, 32))


def test_unletterbox_clips_to_source() -> None:
    lb = Letterbox(scale=0.5, pad_x=0.0, pad_y=40.0, src_w=640, src_h=480)
    net = np.array([[-10, 20, 400, 300]], np.float32)
    np.testing.assert_allclose(unletterbox(net, lb), [[0, 0, 640, 480]])
    assert unletterbox(np.zeros((0, 4), np.float32), lb).shape == (0, 4)


def test_to_nchw_values_and_channel_swap() -> None:
    a = np.zeros((2, 3, 3), np.uint8)
    a[..., 0], a[..., 1], a[..., 2] = 10, 20, 30  # B, G, R
    b = np.full((2, 3, 3), 255, np.uint8)
    mean = np.array([1.0, 2.0, 3.0], np.float32)
    std = np.array([2.0, 4.0, 8.0], np.float32)

    out = to_nchw([a, b], mean, std, scale=1.0, swap_rb=False)
    assert out.shape == (2, 3, 2, 3) and out.dtype == np.float32 and out.flags.c_contiguous
    np.testing.assert_allclose(out[0, :, 0, 0], [(10 - 1) / 2, (20 - 2) / 4, (30 - 3) / 8], rtol=1e-6)
    np.testing.assert_allclose(out[1, :, 1, 2], [(255 - 1) / 2, (255 - 2) / 4, (255 - 3) / 8], rtol=1e-6)

    rgb = to_nchw([a], None, None, scale=1 / 255, swap_rb=True)
    np.testing.assert_allclose(rgb[0, :, 1, 1], [30 / 255, 20 / 255, 10 / 255], rtol=1e-6)


def test_to_nchw_rejects_mixed_sizes() -> None:
    with pytest.raises(ValueError, match="image 1"):
        to_nchw([np.zeros((4, 4, 3), np.uint8), np.zeros((4, 5, 3), np.uint8)], None, None, 1.0, False)


@pytest.mark.parametrize("shape", [(272, 640), (1080, 1920), (640, 360), (416, 416), (100, 700)])
@pytest.mark.parametrize("swap_rb", [False, True])
def test_fused_letterbox_nchw_equals_letterbox_then_nchw(shape: tuple[int, int], swap_rb: bool) -> None:
    rng = np.random.default_rng(7)
    images = [rng.integers(0, 256, (*shape, 3), dtype=np.uint8) for _ in range(2)]
    mean = np.array([103.53, 116.28, 123.675], np.float32)
    std = np.array([57.375, 57.12, 58.395], np.float32)
    fused, boxes = letterbox_nchw(images, (416, 416), 114, mean, std, 1.0, swap_rb)
    placed = [letterbox(img, (416, 416), 114) for img in images]
    expected = to_nchw([p[0] for p in placed], mean, std, 1.0, swap_rb)
    np.testing.assert_allclose(fused, expected, rtol=0, atol=1e-5)
    assert boxes == [p[1] for p in placed]
