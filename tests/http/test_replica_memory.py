"""A replica reports its memory: what the budgets allocated (weights, KV pool) and its resident set."""

import torch


def test_the_replica_reports_weights_kv_pool_and_resident_memory(replica):
    stats = replica.engine_stats()
    engine = replica.engine.engine
    config = engine.model_config
    # Independently: distinct parameter storage (tied embeddings count once), float32 here.
    weights = {p.data_ptr(): p.numel() * p.element_size() for p in engine.model.parameters()}
    assert stats["num_weight_bytes"] >= sum(weights.values()) > 0
    head_dim = config.hidden_size // config.num_attention_heads
    bytes_per_block = 2 * config.num_hidden_layers * engine.config.block_size * config.num_key_value_heads \
        * head_dim * torch.float32.itemsize
    assert stats["num_kv_cache_bytes"] == stats["num_blocks"] * bytes_per_block
    assert stats["num_kv_cache_bytes"] <= engine.config.kv_cache_bytes
    assert stats["num_resident_bytes"] > stats["num_weight_bytes"]  # the loaded weights are resident
    assert stats["num_linear_state_bytes"] == 0 and stats["num_checkpoint_bytes"] == 0  # not a hybrid model
