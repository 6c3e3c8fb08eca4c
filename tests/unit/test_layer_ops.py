"""The C++ layer ops equal the torch ops that define their numerics; quantized matmuls equal dense ones."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm import cpu_features
from pagedllm.models.gguf_quant import BlockQuantized, decode_blocks
from pagedllm.models.layer_ops import EXTENSION, CpuLayerOps, TorchLayerOps, get_layer_ops
from pagedllm.models.quantized_linear import (
    Int4BlockMatmul,
    Int4Matmul,
    Int4TileMatmul,
    Int8BlockMatmul,
    Int8ChannelMatmul,
    Int8TileMatmul,
    Linear,
    pack_panels,
    quantized_matmul,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TORCH = TorchLayerOps()


@pytest.fixture(scope="module")
def ops():
    module = EXTENSION.load()
    assert module is not None, "the C++ layer ops must build on this machine (g++ is installed)"
    return CpuLayerOps(module)


def close(a, b, dtype):
    """Equal up to float32 summation order: one unit in the last place of the dtype."""
    ulp = {torch.float32: 2e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=ulp, atol=ulp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("width", [576, 100])  # 100: a tail past the last whole 16-lane vector
def test_norms_equal_torch(ops, dtype, rows, width):
    gen = torch.Generator().manual_seed(rows)
    x, res = (torch.randn(rows, width, generator=gen).to(dtype) for _ in range(2))
    w = torch.randn(width, generator=gen).to(dtype)
    close(ops.rms_norm(x, w, 1e-5), TORCH.rms_norm(x, w, 1e-5), dtype)
    mine = res.clone()
    normed, new_res = ops.add_rms_norm(x, mine, w, 1e-5)
    expected, expected_res = TORCH.add_rms_norm(x, res, w, 1e-5)
    assert new_res is mine and torch.equal(mine, expected_res)  # updated in place, rounded as torch adds
    close(normed, expected, dtype)
    first, residual = ops.add_rms_norm(x, None, w, 1e-5)  # first layer: the residual is the input
    assert residual is x
    close(first, TORCH.rms_norm(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_silu_mul_equals_torch(ops, dtype, rows):
    gate_up = torch.randn(rows, 2 * 1536 + 8, generator=torch.Generator().manual_seed(3)) * 6
    gate_up[0, [0, 1, 2, 1538]] = torch.tensor([100.0, -100.0, 0.0, -100.0])  # tails, vector and scalar lanes
    gate_up = gate_up.to(dtype)
    ours, theirs = ops.silu_mul(gate_up), TORCH.silu_mul(gate_up)
    close(ours, theirs, dtype)
    assert torch.equal(ours[0, [0, 1, 2, 1538]], theirs[0, [0, 1, 2, 1538]])  # -100 gives -0 as in F.silu


@pytest.mark.parametrize("rows", [1, 64])
def test_bf16_results_keep_denormals_and_nans_lane_by_lane(ops, rows):
    """The bf16 stores take one vcvtneps2bf16 on AVX512-BF16, which reads a denormal as zero and keeps
    a NaN's sign: a vector holding either rounds as torch does (c10's nearest even), its other lanes
    alike, and vectors without one are unchanged."""
    gen = torch.Generator().manual_seed(rows)
    tiny = 2.0 ** -130  # a float32/bf16 denormal
    x, res = (torch.randn(rows, 576, generator=gen).bfloat16() for _ in range(2))
    w = torch.randn(576, generator=gen).bfloat16()
    x[:, 3], res[:, 3] = tiny, tiny          # a denormal sum in the first vector
    x[:, 40], res[:, 40] = -tiny, 3 * tiny   # and in the third
    x[:, 70], x[:, 100] = float("nan"), -float("nan")
    mine = res.clone()
    ops.add_rms_norm(x, mine, w, 1e-5)
    expected = x + res
    assert mine[:, 3].float().eq(2 * tiny).all() and mine[:, 40].float().eq(2 * tiny).all()
    nan = expected.isnan()
    assert torch.equal(mine.isnan(), nan) and torch.equal(mine[~nan], expected[~nan])
    gate_up = torch.randn(rows, 2 * 1536, generator=gen).bfloat16()
    gate_up[:, 5], gate_up[:, 1536 + 5] = 4 * tiny, 1.0   # silu(g) = g / 2, a denormal, times 1
    gate_up[:, 50], gate_up[:, 1536 + 60] = -float("nan"), float("nan")
    ours, theirs = ops.silu_mul(gate_up), TORCH.silu_mul(gate_up)
    assert ours[:, 5].float().eq(2 * tiny).all()
    nan = theirs.isnan()
    assert torch.equal(ours.isnan(), nan)
    close(ours[~nan].view(1, -1), theirs[~nan].view(1, -1), torch.bfloat16)


def close_to_product(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """``out`` is x @ weight^T rounded to out's dtype, up to float32 summation order: that error is
    bounded by the terms' magnitudes (|x| @ |weight|^T), not the result's, so a near-cancelling sum
    keeps its absolute error whatever the order (AVX2 and AVX-512 bodies sum in different orders)."""
    exact = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T
    ulp = {torch.float32: 2 ** -23, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[out.dtype]
    error = (out.double() - exact).abs()
    assert (error <= ulp * exact.abs() + 2 ** -18 * magnitude).all(), error.max()


def gguf_weight(kind: str, n: int, k: int, seed: int = 0):
    x = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1
    blocks = decode_blocks(kind, gguf.quants.quantize(x, gguf.GGMLQuantizationType[kind]), n, k)
    return blocks, blocks.dequantize()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
def test_q8_0_linear_equals_dense_float32(ops, rows):
    blocks, dense = gguf_weight("Q8_0", 300, 192)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows))
    out = Int8BlockMatmul(blocks, ops)(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 300)
    torch.testing.assert_close(out, x @ dense.T, rtol=1e-5, atol=1e-5)
    close(Int8BlockMatmul(blocks, ops)(x.bfloat16()), x.bfloat16().float() @ dense.T, torch.bfloat16)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_matmul_equals_dense(kind, dtype):
    blocks, dense = gguf_weight(kind, 96, 128, seed=4)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4))
    out = Int4Matmul(blocks, dtype)(x.to(dtype))
    assert out.dtype == dtype
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
    torch.testing.assert_close(out.float(), x.to(dtype).float() @ dense.T, rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpp_int4_matmul_equals_dense_at_every_row_count(ops, kind, dtype):
    """Our C++ 4-bit kernel: float32 maths on the exact GGUF weights, so to float32's rounding of
    the sum (then the output's dtype); rows 1-17 cover every row group (1-8) and a remainder."""
    blocks, dense = gguf_weight(kind, 70, 96, seed=5)
    kernel = quantized_matmul(blocks, dtype, ops, "cpp")
    assert isinstance(kernel, Int4BlockMatmul)
    x = torch.randn(17, 96, generator=torch.Generator().manual_seed(5)).to(dtype)
    for rows in range(1, 18):
        out = kernel(x[:rows])
        assert out.dtype == dtype and out.shape == (rows, 70)
        close(out, x[:rows].float() @ dense.T, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int8_channel_weights_on_our_q8_0_kernel_equal_the_dequantized_product(ops, dtype):
    """quantization="int8" where the plan's int8_kernel is "cpp": float32 and float16 rows run our
    Q8_0 kernel, the channel's scale on each 32-input block (bf16 rows keep torch's int8 kernel);
    the result is the dequantized weight's product up to float32 summation order."""
    gen = torch.Generator().manual_seed(3)
    kernel = Int8ChannelMatmul.quantize(torch.randn(80, 288, generator=gen), ops)
    assert kernel.runs_blocks(dtype) and not kernel.runs_blocks(torch.bfloat16)
    assert not Int8ChannelMatmul.quantize(torch.randn(80, 288, generator=gen)).runs_blocks(dtype)  # no C++ ops
    x = torch.randn(5, 288, generator=gen).to(dtype)
    out = kernel(x)
    assert out.dtype == dtype
    close_to_product(out, x, kernel.dequantize(torch.float32))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_small_step_kernels_compute_each_row_alone_bit_for_bit(ops, kind):
    """A row's result is the same whatever rows share its call (speculative decoding verifies a
    guess in a step of several rows and must compute what the guess's own decode step would):
    our C++ 4-bit kernel (its one-row body once rounded differently), the Q8_0 kernel, and torch's
    int4 kernel up to the rows it runs (KernelPlan.int4_rows); ours up to 32 (a float32 model's plan),
    the BF16 tile kernels up to 64 (a bf16 model's plan on AVX-512 BF16: eight passes of 8 rows)."""
    blocks, _ = gguf_weight(kind, 80, 288, seed=6)  # 9 blocks per row: 8 at once, and a tail
    x = torch.randn(64, 288, generator=torch.Generator().manual_seed(6))
    q8_blocks, _ = gguf_weight("Q8_0", 80, 288, seed=6)
    kernels = [quantized_matmul(blocks, torch.float32, ops, "cpp"), Int8BlockMatmul(q8_blocks, ops),
               Int4Matmul(blocks, torch.bfloat16), Int8ChannelMatmul.quantize(blocks.dequantize(), ops)]
    if ops.has_bf16_tiles():  # AVX-512 BF16 builds: our tile kernels, 8 rows per unpacked tile and more
        kernels += [quantized_matmul(blocks, torch.bfloat16, ops, "tiles"),
                    quantized_matmul(q8_blocks, torch.bfloat16, ops, q8_0_kernel="tiles")]
        assert isinstance(kernels[-2], Int4TileMatmul) and isinstance(kernels[-1], Int8TileMatmul)
    for kernel in kernels:
        tiles = isinstance(kernel, (Int4TileMatmul, Int8TileMatmul))
        xs = x.bfloat16() if tiles or isinstance(kernel, Int4Matmul) else x
        # the most any plan runs it for: torch's int4 8, the tiles 64 (bf16), ours else 32 (float32)
        rows = 8 if isinstance(kernel, Int4Matmul) else 64 if tiles else 32
        alone = torch.cat([kernel(xs[i:i + 1]) for i in range(rows)])
        for m in range(2, rows + 1):
            assert torch.equal(kernel(xs[:m]), alone[:m]), (type(kernel).__name__, m)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_tile_matmuls_equal_dense_at_every_row_count(ops, kind):
    """Our AVX-512 BF16 tile kernels: exact codes times bfloat16 inputs (exact products), float32
    sums, so their float32 output equals the float64 product to float32's rounding; rows 1-17 cover
    every row group (1-8) and a remainder, 80 channels five tiles, 288 inputs nine blocks."""
    if not ops.has_bf16_tiles():
        pytest.skip("this build has no AVX-512 BF16 tile kernels (AVX-512 BF16 CPUs only)")
    blocks, dense = gguf_weight(kind, 80, 288, seed=7)
    kernel = quantized_matmul(blocks, torch.bfloat16, ops, "tiles", "tiles")
    assert isinstance(kernel, Int8TileMatmul if kind == "Q8_0" else Int4TileMatmul)
    raw = ops.q8_0_tiles_linear if kind == "Q8_0" else ops.q4_tiles_linear
    tensors = (kernel.codes, kernel.scales) if kind == "Q8_0" else (kernel.codes, kernel.scale_min)
    x = torch.randn(17, 288, generator=torch.Generator().manual_seed(7)).bfloat16()
    exact = x.double() @ dense.double().T
    for rows in range(1, 18):
        out = raw(x[:rows], *tensors)
        assert out.dtype == torch.float32 and out.shape == (rows, 80)
        torch.testing.assert_close(out.double(), exact[:rows], rtol=1e-5, atol=1e-5)
        rounded = raw(x[:rows], *tensors, bf16_out=True)  # rounded in the kernel, as torch rounds
        assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, out.bfloat16())
        assert torch.equal(kernel(x[:rows]), rounded)
    assert raw(x[:0], *tensors).shape == (0, 80)  # no rows: an empty product, no row group run
    with pytest.raises(RuntimeError, match="bfloat16"):
        raw(x.float(), *tensors)


def test_the_tile_kernels_are_chosen_only_where_they_apply(ops):
    """bfloat16 rows, channels in whole tiles of 16, a build that has it; torch's int4 kernel else."""
    blocks, _ = gguf_weight("Q4_1", 80, 64)
    uneven, _ = gguf_weight("Q4_1", 72, 64)
    assert isinstance(quantized_matmul(blocks, torch.float32, ops, "tiles"), Int4Matmul)
    assert not Int4TileMatmul.accepts(uneven)  # (nor does torch's int4 kernel take it)
    chosen = quantized_matmul(blocks, torch.bfloat16, ops, "tiles")
    assert isinstance(chosen, Int4TileMatmul if ops.has_bf16_tiles() else Int4Matmul)
    assert isinstance(quantized_matmul(blocks, torch.bfloat16, TORCH, "tiles"), Int4Matmul)  # no C++ ops
    q8_blocks, _ = gguf_weight("Q8_0", 80, 64)
    assert isinstance(quantized_matmul(q8_blocks, torch.float32, ops, q8_0_kernel="tiles"), Int8BlockMatmul)
    chosen = quantized_matmul(q8_blocks, torch.bfloat16, ops, q8_0_kernel="tiles")
    assert isinstance(chosen, Int8TileMatmul if ops.has_bf16_tiles() else Int8BlockMatmul)


def awq_like_weight(n: int, k: int, seed: int = 0) -> BlockQuantized:
    """4-bit blocks as an AWQ group gives them: float16 scales, minimum -scale * zero (zero 0..15),
    which float16 cannot hold (a float16 times a 4-bit integer needs up to 15 significant bits)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001).half().float()
    zero = torch.randint(0, 16, (n, k // 32), generator=gen).float()
    return BlockQuantized(codes, scale, -scale * zero)


@pytest.mark.parametrize("dtype", DTYPES)
def test_4bit_kernels_take_scales_float16_cannot_hold_in_float32(ops, dtype):
    """AWQ's minimums need more bits than float16's: our C++ 4-bit kernels keep them in float32 (GGUF's
    exact float16 pairs stay float16) and compute on the exact weights; before, such blocks went to
    torch's int4 kernel, 10x slower with float32 or float16 rows (docs/design.md)."""
    blocks = awq_like_weight(80, 288, seed=4)
    pairs = torch.stack([blocks.scale, blocks.minimum], dim=-1)
    assert not torch.equal(pairs.half().float(), pairs)  # the case at hand
    x = torch.randn(17, 288, generator=torch.Generator().manual_seed(4)).to(dtype)
    kernels = [quantized_matmul(blocks, dtype, ops, "cpp")]
    if dtype == torch.bfloat16 and ops.has_bf16_tiles():
        kernels.append(quantized_matmul(blocks, dtype, ops, "tiles"))
    for kernel, kind in zip(kernels, (Int4BlockMatmul, Int4TileMatmul), strict=False):
        assert isinstance(kernel, kind) and kernel.scale_min.dtype == torch.float32
        for rows in (1, 8, 17):
            close_to_product(kernel(x[:rows]), x[:rows], blocks.dequantize())
    gguf_blocks, _ = gguf_weight("Q4_1", 32, 64)
    assert quantized_matmul(gguf_blocks, dtype, ops, "cpp").scale_min.dtype == torch.float16  # GGUF's, exact


def test_linear_uses_the_quantized_kernel_only_for_small_steps(ops):
    blocks, dense = gguf_weight("Q4_1", 64, 64)
    lin = Linear(64, 64, bias=True)
    with torch.no_grad():
        lin.weight.copy_(dense)
        lin.bias.copy_(torch.arange(64.0))
    calls = []
    kernel = quantized_matmul(blocks, torch.float32, ops)

    def spy(x):
        calls.append(x.shape[0])
        return kernel(x)

    lin.use_quantized(spy, max_rows=4)
    x = torch.randn(9, 64)
    with torch.no_grad():
        torch.testing.assert_close(lin(x[:4]), torch.nn.functional.linear(x[:4], dense, lin.bias), rtol=1e-5,
                                   atol=1e-5)
        lin(x)
    assert calls == [4]


def test_without_a_compiler_layer_ops_fall_back_to_torch_and_say_so_once(monkeypatch, caplog, without_installed_builds):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("error: command 'c++' failed: No such file or directory")

    monkeypatch.setattr(EXTENSION, "module", None)
    monkeypatch.setattr(EXTENSION, "failure", None)
    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compiler)
    with caplog.at_level("WARNING"):
        assert type(get_layer_ops("cpu")) is TorchLayerOps
        assert type(get_layer_ops("cpu")) is TorchLayerOps
    assert len([r for r in caplog.records if "layer ops could not be built" in r.getMessage()]) == 1
    blocks, _ = gguf_weight("Q8_0", 32, 32)
    assert quantized_matmul(blocks, torch.float32, TorchLayerOps()) is None  # Q8_0 needs the C++ kernel


HERE = cpu_features.detect()


@pytest.mark.skipif(not HERE.onednn_packs(torch.bfloat16),
                    reason=f"oneDNN packs no bf16 weight on this CPU ({HERE.describe()}): needs AVX-512/AVX-NE-CONVERT")
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_prepacked_linear_is_identical_to_f_linear_in_bf16(bias):
    """Bit-equal where the CPU has native bf16 GEMMs (both calls run the same oneDNN kernel). Where
    oneDNN emulates them (AVX-512 without BF16) F.linear's bias joins the float32 sum in another
    order, so a rare output (6 in 1,600,000 over 200 seeds, as avx512 on the AMX Xeon) rounds to
    the neighbouring bf16 value: there, at most one bf16 step apart, in under 1% of the outputs."""
    torch.manual_seed(1)
    lin = Linear(192, 320, bias=bias).to(torch.bfloat16)
    dense_weight = lin.weight.detach().clone()
    expected_bias = None if lin.bias is None else lin.bias.detach().clone()
    assert lin.prepack() and lin.weight is None and lin.packed is not None
    for rows in (1, 7, 64, 300):
        x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows)).bfloat16()
        with torch.no_grad():
            y, expected = lin(x), torch.nn.functional.linear(x, dense_weight, expected_bias)
        if HERE.native_bf16:
            assert torch.equal(y, expected)
        else:
            torch.testing.assert_close(y, expected, rtol=2**-7, atol=0)
            assert (y != expected).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_compute_of_a_half_precision_linear_rounds_the_float32_product_once(dtype, bias):
    """The path for CPUs without native bf16/fp16 GEMMs, tested on every CPU: weights widened to
    float32 and packed, output in the model dtype, equal to the float32 product rounded once
    (up to the order of the float32 sum, which may move a rare last bit)."""
    torch.manual_seed(0)
    lin = Linear(192, 320, bias=bias).to(dtype)
    weight = lin.weight.detach().float()
    bias32 = None if lin.bias is None else lin.bias.detach().float()
    assert lin.prepack(torch.float32) and lin.weight is None and lin.widen == torch.float32
    assert lin.packed is not None if HERE.onednn_packs(torch.float32) else lin.wide_weight is not None
    for rows in (1, 7, 64, 300):
        x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows)).to(dtype)
        with torch.no_grad():
            y = lin(x)
        exact = torch.nn.functional.linear(x.float(), weight, bias32)
        assert y.dtype == dtype
        torch.testing.assert_close(y.float(), exact, rtol=2**-8 if dtype == torch.bfloat16 else 2**-10, atol=1e-3)
        # fp16's finer last bit sits closer to the sum's order noise: more (still rare) flips
        assert (y != exact.to(dtype)).float().mean() < (5e-3 if dtype == torch.bfloat16 else 2e-2)


def test_float32_weights_are_not_prepacked():
    lin = Linear(64, 64)
    assert not lin.prepack() and lin.packed is None and lin.weight is not None


@pytest.fixture(scope="module")
def panel_ops(ops):
    if not ops.ops.has_panel_linear():
        pytest.skip(f"the AVX2 panel GEMM is not built on this CPU ({HERE.describe()}: no AVX2/FMA)")
    return ops.ops


@pytest.mark.parametrize("m", [1, 5, 6, 7, 97, 200])
@pytest.mark.parametrize("n,k", [(16, 64), (37, 100), (960, 576)])
def test_panel_linear_equals_the_float32_product(panel_ops, m, n, k):
    """Every row tile (1-6 rows, row blocks of 96), a partial last panel (N % 16) and a bias: the
    float32 product up to float32 summation order; a bf16 input is widened exactly first."""
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x, w, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    panels = pack_panels(w)
    assert panels.shape == (-(-n // 16), k, 16)
    for bias in (None, b):
        y = panel_ops.panel_linear(x, panels, bias, n)
        exact = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
        assert y.dtype == torch.float32 and y.shape == (m, n)
        torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5 * k ** 0.5)
    xb = x.bfloat16()
    assert torch.equal(panel_ops.panel_linear(xb, panels, None, n), panel_ops.panel_linear(xb.float(), panels, None, n))


def test_a_panel_linear_row_does_not_depend_on_the_other_rows(panel_ops):
    """Each output is one FMA chain over k: a row's bits are the same alone, in any tile position
    and in any row block, so a request's logits do not depend on its batch."""
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(150, 96, generator=gen), torch.randn(50, 96, generator=gen)
    panels = pack_panels(w)
    full = panel_ops.panel_linear(x, panels, None, 50)
    for row in (0, 5, 6, 95, 96, 149):
        assert torch.equal(panel_ops.panel_linear(x[row:row + 1], panels, None, 50)[0], full[row])


def test_panel_linear_refuses_panels_of_another_shape(panel_ops):
    panels = pack_panels(torch.randn(40, 32))
    with pytest.raises(RuntimeError, match="ceil"):
        panel_ops.panel_linear(torch.randn(2, 32), panels, None, 60)
    with pytest.raises(RuntimeError, match="bias"):
        panel_ops.panel_linear(torch.randn(2, 32), panels, torch.randn(39), 40)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_linear_widened_into_panels_rounds_the_float32_product_once(panel_ops, dtype):
    torch.manual_seed(0)
    lin = Linear(192, 50, bias=True).to(dtype)
    weight, bias32 = lin.weight.detach().float(), lin.bias.detach().float()
    assert lin.prepack(torch.float32, panel_ops) and lin.weight is None and lin.packed is None
    assert lin.panels is not None and lin.widen == torch.float32
    for rows in (1, 7, 64, 300):
        x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows)).to(dtype)
        with torch.no_grad():
            y = lin(x)
        assert y.dtype == dtype
        assert torch.equal(y, panel_ops.panel_linear(x, lin.panels, lin.packed_bias, 50).to(dtype))
        exact = torch.nn.functional.linear(x.float(), weight, bias32)
        torch.testing.assert_close(y.float(), exact, rtol=2**-8 if dtype == torch.bfloat16 else 2**-10, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_picks_what_torch_max_picks(ops, dtype):
    """Our one-pass row argmax (the sampler's greedy pick) against torch.max(dim=-1).indices: rows
    shorter than a vector, a whole number of vectors and a tail, SmolLM2's 49,152; ties (the first
    wins, across lanes and within one), infinities, all -inf, and NaNs (the first NaN wins) in the
    vector part and in the tail."""
    gen = torch.Generator().manual_seed(11)
    for n in (1, 3, 7, 8, 15, 16, 17, 33, 49_152):
        x = torch.randn(12, n, generator=gen)
        x[1] = 0.5  # all tied: index 0
        x[2] = -float("inf")
        if n > 2:
            x[3, n // 2] = x[3, n - 1] = 9.0  # a tie of two maxima
            x[4, n - 1] = float("inf")
            x[5, n // 3] = float("nan")
            x[6, n - 1] = float("nan")
            x[7, 1] = x[7, n - 1] = float("nan")
            x[8, n - 2] = 9.0
            x[8, 0] = 9.0  # the first lane's tie
        rows = x.to(dtype)
        torch_pick = rows.max(dim=-1).indices
        assert torch.equal(ops.row_argmax(rows), torch_pick), n
        assert torch.equal(ops.row_argmax(rows[::2]), torch_pick[::2]), n  # not contiguous: copied first
