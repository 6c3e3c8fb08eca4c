"""pytest configuration for vLLM's entrypoint tests run against pagedllm (our own, not vLLM's).

vLLM's tests load tokenizers and LoRA adapters from the Hugging Face hub, which this machine
cannot reach. Before any test module is imported, this points both at what is here:
``vllm.tokenizers.get_tokenizer(any name)`` loads the tokenizer of the model pagedllm serves
(``PAGEDLLM_HF_DIR``, exported by ``make peers``), and the hub client's ``snapshot_download``
returns an empty folder (pagedllm has no LoRA, so the LoRA cases fail on their model name, which
is the honest outcome). A test that counts another model's tokens therefore counts SmolLM2's.
"""

from __future__ import annotations

import os
import tempfile

import vllm.tokenizers
import vllm.transformers_utils.repo_utils as repo_utils

HF_DIR = os.environ["PAGEDLLM_HF_DIR"]
_original_get_tokenizer = vllm.tokenizers.get_tokenizer


def get_served_models_tokenizer(tokenizer_name=None, *args, **kwargs):
    """The served model's tokenizer, whatever hub name the test asks for."""
    kwargs.pop("trust_remote_code", None)
    kwargs.pop("tokenizer_mode", None)
    return _original_get_tokenizer(HF_DIR, *args, **kwargs)


class OfflineHub:
    """What the tests ask of the hub client, answered without the network."""

    def snapshot_download(self, repo_id: str, **_kwargs) -> str:
        folder = os.path.join(tempfile.gettempdir(), "pagedllm-no-hub", repo_id.replace("/", "--"))
        os.makedirs(folder, exist_ok=True)
        return folder


vllm.tokenizers.get_tokenizer = get_served_models_tokenizer
repo_utils.hf_api = lambda *args, **kwargs: OfflineHub()
