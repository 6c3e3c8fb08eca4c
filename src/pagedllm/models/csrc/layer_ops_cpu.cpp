// Python bindings of the per-token layer ops (csrc/layer_ops.h): RMSNorm, residual add + RMSNorm,
// SiLU-and-multiply, the GGUF Q8_0 and Q4_0/Q4_1 matrix products for small batches, and the AVX2
// float32 panel GEMM (csrc/panel_gemm.h).
#include "layer_ops.h"
#include "panel_gemm.h"
#include "bf16_tiles.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (CPU)");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x in place, then RMSNorm of it (CPU)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of fused gate_up rows (CPU)");
  m.def("row_argmax", &row_argmax, "each row's first index of its largest value, as torch.max(dim=-1) (CPU)");
  m.def("q8_0_linear", &q8_0_linear, "x @ W^T with W in GGUF Q8_0 blocks, float32 out (CPU)");
  m.def("q4_linear", &q4_linear, "x @ W^T with W in GGUF Q4_0/Q4_1 blocks, float32 out (CPU)");
  m.def("q4_tiles_linear", &bf16_tiles::q4_linear,
        "bfloat16 x @ W^T with W's GGUF Q4_0/Q4_1 blocks in tiles of 16 channels, float32 out (bfloat16 with "
        "bf16_out) (AVX-512 BF16)",
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scale_min"), pybind11::arg("bf16_out") = false);
  m.def("q8_0_tiles_linear", &bf16_tiles::q8_0_linear,
        "bfloat16 x @ W^T with W's GGUF Q8_0 blocks in tiles of 16 channels, float32 out (bfloat16 with "
        "bf16_out) (AVX-512 BF16)",
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("bf16_out") = false);
  m.def("has_bf16_tiles", &bf16_tiles::available, "whether this build has the AVX-512 BF16 tile kernels");
  m.def("panel_linear", &panel_gemm::panel_linear, "x @ W^T + bias with W in float32 panels of 16 columns (AVX2)",
        pybind11::arg("x"), pybind11::arg("panels"), pybind11::arg("bias"), pybind11::arg("n"));
  m.def("has_panel_linear", &panel_gemm::available, "whether this build has the AVX2 panel GEMM");
}
