"""LLM: the offline, vLLM-compatible entry point over an ``Engine``.

``generate`` / ``chat`` return each request's final output, in input order; ``generate_stream``
yields outputs as the engine produces them (cumulative, delta or final, per the request's
``SamplingParams.output_kind``); ``beam_search`` runs beam-search requests through the same
engine loop. Every call either queues all its prompts or none (a bad one raises first), and
aborts its requests if it is interrupted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from tqdm.auto import tqdm

from pagedllm.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedllm.engine.engine import Engine
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.parallel.launch import build_engine

Prompt = str | list[int] | dict


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text, dict, or a flat list of token ids) or a list of prompts -> a list."""
    if isinstance(prompts, str | dict):
        return [prompts]
    prompts = list(prompts)
    if prompts and not isinstance(prompts[0], str | dict | list | tuple) and hasattr(prompts[0], "__index__"):
        return [prompts]  # token ids (Python, numpy or torch integers)
    return prompts


class LLM:
    """Load a model once, then generate for batches of prompts.

    ``model=None`` is the embedded SmolLM2-135M-Instruct GGUF. Other models: a local ``.gguf``
    file or a local HF folder (config.json + safetensors [+ tokenizer]).
    """

    def __init__(self, model: str | None = None, **engine_options) -> None:
        """``engine_options``: the fields of ``pagedllm.config.EngineOptions`` (dtype, block_size,
        kv_cache_memory, max_num_seqs, ...; the table in docs/api.md). An unknown option or a bad
        value raises ``ConfigError`` (a ``ValueError``) naming it, before anything is loaded."""
        self.engine = build_engine(model=model, **engine_options)

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel worker processes now (they also stop when the LLM is
        collected or the interpreter exits); nothing to do on one rank."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (vLLM's ``LLM.reset_prefix_cache``); False while requests run.
        With ``kv_events_endpoint`` set, subscribers get ``AllBlocksCleared``."""
        return self.engine.reset_prefix_cache()

    def kv_cache_stats(self) -> dict[str, float | int]:
        """Block pool stats: num_blocks, block_size, num_free_blocks, usage, num_preemptions..."""
        return self.engine.kv_cache_stats()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or a list; the final outputs come back in input order."""
        prompts = _as_list(prompts)
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                  for p in self._params(prompts, sampling_params)]
        ids = submit(self.engine, prompts, params)
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompts), desc="generate", unit="req", disable=not use_tqdm) as bar:
            for out in drain(self.engine, ids):
                results[out.request_id] = out
                bar.update(1)
        return [results[rid] for rid in ids]

    def generate_stream(self, prompts: Prompt | Sequence[Prompt],
                        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                        ) -> Iterator[RequestOutput]:
        """Yield outputs as they are produced, each as its request's ``output_kind`` says
        (``CUMULATIVE`` by default; ``DELTA`` for only what is new; ``FINAL_ONLY`` once). Stopping the
        iteration early aborts the requests still running."""
        prompts = _as_list(prompts)
        yield from drain(self.engine, submit(self.engine, prompts, self._params(prompts, sampling_params)))

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
        return run_beam_search(self.engine, _as_list(prompts), params)

    @staticmethod
    def _params(prompts: list[Prompt], sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * len(prompts)
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * len(prompts)
        params = list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        return params


def submit(engine: Engine, prompts: list[Prompt], params: Sequence[SamplingParams | BeamSearchParams]) -> list[str]:
    """Queue every prompt, or none of them if one is rejected (the error is raised). Returns the ids."""
    ids: list[str] = []
    try:
        for prompt, p in zip(prompts, params, strict=True):
            rid = engine.new_request_id()
            engine.add_request(rid, prompt, p)
            ids.append(rid)
    except Exception:
        for rid in ids:
            engine.abort(rid)
        raise
    return ids


def drain(engine: Engine, ids: list[str]) -> Iterator[RequestOutput]:
    """Step the engine until every request in ``ids`` has finished, yielding their outputs; requests
    still running when the iteration stops early (or raises) are aborted."""
    pending = set(ids)
    try:
        while pending:
            outputs = engine.step()
            if not outputs and not engine.has_unfinished():
                raise RuntimeError(f"the engine finished without answering requests {sorted(pending)}")
            for out in outputs:
                if out.request_id in pending:
                    if out.finished:
                        pending.discard(out.request_id)
                    yield out
    finally:
        for rid in pending:
            engine.abort(rid)


def run_beam_search(engine: Engine, prompts: list[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Beam search for each prompt through ``engine``, as vLLM's ``LLM.beam_search`` returns it."""
    ids = submit(engine, prompts, [params] * len(prompts))
    results = {out.request_id: out for out in drain(engine, ids) if out.finished}
    outputs = []
    for rid in ids:
        out = results[rid]
        if out.error is not None:
            raise RuntimeError(out.error)
        outputs.append(BeamSearchOutput([BeamSearchSequence(out.prompt_token_ids + c.token_ids, c.cumulative_logprob,
                                                            c.text, c.finish_reason) for c in out.outputs]))
    return outputs
