"""Config validation: every bad value raises with the field's name."""

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig, parse_bytes


@pytest.mark.parametrize("bs", [8, 16, 32, 64, 128, 24])
def test_block_sizes_8_to_128_accepted(bs):
    assert CacheConfig(block_size=bs).block_size == bs


@pytest.mark.parametrize("bs", [0, 1, 4, 7, 129, 256, 16.0, True])
def test_other_block_sizes_rejected(bs):
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=bs)


@pytest.mark.parametrize("text,expected", [
    ("512MiB", 512 * 2**20), ("1GiB", 2**30), ("2GB", 2 * 10**9), ("1.5 MiB", int(1.5 * 2**20)),
    (4096, 4096), ("4096", 4096)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["lots", "-1MiB", 0, -5, "12 parsecs", None])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_bytes(bad)


def test_num_kv_blocks_and_scheduler_limits_validated():
    with pytest.raises(ValueError, match="num_kv_blocks"):
        CacheConfig(num_kv_blocks=0)
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        with pytest.raises(ValueError, match=name):
            SchedulerConfig(**{name: 0})
