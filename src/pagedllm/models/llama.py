"""Llama-family decoder over a paged KV cache (Llama 2/3, SmolLM2, Mistral, Qwen2).

GQA, RoPE (theta + scaling), optional q/k/v bias (Qwen2), tied embeddings. The forward pass
takes a flat batch of tokens (no padding) plus ``AttentionMetadata``; each layer writes its new
K/V through the slot mapping and attends through the block tables, via the attention backend.
Weights arrive as an HF-named state dict (``load_hf_state_dict``) and are fused here
(q/k/v into one projection, gate/up into one). GGUF's block-quantized copies can be attached for
small steps (``use_gguf_quantized``, see ``quantized_linear``).

The residual stream is carried between layers as in vLLM: each norm is fused with the residual
add before it (``layer_ops.add_rms_norm``), which is the same arithmetic as HF's
``h = x + f(norm(x))`` in one call instead of a dozen small ops.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import LAYER_LOOPS, ModelConfig
from pagedllm.kvstore.spec import LayerKV
from pagedllm.kvstore.storage import KVCacheStorage
from pagedllm.models.decoder_stack import build_decoder_stack
from pagedllm.models.gguf_quant import BlockQuantized
from pagedllm.models.kernel_plan import KernelPlan
from pagedllm.models.layer_ops import TorchLayerOps
from pagedllm.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from pagedllm.models.quantized_linear import (
    DEFAULT_MAX_ROWS,
    Int8ChannelMatmul,
    Linear,
    NativePackedMatmul,
    prepack_for_onednn,
    quantized_matmul,
)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)

    _projections = None  # (qkv_proj, o_proj) as a plain tuple, bound by finalize (see DecoderLayer)

    def forward(self, x, positions, rotary: RotaryEmbedding, kv: LayerKV, meta, backend):
        t = x.shape[0]
        qkv_proj, o_proj = self._projections
        qkv = qkv_proj.forward(x)
        if backend.fuses_rope:
            out = backend.rope_store_attend(qkv, rotary.cos, rotary.sin, positions, kv, meta, self.num_heads)
            return o_proj.forward(out.reshape(t, self.q_size))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        out = backend.store_and_attend(q, k, v, kv, meta)
        return o_proj.forward(out.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    _parts = None  # (ln1 weight, eps, attention, ln2 weight, eps, mlp, reduce), bound by ``bind``

    def bind(self, reduce=None) -> None:
        """Read the final weights into plain tuples (see ``forward``). ``reduce``: under tensor
        parallelism, the in-place sum over ranks of the attention's and the MLP's partial outputs."""
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        self._parts = (ln1.weight, ln1.eps, self.self_attn, ln2.weight, ln2.eps, self.mlp, reduce)
        self.self_attn._projections = (self.self_attn.qkv_proj, self.self_attn.o_proj)
        self.mlp._projections = (self.mlp.gate_up_proj, self.mlp.down_proj)

    def forward(self, x, residual, positions, rotary, kv: LayerKV, meta, backend, ops):
        """(layer input, residual before it) -> (MLP output, residual before it); norms fused with the adds.

        Submodules are called through ``.forward``: ``nn.Module.__call__`` costs microseconds per
        call, which at batch 1 adds up to a tenth of the step over 30 layers; for the same reason
        the parts are read from one plain tuple, not through ``nn.Module.__getattr__`` each step
        (bound by ``bind`` when the model is finalised)."""
        w1, eps1, attention, w2, eps2, mlp, reduce = self._parts
        h, residual = ops.add_rms_norm(x, residual, w1, eps1)
        h = attention.forward(h, positions, rotary, kv, meta, backend)
        if reduce is not None:  # tensor parallel: o_proj is row-parallel, each rank holds a partial sum
            reduce(h)
        h, residual = ops.add_rms_norm(h, residual, w2, eps2)
        h = mlp.forward(h, ops)
        if reduce is not None:  # and so is down_proj
            reduce(h)
        return h, residual


class LlamaForCausalLM(nn.Module):
    """The whole decoder: embeddings, layers, final norm, LM head.

    Loading ends with ``finalize(backend, layer_loop)``, once the weights are final (loaded,
    quantized, prepacked): it binds what every forward reads and builds the C++ decoder stack.
    ``layer_loop``: ``"auto"`` runs the layers in one C++ call where ``decoder_stack`` applies
    (CPU, C++ layer ops and attention; bit-identical results), ``"python"`` always loops here.
    Changing the weights afterwards (``load_hf_state_dict``, ``use_gguf_quantized``,
    ``prepack_weights``) undoes it: ``forward`` refuses to run until ``finalize`` is called again."""

    layer_loop = "auto"
    # tensor parallel (parallel/shard.py): the in-place all-reduce after each row-parallel projection,
    # set before ``finalize``; None on one rank
    reduce_partial = None
    _stack = None            # the C++ DecoderStack for _finalized_for (None: the Python loop runs)
    _finalized_for = None    # the backend finalize bound the model to; None: not since the weights changed

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int,
                 device: str | torch.device = "cpu", layer_ops=None) -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.layer_ops = layer_ops or TorchLayerOps()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # tied: shares the embedding
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype,
                                      device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: KVCacheStorage, backend) -> torch.Tensor:
        """Hidden states [T, hidden] of the flat batch, after the final norm."""
        if self._finalized_for is not backend:
            raise RuntimeError("the model is not finalised for this attention backend: call finalize(backend) "
                               "once its weights are final")
        stack = self._stack
        if stack is not None:
            return stack.forward(self.embed_tokens(input_ids), positions, self.rotary.cos, self.rotary.sin,
                                 kv.layer_tensors, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                                 meta.block_tables)
        ops = self.layer_ops
        x, residual = self.embed_tokens(input_ids), None  # the forward owns residual: ops update it in place
        for layer, layer_kv in zip(self.layers, kv.layers, strict=True):
            x, residual = layer.forward(x, residual, positions, self.rotary, layer_kv, meta, backend, ops)
        return ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def finalize(self, backend, layer_loop: str = "auto", *, plan: KernelPlan | None = None, quantize=None) -> None:
        """The end of loading, once: ``quantize(self)`` attaches the quantized kernels (the
        quantization method's), ``plan`` gives the dense layouts (``prepack_weights``), then the final
        weights are bound for ``backend``: each layer's parts as plain tuples, and the C++ decoder
        stack where it applies and ``layer_loop`` is ``auto`` (``python``: the Python loop). Called
        again without ``plan`` and ``quantize``, it only binds (after a test changed a kernel)."""
        if layer_loop not in LAYER_LOOPS:
            raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {layer_loop!r}")
        if quantize is not None:
            quantize(self)
        if plan is not None:
            self.prepack_weights(plan)
        for layer in self.layers:
            layer.bind(self.reduce_partial)
        self.layer_loop = layer_loop
        # the C++ layer loop has no all-reduce between its layers: the Python loop runs a shard
        stacked = layer_loop == "auto" and self.reduce_partial is None
        self._stack = build_decoder_stack(self, backend) if stacked else None
        self._finalized_for = backend

    def decoder_stack(self, backend):
        """The C++ layer loop ``finalize`` built for ``backend``, or None (the Python loop runs)."""
        return self._stack if self._finalized_for is backend else None

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor:
        """Logits [rows, vocab] computed in the model dtype (as HF does), returned as float32, or in
        the model dtype where ``widen`` is False (the sampler widens them where it needs to)."""
        logits = self.lm_head.forward(hidden)
        return logits.float() if widen else logits

    def prepack_weights(self, plan: KernelPlan) -> int:
        """Dense layouts per ``plan`` (``kernel_plan``): oneDNN-packed where it packs, widened to
        float32 where the CPU lacks native bf16/fp16 GEMMs (``Linear.prepack``; as panels for the
        C++ panel GEMM where the plan says so, which needs the C++ layer ops); float32 models keep
        their plain weights. A widened 1-row LM head without another small-batch kernel keeps a
        natively packed bf16 copy where the plan says so (``NativePackedMatmul``). Returns how many
        were changed. A tied head drops only its own reference: the embedding keeps the dense table."""
        self._finalized_for = None  # the stack holds the kernels: finalize again
        if plan.compute == torch.float32 and self.dtype == torch.float32:
            return 0
        head = self.lm_head
        if plan.native_head_rows and head.small_batch is None:
            native = prepack_for_onednn(head.weight)  # before the float32 packing drops the weight
            if native is not None:
                head.use_quantized(NativePackedMatmul(native), plan.native_head_rows)
        compute = plan.compute if plan.widened else None
        panel_ops = None
        if plan.dense_kernel == "panels":
            panel_ops = getattr(self.layer_ops, "ops", None)
            if panel_ops is None or not panel_ops.has_panel_linear():
                raise RuntimeError("the kernel plan picks the AVX2 panel GEMM but the C++ layer ops lack it")
        return sum(m.prepack(compute, panel_ops) for m in self.modules() if isinstance(m, Linear))

    def use_gguf_quantized(self, quantized: dict[str, BlockQuantized], plan: KernelPlan | None = None,
                           max_rows: int | None = None, int4_kernel: str | None = None,
                           q8_0_kernel: str | None = None) -> int:
        """Attach small-batch kernels over GGUF blocks (HF-named, as the loader gives them) to every
        projection whose parts are all block-quantized alike; returns how many projections use them.
        The rows up to which each kernel runs are ``plan``'s crossovers for this CPU family
        (``int4_rows``, ``q8_0_rows``), or ``max_rows`` for both (default ``DEFAULT_MAX_ROWS``); the
        4-bit kernel is ``int4_kernel`` or else the plan's (``"torch"`` without a plan), the Q8_0 one
        ``q8_0_kernel`` or else the plan's (``"cpp"`` without a plan)."""
        ops, attached = self.layer_ops, 0
        int4 = int4_kernel or ("torch" if plan is None else plan.int4_kernel)
        q8_0 = q8_0_kernel or ("cpp" if plan is None else plan.q8_0_kernel)
        self._finalized_for = None  # the stack holds the kernels: finalize again

        def attach(linear: Linear, names: list[str]) -> None:
            nonlocal attached
            parts = [quantized.get(n) for n in names]
            blocks = BlockQuantized.cat(parts) if all(p is not None for p in parts) else None
            if blocks is None:
                return
            rows = max_rows
            if rows is None:
                rows = DEFAULT_MAX_ROWS if plan is None else plan.int4_rows if blocks.bits == 4 else plan.q8_0_rows
            kernel = None if rows == 0 else quantized_matmul(blocks, self.dtype, ops, int4, q8_0)
            if kernel is not None:
                linear.use_quantized(kernel, rows)
                attached += 1

        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attach(layer.self_attn.qkv_proj, [p + f"self_attn.{x}_proj.weight" for x in "qkv"])
            attach(layer.self_attn.o_proj, [p + "self_attn.o_proj.weight"])
            attach(layer.mlp.gate_up_proj, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
            attach(layer.mlp.down_proj, [p + "mlp.down_proj.weight"])
        attach(self.lm_head, ["model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"])
        return attached

    def use_int8_weights(self, max_rows: int, cpp_kernel: bool = False) -> int:
        """``quantization="int8"``: every decoder projection's weight replaced by int8 codes with a scale
        per output channel (``Int8ChannelMatmul``; steps of at most ``max_rows`` rows run its int8
        kernel: with ``cpp_kernel``, float32/float16 rows run our C++ Q8_0 kernel, where the C++
        layer ops built); embeddings, norms and the LM head stay as loaded. Returns how many were
        replaced."""
        ops = self.layer_ops if cpp_kernel and hasattr(self.layer_ops, "q8_0_linear") else None
        self._finalized_for = None  # the stack holds the kernels: finalize again
        replaced = 0
        for layer in self.layers:
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj):
                linear.use_int8_weight(Int8ChannelMatmul.quantize(linear.weight, ops), max_rows)
                replaced += 1
        return replaced

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Load HF-named weights (``model.layers.N.self_attn.q_proj.weight`` ...), fusing as we go."""
        cfg = self.config
        self._finalized_for = None  # the stack holds the weights: finalize again
        w = {k.removeprefix("model."): v for k, v in weights.items()}
        own: dict[str, torch.Tensor] = {"embed_tokens.weight": w.pop("embed_tokens.weight"),
                                        "norm.weight": w.pop("norm.weight")}
        head = w.pop("lm_head.weight", None)
        if not cfg.tie_word_embeddings:
            own["lm_head.weight"] = own["embed_tokens.weight"] if head is None else head
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            a = p + "self_attn."
            own[a + "qkv_proj.weight"] = torch.cat(
                [w.pop(a + "q_proj.weight"), w.pop(a + "k_proj.weight"), w.pop(a + "v_proj.weight")])
            if cfg.attention_bias:
                own[a + "qkv_proj.bias"] = torch.cat(
                    [w.pop(a + "q_proj.bias"), w.pop(a + "k_proj.bias"), w.pop(a + "v_proj.bias")])
            own[a + "o_proj.weight"] = w.pop(a + "o_proj.weight")
            own[p + "mlp.gate_up_proj.weight"] = torch.cat(
                [w.pop(p + "mlp.gate_proj.weight"), w.pop(p + "mlp.up_proj.weight")])
            own[p + "mlp.down_proj.weight"] = w.pop(p + "mlp.down_proj.weight")
            own[p + "input_layernorm.weight"] = w.pop(p + "input_layernorm.weight")
            own[p + "post_attention_layernorm.weight"] = w.pop(p + "post_attention_layernorm.weight")
        leftovers = [k for k in w if not k.endswith("rotary_emb.inv_freq")]
        if leftovers:
            raise KeyError(f"unexpected weights: {leftovers[:5]}")
        device = self.rotary.cos.device
        own = {k: v.to(device=device, dtype=self.dtype).contiguous() for k, v in own.items()}
        missing, unexpected = self.load_state_dict(own, strict=False, assign=True)
        missing = [m for m in missing if not m.startswith("rotary.")
                   and not (cfg.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise KeyError(f"weights missing {missing[:5]}, unexpected {unexpected[:5]}")
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
