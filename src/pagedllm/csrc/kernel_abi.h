// What one extension hands another as a raw function pointer: the attention extension's fused
// RoPE + K/V store + paged attention (attention/csrc/paged_attention_cpu.cpp), called by the
// decoder stack (models/csrc/decoder_stack_cpu.cpp) once per layer without going through Python,
// and the one layer's KV it takes (LayerKV, the C++ side of kvstore/spec.py's LayerKV).
// Both extensions link the same libtorch, so torch::Tensor crosses between them as it does
// between torch's own libraries. The capsule's name carries the signature's version: change the
// signature, change the name, and a stale build is refused instead of called wrongly (both builds
// hash this header, so they are rebuilt together anyway).
#pragma once

#include <torch/extension.h>

#include <vector>

namespace pagedllm_cpu {

// One layer's K/V: k and v [num_blocks, block_size, kv_heads, head_dim] and, where the format has
// them, scales (undefined tensors where it has none), and the quantized formats' static scales,
// float32 [2, kv_heads] (K's row, V's row: the kv_cache_scales option; undefined where each row's
// scale is computed when written). Python hands it over as LayerKV.kernel_tensors: (k, v),
// (k, v, k_scale, v_scale) or (k, v, k_scale, v_scale, static_scales).
struct LayerKV {
  torch::Tensor k, v, k_scale, v_scale, static_scales;

  static LayerKV from_tensors(const std::vector<torch::Tensor>& t) {
    TORCH_CHECK(t.size() == 2 || t.size() == 4 || t.size() == 5,
                "a layer's KV is (k, v), (k, v, k_scale, v_scale) or (k, v, k_scale, v_scale, static_scales), got ",
                t.size(), " tensors");
    if (t.size() == 2) return LayerKV{t[0], t[1], {}, {}, {}};
    return LayerKV{t[0], t[1], t[2], t[3], t.size() == 5 ? t[4] : torch::Tensor()};
  }
  bool has_scales() const { return k_scale.defined(); }
};

using RopeStoreAttendFn = torch::Tensor (*)(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                            torch::Tensor positions, const LayerKV& kv, torch::Tensor slot_mapping,
                                            torch::Tensor query_start_loc, torch::Tensor seq_lens,
                                            torch::Tensor block_tables, double scale, int64_t num_heads);

inline constexpr const char* kRopeStoreAttendCapsule = "pagedllm.rope_store_attend.v3";

}  // namespace pagedllm_cpu
