"""Config validation: every bad value raises with the field's name; byte sizes by pydantic."""

import pytest

from pagedllm.config import CacheConfig, EngineOptions, SchedulerConfig


@pytest.mark.parametrize("bs", [8, 16, 32, 64, 128, 24])
def test_block_sizes_8_to_128_accepted(bs):
    assert CacheConfig(block_size=bs).block_size == bs


@pytest.mark.parametrize("bs", [0, 1, 4, 7, 129, 256, 16.0, True, "16"])
def test_other_block_sizes_rejected(bs):
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=bs)


@pytest.mark.parametrize("text,expected", [
    ("512MiB", 512 * 2**20), ("1GiB", 2**30), ("2GB", 2 * 10**9), ("1.5 MiB", int(1.5 * 2**20)),
    (4096, 4096), ("4096", 4096)])
def test_byte_sizes(text, expected):
    assert CacheConfig(kv_cache_memory=text).kv_cache_memory == expected
    assert CacheConfig(swap_space=text).swap_space == expected


@pytest.mark.parametrize("bad", ["lots", "-1MiB", 0, -5, "12 parsecs", None])
def test_bad_byte_sizes_rejected(bad):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        CacheConfig(kv_cache_memory=bad)


def test_num_kv_blocks_and_scheduler_limits_validated():
    with pytest.raises(ValueError, match="num_kv_blocks"):
        CacheConfig(num_kv_blocks=0)
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        with pytest.raises(ValueError, match=name):
            SchedulerConfig(**{name: 0})


@pytest.mark.parametrize("bad,field", [({"eviction_policy": "mru"}, "eviction_policy"),
                                       ({"prefix_caching_hash_algo": "md5"}, "prefix_caching_hash_algo"),
                                       ({"kv_layout": "ring"}, "kv_layout"), ({"dtype": "int8"}, "dtype"),
                                       ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"),
                                       ({"preemption_mode": "drop"}, "preemption_mode"),
                                       ({"blocksize": 16}, "blocksize")])
def test_engine_options_reject_bad_or_unknown_options_by_name(bad, field):
    with pytest.raises(ValueError, match=field):
        EngineOptions(**bad)


def test_configs_are_frozen_and_engine_options_split_into_them():
    opts = EngineOptions(block_size=32, max_num_seqs=4, kv_cache_memory="1GiB", kv_layout="contiguous")
    with pytest.raises(Exception, match="frozen|cannot assign"):
        opts.block_size = 8
    assert opts.cache_config() == CacheConfig(block_size=32, kv_cache_memory=2**30, kv_layout="contiguous")
    assert opts.scheduler_config(512) == SchedulerConfig(max_num_seqs=4, max_model_len=512)


@pytest.mark.parametrize("share,normalised", [("25%", "25%"), (" 100 %", "100%"), ("0.5%", "0.5%")])
def test_kv_cache_memory_accepts_a_share_of_free_memory(share, normalised):
    assert CacheConfig(kv_cache_memory=share).kv_cache_memory == normalised


@pytest.mark.parametrize("bad,message", [("0%", "above 0%"), ("101%", "at most 100%"), ("-5%", "above 0%"),
                                         ("x%", "not a share of free memory")])
def test_bad_shares_of_free_memory_rejected(bad, message):
    with pytest.raises(ValueError, match=message):
        CacheConfig(kv_cache_memory=bad)


def test_a_share_of_free_memory_sizes_the_pool_from_what_the_host_has_free():
    import torch

    from pagedllm.config import ModelConfig
    from pagedllm.kvstore.spec import KVSpec
    from pagedllm.kvstore.storage import free_device_memory, num_blocks_for

    model = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    spec = KVSpec.for_model(model, 16, torch.float32)
    per_block = spec.bytes_per_block
    assert per_block == 2 * 2 * 16 * 2 * 16 * 4  # K and V x layers x block x KV heads x head dim x 4 bytes
    free = free_device_memory("cpu")
    n = num_blocks_for(spec, CacheConfig(kv_cache_memory="1%"), "cpu")
    assert abs(n - 0.01 * free / per_block) <= 0.001 * free / per_block + 1  # free memory moves a little


@pytest.mark.parametrize("bad,message", [("lots", "could not parse value and unit"), ("12 parsecs", "byte unit"),
                                         (None, "give bytes"), (True, "give bytes"), (0, "more than 0 bytes")])
def test_a_bad_kv_cache_memory_gets_one_precise_message(bad, message):
    from pagedllm.engine.builder import build_engine
    from pagedllm.errors import ConfigError

    with pytest.raises(ConfigError, match=message) as info:
        build_engine(kv_cache_memory=bad)
    text = str(info.value)
    assert text.count("kv_cache_memory") == 1 and "constrained" not in text and "function-after" not in text


def test_the_remaining_configs_are_validated_by_pydantic_naming_the_field():
    from pydantic import ValidationError

    from pagedllm.config import EngineConfig, ModelConfig, SchedulerConfig
    from pagedllm.server.limits import ServerLimits

    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, max_position_embeddings=512)
    with pytest.raises(ValidationError, match="vocab_size"):
        ModelConfig(**{**shape, "vocab_size": 0})
    with pytest.raises(ValidationError, match="must be a multiple of num_kv_heads"):
        ModelConfig(**{**shape, "num_kv_heads": 3})
    model = ModelConfig(**shape)
    with pytest.raises(ValidationError, match="dtype"):
        EngineConfig(model=model, cache=CacheConfig(), scheduler=SchedulerConfig(), dtype="auto")  # unresolved
    with pytest.raises(ValidationError, match="quantization"):
        EngineConfig(model=model, cache=CacheConfig(), scheduler=SchedulerConfig(), quantization="auto")
    with pytest.raises(ValidationError, match="max_stop"):
        ServerLimits(max_stop=-1)
    with pytest.raises(ValidationError, match="header_timeout_s"):
        ServerLimits(header_timeout_s=0)
    with pytest.raises(ValidationError, match="max_prompt_bytes"):
        ServerLimits(max_prompt_bytes=True)  # strict: a bool is not a byte count
    assert ServerLimits(max_prompt_bytes=None).max_stop == 64
