// The decoder's layer loop in C++: one call per step runs every layer (norm, QKV projection,
// RoPE + K/V store + paged attention, output projection, norm, gate/up projection, SiLU-and-
// multiply, down projection) and the final norm, with the same kernels, in the same order, on
// the same tensors as the Python loop of models/llama.py. Results are bit-identical to it; what
// goes away is ~9 Python-to-C++ crossings per layer (about 270 a step for SmolLM2), which at
// batch 1 cost more than the norms and activations themselves.
//
// Each projection keeps both of its Python counterparts' kernels (models/quantized_linear.py):
// the small-batch one (torch's 4-bit weight-only matmul, or our Q8_0 product) for steps of at
// most max_rows rows, else the dense one (oneDNN's prepacked linear, widened to float32 or not,
// the AVX2 float32 panel GEMM of csrc/panel_gemm.h, or at::linear on a plain weight). The attention comes from the attention extension as a
// function pointer (csrc/kernel_abi.h). Each part of a layer is wrapped in RECORD_FUNCTION, so
// torch's profiler sees it under the names `pagedllm bench step` counts.
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>

#include <optional>
#include <string>
#include <vector>

#include "kernel_abi.h"
#include "layer_ops.h"
#include "panel_gemm.h"
#include "bf16_tiles.h"

namespace {

using LinearPointwise = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                   c10::string_view, c10::List<std::optional<at::Scalar>>,
                                   std::optional<c10::string_view>);

// oneDNN's linear over a prepacked weight, as torch.ops.mkldnn._linear_pointwise is called from Python.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                             .typed<LinearPointwise>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
}

}  // namespace

// One linear layer, as models/quantized_linear.Linear runs it.
struct Projection {
  enum Dense : int64_t { kPlain = 0, kPacked = 1, kPackedWidened = 2, kPanelsWidened = 3, kInt8Dequant = 4 };
  enum Small : int64_t { kNone = 0, kInt4 = 1, kQ8_0 = 2, kQ4 = 3, kInt8 = 4, kQ4Tiles = 5, kQ8_0Tiles = 6 };

  int64_t dense;
  at::Tensor weight;  // [N, K] (kPlain), oneDNN's packed layout, or float32 panels [ceil(N / 16), K, 16]
  std::optional<at::Tensor> bias;
  int64_t small;
  int64_t max_rows;
  at::Tensor small_a, small_b;  // int4: packed codes, scales and zeros; Q8_0: codes, scales; Q4: codes, scale_min;
                                // int8: codes [N, K], a scale per output channel in the model dtype [N],
                                // or (float32/float16 models) repeated per 32-input block, float32 [N, K / 32]
  std::optional<at::Tensor> small_bias;
  int64_t out_features = 0;  // N (the panels pad it to a multiple of 16)

  Projection(int64_t dense, at::Tensor weight, std::optional<at::Tensor> bias, int64_t small, int64_t max_rows,
             std::optional<at::Tensor> small_a, std::optional<at::Tensor> small_b,
             std::optional<at::Tensor> small_bias, int64_t out_features)
      : dense(dense), weight(std::move(weight)), bias(std::move(bias)), small(small), max_rows(max_rows),
        small_bias(std::move(small_bias)), out_features(out_features) {
    TORCH_CHECK(dense >= kPlain && dense <= kInt8Dequant, "unknown dense kernel ", dense);
    TORCH_CHECK(dense != kInt8Dequant || small == kInt8, "the int8 dense path needs the int8 codes and scales");
    TORCH_CHECK(dense != kPanelsWidened || panel_gemm::available(), "this build has no AVX2 panel GEMM");
    TORCH_CHECK(small >= kNone && small <= kQ8_0Tiles, "unknown small-batch kernel ", small);
    TORCH_CHECK((small != kQ4Tiles && small != kQ8_0Tiles) || bf16_tiles::available(),
                "this build has no AVX-512 BF16 tile kernels");
    if (small != kNone) {
      TORCH_CHECK(small_a.has_value() && small_b.has_value(), "a small-batch kernel needs its two tensors");
      this->small_a = *small_a;
      this->small_b = *small_b;
    }
  }

  // True when a step of `rows` rows runs the dense weight widened to float32: then the stack feeds
  // it float32 rows and takes its float32 output unrounded (`widened`), see DecoderStack::forward.
  bool widened_for(int64_t rows) const {
    return (dense == kPackedWidened || dense == kPanelsWidened) && !(small != kNone && rows <= max_rows);
  }

  at::Tensor widened(const at::Tensor& x_float) const {
    if (dense == kPanelsWidened) {
      RECORD_FUNCTION("pagedllm::panel_linear", std::vector<c10::IValue>());
      return panel_gemm::panel_linear(x_float, weight, bias, out_features);
    }
    return onednn_linear(x_float, weight, bias);
  }

  at::Tensor operator()(const at::Tensor& x) const {
    if (small != kNone && x.size(0) <= max_rows) {
      at::Tensor y;
      if (small == kInt4) {
        y = at::_weight_int4pack_mm_for_cpu(x.contiguous(), small_a, 32, small_b);
      } else if (small == kInt8 && small_b.dim() == 2) {  // our Q8_0 kernel, the channel's scale per block
        RECORD_FUNCTION("pagedllm::q8_0_linear", std::vector<c10::IValue>());
        y = q8_0_linear(x, small_a, small_b).to(x.scalar_type());
      } else if (small == kInt8) {
        y = at::_weight_int8pack_mm(x.contiguous(), small_a, small_b);
      } else if (small == kQ4) {
        RECORD_FUNCTION("pagedllm::q4_linear", std::vector<c10::IValue>());
        y = q4_linear(x, small_a, small_b).to(x.scalar_type());
      } else if (small == kQ4Tiles) {
        RECORD_FUNCTION("pagedllm::q4_tiles_linear", std::vector<c10::IValue>());
        y = bf16_tiles::q4_linear(x, small_a, small_b, /*bf16_out=*/true);
      } else if (small == kQ8_0Tiles) {
        RECORD_FUNCTION("pagedllm::q8_0_tiles_linear", std::vector<c10::IValue>());
        y = bf16_tiles::q8_0_linear(x, small_a, small_b, /*bf16_out=*/true);
      } else {
        RECORD_FUNCTION("pagedllm::q8_0_linear", std::vector<c10::IValue>());
        y = q8_0_linear(x, small_a, small_b).to(x.scalar_type());
      }
      return small_bias.has_value() ? y + *small_bias : y;
    }
    switch (dense) {
      case kPacked:
        return onednn_linear(x, weight, bias);
      case kPackedWidened:
      case kPanelsWidened:
        return widened(x.to(at::kFloat)).to(x.scalar_type());
      case kInt8Dequant: {  // quantization="int8" above max_rows: the weight dequantized for this call
        const at::Tensor scale = small_b.dim() == 2 ? small_b.select(1, 0) : small_b;  // per channel [N]
        return at::linear(x, small_a.to(x.scalar_type()) * scale.to(x.scalar_type()).unsqueeze(1), bias);
      }
      default:
        return at::linear(x, weight, bias);
    }
  }
};

struct Layer {
  at::Tensor input_norm;
  double input_eps;
  at::Tensor post_attention_norm;
  double post_attention_eps;
  Projection qkv, o, gate_up, down;
};

class DecoderStack {
 public:
  DecoderStack(std::vector<Layer> layers, at::Tensor final_norm, double final_eps, int64_t num_heads,
               int64_t q_size, double scale, pybind11::capsule attend)
      : layers_(std::move(layers)), final_norm_(std::move(final_norm)), final_eps_(final_eps),
        num_heads_(num_heads), q_size_(q_size), scale_(scale) {
    TORCH_CHECK(std::string(attend.name()) == pagedllm_cpu::kRopeStoreAttendCapsule,
                "the attention extension hands '", attend.name(), "', this stack needs '",
                pagedllm_cpu::kRopeStoreAttendCapsule, "' (rebuild both)");
    attend_ = reinterpret_cast<pagedllm_cpu::RopeStoreAttendFn>(attend.get_pointer());
  }

  // x: the embedded tokens [T, hidden]; returns the hidden states after the final norm.
  //
  // Where a layer's four projections all run widened to float32 (a CPU without native bf16, steps
  // past the small-batch kernels), the activations between the ops stay float32: the norms and
  // SiLU-and-multiply write float32 rows holding the model dtype's rounded values (what the GEMM
  // would have widened), and read the GEMMs' float32 outputs rounding them first (what the GEMM's
  // conversion back would have done), so six conversions per layer go and every value is the same.
  at::Tensor forward(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<std::vector<at::Tensor>>& kv, const at::Tensor& slot_mapping,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     const at::Tensor& block_tables) const {
    TORCH_CHECK(kv.size() == layers_.size(), "one LayerKV per layer expected, got ", kv.size(), " for ",
                layers_.size(), " layers");
    const int64_t T = x.size(0);
    const at::ScalarType dtype = x.scalar_type();
    at::Tensor residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      const bool wide = layer.qkv.widened_for(T) && layer.o.widened_for(T) && layer.gate_up.widened_for(T) &&
                        layer.down.widened_for(T);
      const at::ScalarType between = wide ? at::kFloat : dtype;  // the dtype of the norms' and SiLU's outputs
      at::Tensor h;
      {
        RECORD_FUNCTION("pagedllm::add_rms_norm", std::vector<c10::IValue>());
        if (i == 0) {
          h = rms_norm_to(x, layer.input_norm, layer.input_eps, between);
          residual = x;  // owned by this call: the norms below update it in place
        } else {
          h = add_rms_norm_to_(x, residual, layer.input_norm, layer.input_eps, between);
        }
      }
      const at::Tensor qkv = wide ? layer.qkv.widened(h).to(dtype) : layer.qkv(h);
      at::Tensor attention;
      {
        RECORD_FUNCTION("pagedllm::rope_store_attend", std::vector<c10::IValue>());
        attention = attend_(qkv, cos, sin, positions, pagedllm_cpu::LayerKV::from_tensors(kv[i]), slot_mapping,
                            query_start_loc, seq_lens, block_tables, scale_, num_heads_);
      }
      const at::Tensor rows = attention.reshape({T, q_size_});
      h = wide ? layer.o.widened(rows.to(at::kFloat)) : layer.o(rows);
      {
        RECORD_FUNCTION("pagedllm::add_rms_norm", std::vector<c10::IValue>());
        h = add_rms_norm_to_(h, residual, layer.post_attention_norm, layer.post_attention_eps, between);
      }
      const at::Tensor gate_up = wide ? layer.gate_up.widened(h) : layer.gate_up(h);
      {
        RECORD_FUNCTION("pagedllm::silu_mul", std::vector<c10::IValue>());
        h = silu_mul_to(gate_up, dtype, between);
      }
      x = wide ? layer.down.widened(h) : layer.down(h);  // float32 from a widened layer: the next norm rounds it
    }
    RECORD_FUNCTION("pagedllm::add_rms_norm", std::vector<c10::IValue>());
    return add_rms_norm_to_(x, residual, final_norm_, final_eps_, dtype);
  }

 private:
  std::vector<Layer> layers_;
  at::Tensor final_norm_;
  double final_eps_;
  int64_t num_heads_, q_size_;
  double scale_;
  pagedllm_cpu::RopeStoreAttendFn attend_ = nullptr;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  py::class_<Projection>(m, "Projection", "one linear layer: a dense kernel and an optional small-batch one")
      .def(py::init<int64_t, at::Tensor, std::optional<at::Tensor>, int64_t, int64_t, std::optional<at::Tensor>,
                    std::optional<at::Tensor>, std::optional<at::Tensor>, int64_t>(),
           py::arg("dense"), py::arg("weight"), py::arg("bias"), py::arg("small"), py::arg("max_rows"),
           py::arg("small_a"), py::arg("small_b"), py::arg("small_bias"), py::arg("out_features"));
  py::class_<Layer>(m, "Layer", "one decoder layer's norms and projections")
      .def(py::init<at::Tensor, double, at::Tensor, double, Projection, Projection, Projection, Projection>(),
           py::arg("input_norm"), py::arg("input_eps"), py::arg("post_attention_norm"),
           py::arg("post_attention_eps"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"));
  py::class_<DecoderStack>(m, "DecoderStack", "every decoder layer and the final norm, in one call")
      .def(py::init<std::vector<Layer>, at::Tensor, double, int64_t, int64_t, double, py::capsule>(),
           py::arg("layers"), py::arg("final_norm"), py::arg("final_eps"), py::arg("num_heads"), py::arg("q_size"),
           py::arg("scale"), py::arg("attend"))
      .def("forward", &DecoderStack::forward, py::arg("x"), py::arg("positions"), py::arg("cos"), py::arg("sin"),
           py::arg("kv"), py::arg("slot_mapping"), py::arg("query_start_loc"),
           py::arg("seq_lens"), py::arg("block_tables"));
}
