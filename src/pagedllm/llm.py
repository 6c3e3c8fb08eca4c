"""LLM: the offline, vLLM-compatible entry point (``generate`` and ``chat``) over an ``Engine``."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm.auto import tqdm

from pagedllm.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from pagedllm.engine.engine import Engine
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.sampling_params import SamplingParams

Prompt = str | list[int] | dict


class LLM:
    """Load a model once, then generate for batches of prompts.

    ``model=None`` is the embedded SmolLM2-135M-Instruct GGUF. Other models: a local ``.gguf``
    file or a local HF folder (config.json + safetensors [+ tokenizer]).
    """

    def __init__(self, model: str | None = None, **engine_options) -> None:
        """Options (all keyword, see docs/api.md): dtype="auto", block_size=16,
        kv_cache_memory="512MiB", num_kv_blocks=None, max_num_seqs=64, max_num_batched_tokens=1024,
        max_model_len=None, seed=0, device="cpu", attention_backend="auto",
        enable_prefix_caching=True, eviction_policy="lru", kv_layout="paged",
        contiguous_reservation="max_model_len", preemption_mode="recompute", swap_space="256MiB",
        quantization="auto"."""
        self.engine = Engine.from_options(model=model, **engine_options)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def kv_cache_stats(self) -> dict[str, float | int]:
        """Block pool stats: num_blocks, block_size, num_free_blocks, usage, num_preemptions..."""
        return self.engine.kv_cache_stats()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or a list; outputs come back in input order."""
        if isinstance(prompts, str | dict) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        return self._run(prompts, params, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list) and generate."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            ids = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt_token_ids": ids})
        outs = self.generate(prompts, sampling_params, use_tqdm)
        for out in outs:
            out.prompt = tok.decode(out.prompt_token_ids, skip_special_tokens=False)
        return outs

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM-compatible beam search; beams share KV blocks through fork / copy-on-write."""
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return beam_search(self.engine, list(prompts), params)

    def _run(self, prompts: list[Prompt], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                rid = engine.new_request_id()
                engine.add_request(rid, prompt, p)
                ids.append(rid)
        except Exception:
            for rid in ids:
                engine.abort(rid)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm)
        try:
            while len(results) < len(ids):
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                engine.abort(rid)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in ids]
