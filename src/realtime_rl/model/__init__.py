"""The Qwen3-family model (dense and MoE) with routing capture/replay, HF checkpoints, tokenizer, chat format.

Public API (later stages import only these names):

    load_checkpoint(path, device=None, dtype=None) -> Checkpoint(model, tokenizer, config, path, generation_config)
    save_checkpoint(path, model, tokenizer=None, generation_config=None)
    Qwen3ForCausalLM(config)(input_ids_BT, positions_BT, kv_cache=, cache_slots=, capture_routing=, replay_routing=)
    KVCache(config, num_slots, max_seq_len, dtype, device)
    sequence_logprobs(model, token_ids, replay_routing=None) -> (logprobs of token_ids[1:], routing used)
    Tokenizer.train / from_dir / encode / decode / encode_chat
    render_messages, parse_assistant, CHAT_TEMPLATE, render_tool_responses
    generate(model, prompt_ids, max_new_tokens, stop_ids, temperature, top_p, seed) -> Generated
"""

from realtime_rl.model.chat import (
    CHAT_TEMPLATE, SPECIAL_TOKENS, parse_assistant, render_messages, render_tool_responses,
)
from realtime_rl.model.checkpoint import (
    Checkpoint,
    config_from_hf,
    config_to_hf,
    load_checkpoint,
    save_checkpoint,
    torch_device,
)
from realtime_rl.model.corpus import generate_corpus
from realtime_rl.model.generate import Generated, generate, sample_token
from realtime_rl.model.kv_cache import KVCache
from realtime_rl.model.qwen3 import ModelOutput, Qwen3ForCausalLM, routing_dtype, sequence_logprobs
from realtime_rl.model.tokenizer import Tokenizer

__all__ = [
    "CHAT_TEMPLATE", "SPECIAL_TOKENS", "Checkpoint", "Generated", "generate", "sample_token", "KVCache", "ModelOutput", "Qwen3ForCausalLM", "Tokenizer",
    "config_from_hf", "config_to_hf", "generate_corpus", "load_checkpoint", "parse_assistant", "render_messages", "render_tool_responses",
    "routing_dtype", "save_checkpoint", "sequence_logprobs", "torch_device",
]
