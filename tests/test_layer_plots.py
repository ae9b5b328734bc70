"""The per-layer pictures (issue 14): which rows they show, which layers they name, and that
they render. Rows are built by hand with known answers; no TensorFlow."""

import math

import pytest
from PIL import Image

from runner.report import layer_plots

PEAK, BANDWIDTH = 1.5e11, 1e10  # ridge point at 15 FLOPs/byte


def row(name: str, intensity: float, achieved: float, time_s: float, **extra) -> dict:
    """A layers.csv row; only the fields a test names matter, the rest are plausible."""
    flops = achieved * time_s / 3
    base = {
        "name": name,
        "type": "Conv2D",
        "output_shape": "(16, 56, 56, 96)",
        "params": 0,
        "activation_bytes": 2**20,
        "forward_flops": flops,
        "bytes_read": int(flops / intensity * 0.6) if intensity else 4096,
        "bytes_written": int(flops / intensity * 0.4) if intensity else 4096,
        "intensity": intensity,
        "bound": "compute" if intensity >= PEAK / BANDWIDTH else "memory",
        "time_s": time_s,
        "time_share": 0.1,
        "flops_share": 0.1,
        "activation_share": 0.1,
        "achieved_flops": achieved,
    }
    return base | extra


def test_rows_without_flops_are_left_out_and_counted_with_their_time():
    conv = row("conv", 20.0, 5e10, 3.0, time_share=0.6)
    pad = row("pad", 0.0, 0.0, 0.5, type="ZeroPadding2D", time_share=0.1)
    reshape = row("reshape", 0.0, 0.0, 0.5, type="Reshape", time_share=0.1)
    # FLOPs counted but no bytes: no finite intensity to place
    no_bytes = row("fused", math.inf, 1e9, 1.0, time_share=0.2)
    kept, left_out, share = layer_plots.plottable([conv, pad, reshape, no_bytes])
    assert kept == [conv]
    assert left_out == 3
    assert share == pytest.approx(0.4)  # 0.1 + 0.1 + 0.2 of the step


def test_lost_time_is_the_time_beyond_what_the_roof_allows():
    on_roof = row("on_roof", 2.0, 2e10, 4.0)  # the roof at 2 FLOPs/byte: 10 GB/s x 2 = 20 GFLOP/s
    half = row("half", 2.0, 1e10, 4.0)
    flat = row("flat", 100.0, 1.5e10, 4.0)  # right of the ridge: roof is the 150 GFLOP/s peak
    assert layer_plots.lost_time(on_roof, PEAK, BANDWIDTH) == pytest.approx(0.0)
    assert layer_plots.lost_time(half, PEAK, BANDWIDTH) == pytest.approx(2.0)
    assert layer_plots.lost_time(flat, PEAK, BANDWIDTH) == pytest.approx(3.6)


def test_worst_names_slow_layers_far_below_the_roof_and_never_one_on_it():
    on_roof_slowest = row("on_roof", 2.0, 2e10, 10.0)
    far_slow = row("far_slow", 2.0, 2e8, 5.0)  # 1% of the roof: loses 4.95 s
    half_way = row("half_way", 40.0, 7.5e10, 2.0)  # half the peak: loses 1 s
    near_roof = row("near_roof", 40.0, 1.35e11, 3.0)  # slower but 90% of the peak: loses 0.3 s
    far_fast = row("far_fast", 0.2, 2e7, 0.01)  # 1% of the roof but short: loses 0.0099 s
    above = row("above", 0.2, 4e9, 1.0)  # above the roof: the device's figures were low
    rows = [on_roof_slowest, far_fast, near_roof, half_way, above, far_slow]
    assert layer_plots.worst(rows, PEAK, BANDWIDTH, 2) == [far_slow, half_way]
    everyone = [far_slow, half_way, near_roof, far_fast]
    assert layer_plots.worst(rows, PEAK, BANDWIDTH, 6) == everyone


def test_worst_with_the_roof_unknown_names_the_slowest_layers():
    rows = [row("a", 2.0, 2e10, 1.0), row("b", 2.0, 2e8, 3.0), row("c", 40.0, 7e10, 2.0)]
    named = layer_plots.worst(rows, math.nan, math.nan, 2)
    assert [r["name"] for r in named] == ["b", "c"]


def test_rare_types_share_one_legend_group_and_the_slow_ones_keep_theirs():
    rows = [row(f"l{i}", 1.0, 1e9, float(i + 1), type=f"T{i}") for i in range(12)]
    groups = layer_plots.type_groups(rows)  # at most ten groups: nine types and "other"
    assert {t for t, g in groups.items() if g == "other"} == {"T0", "T1", "T2"}
    assert all(groups[f"T{i}"] == f"T{i}" for i in range(3, 12))
    few = layer_plots.type_groups(rows[:10])
    assert few == {f"T{i}": f"T{i}" for i in range(10)}


def test_top_rows_are_the_largest_first_without_zeros():
    rows = [row(n, 1.0, 1e9, t) for n, t in [("a", 0.2), ("b", 0.9), ("c", 0.0), ("d", 0.5)]]
    assert [r["name"] for r in layer_plots.top_rows(rows, "time_s", 2)] == ["b", "d"]
    assert [r["name"] for r in layer_plots.top_rows(rows, "time_s", 10)] == ["b", "d", "a"]


def test_long_names_are_cut_in_the_middle_to_the_width():
    name = "transformer_encoder_block_11/multi_head_attention/attention_softmax"
    short = layer_plots.shorten(name, 32)
    assert len(short) == 32
    assert short == "transformer_enc…ttention_softmax"  # 15 + 1 + 16 characters
    assert layer_plots.shorten("block_1_expand", 32) == "block_1_expand"


def test_labels_stay_apart_and_inside_the_axes_around_a_cluster_in_a_corner():
    """Six named layers on nearly the same spot by the lower left corner: each text must find
    its own place, inside the axes."""
    from matplotlib.text import Text

    from runner.report import plots

    cluster = [row(f"block_{i}_depthwise", 0.06 + 0.002 * i, 1.5e7, 1.0) for i in range(6)]
    fig = plots.figure(10, 6)
    ax = fig.subplots()
    ax.set(xscale="log", yscale="log", xlim=(0.05, 200), ylim=(1e7, 1e12))
    layer_plots.label_points(ax, cluster, cluster, [], lambda r: f"{r['name']}\nx ms lost")
    fig.canvas.draw()  # places the texts as the saved picture would
    frame = ax.get_window_extent()
    boxes = [Text.get_window_extent(t) for t in ax.texts]  # the words, not the leader lines
    assert len(boxes) == 6
    assert all(frame.x0 <= b.x0 and b.x1 <= frame.x1 and frame.y0 <= b.y0 for b in boxes)
    assert all(b.y1 <= frame.y1 for b in boxes)
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])


def mobilenet_like_rows() -> list[dict]:
    types = [("Conv2D", 30.0, 0.4), ("DepthwiseConv2D", 3.0, 0.1), ("BatchNormalization", 0.3, 0.5)]
    rows = [
        row(f"block_{b}_{t.lower()}", i, PEAK * min(1.0, i / 15) * eff, 0.01 * (b + 1), type=t)
        for b in range(8)
        for t, i, eff in types
    ]
    return rows + [row("block_1_pad", 0.0, 0.0, 0.02, type="ZeroPadding2D")]


@pytest.mark.parametrize("peak, bandwidth", [(PEAK, BANDWIDTH), (math.nan, math.nan)])
def test_roofline_png_is_an_image(tmp_path, peak, bandwidth):
    path = layer_plots.roofline_png(
        mobilenet_like_rows(), peak, bandwidth, tmp_path / "roofline.png", "mobilenet, batch 16"
    )
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.size == (1000, 600)  # 10 x 6 inches at 100 dpi
        assert len(image.convert("RGB").getcolors(2**16)) > 50  # points and text, not blank


def test_roofline_png_with_no_row_on_the_log_axes(tmp_path):
    rows = [row("reshape", 0.0, 0.0, 0.1, type="Reshape")]
    path = layer_plots.roofline_png(rows, PEAK, BANDWIDTH, tmp_path / "r.png", "only reshapes")
    with Image.open(path) as image:
        assert image.size == (1000, 600)


def test_layers_png_is_an_image(tmp_path):
    path = layer_plots.layers_png(mobilenet_like_rows(), tmp_path / "layers.png", "mobilenet")
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.size == (1300, 540)  # 13 x (0.32 x 10 + 2.2) inches at 100 dpi
        assert len(image.convert("RGB").getcolors(2**16)) > 50
