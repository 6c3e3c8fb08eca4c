// What one extension hands another as a raw function pointer: the attention extension's fused
// RoPE + K/V store + paged attention (attention/csrc/paged_attention_cpu.cpp), called by the
// decoder stack (models/csrc/decoder_stack_cpu.cpp) once per layer without going through Python.
// Both extensions link the same libtorch, so torch::Tensor crosses between them as it does
// between torch's own libraries. The capsule's name carries the signature's version: change the
// signature, change the name, and a stale build is refused instead of called wrongly (both builds
// hash this header, so they are rebuilt together anyway).
#pragma once

#include <torch/extension.h>

namespace pagedllm_cpu {

using RopeStoreAttendFn = torch::Tensor (*)(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                            torch::Tensor positions, torch::Tensor k_cache, torch::Tensor v_cache,
                                            torch::Tensor slot_mapping, torch::Tensor query_start_loc,
                                            torch::Tensor seq_lens, torch::Tensor block_tables, double scale,
                                            int64_t num_heads);

inline constexpr const char* kRopeStoreAttendCapsule = "pagedllm.rope_store_attend.v1";

}  // namespace pagedllm_cpu
