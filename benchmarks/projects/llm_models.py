"""The model of benchmarks/llm.py's wheel: a Llama of TinyLlama's shape in bfloat16 (copied in as
llmpkg/models.py, LAYERS set by --layers)."""

import torch
from torch import nn

LAYERS = 22


class LastLogits(nn.Module):
    def __init__(self, layers):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=layers,
            num_attention_heads=32,
            num_key_value_heads=4,
            vocab_size=32000,
            max_position_embeddings=2048,
            use_cache=False,
        )
        self.llama = LlamaForCausalLM(config)

    def forward(self, input_ids):
        return self.llama(input_ids=input_ids).logits[:, -1, :]


def llama():
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # made in bfloat16: never a float32 copy
    try:
        return LastLogits(LAYERS).eval()
    finally:
        torch.set_default_dtype(default)
