"""The real-size models of benchmarks/peers.py's wheel, from transformers' default configs (copied in as
peerpkg/models.py)."""

import torch
from torch import nn


class Tensor(nn.Module):
    """A transformers model as a function of one tensor to one tensor."""

    def __init__(self, model, argument, field):
        super().__init__()
        self.model, self.argument, self.field = model, argument, field

    def forward(self, x):
        return getattr(self.model(**{self.argument: x}), self.field)


def trained_like(model):
    """``model`` with its activations at the scale training leaves them: convolutions initialised as
    torchvision initialises these architectures (Kaiming, fan-out), batch norms at scale 1 with their
    statistics measured on random images. With transformers' initial values (weights of std 0.02,
    statistics of mean 0 and variance 1) activations shrink layer by layer, in EfficientNet to zero
    through subnormal floats, which every side computes far slower on Intel CPUs."""
    for layer in model.modules():
        if isinstance(layer, nn.Conv2d):
            nn.init.kaiming_normal_(layer.weight, mode="fan_out")
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)
        if isinstance(layer, nn.modules.batchnorm._BatchNorm):
            layer.reset_parameters()  # a scale of 1 too: transformers draws EfficientNet's at std 0.02
            layer.momentum = None  # a plain average over the batches below
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.train()
        for _ in range(4):
            model(torch.rand(4, 3, 224, 224, generator=generator))
    return model.eval()


def bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    return Tensor(BertModel(BertConfig(), add_pooling_layer=False), "input_ids", "last_hidden_state").eval()


def gpt2():
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    return Tensor(GPT2Model(GPT2Config(use_cache=False)), "input_ids", "last_hidden_state").eval()


def resnet50():
    from transformers import ResNetConfig, ResNetModel

    torch.manual_seed(0)
    return Tensor(ResNetModel(ResNetConfig()), "pixel_values", "pooler_output").eval()


def vit():
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(0)
    return Tensor(ViTModel(ViTConfig(), add_pooling_layer=False), "pixel_values", "last_hidden_state").eval()


def distilbert():
    from transformers import DistilBertConfig, DistilBertModel

    torch.manual_seed(0)
    return Tensor(DistilBertModel(DistilBertConfig()), "input_ids", "last_hidden_state").eval()


def t5encoder():
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    return Tensor(T5EncoderModel(T5Config()), "input_ids", "last_hidden_state").eval()


def whisperencoder():
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    torch.manual_seed(0)
    return Tensor(WhisperEncoder(WhisperConfig()), "input_features", "last_hidden_state").eval()


def convnext():
    from transformers import ConvNextConfig, ConvNextModel

    torch.manual_seed(0)
    return Tensor(ConvNextModel(ConvNextConfig()), "pixel_values", "last_hidden_state").eval()


def swin():
    from transformers import SwinConfig, SwinModel

    torch.manual_seed(0)
    return Tensor(SwinModel(SwinConfig()), "pixel_values", "last_hidden_state").eval()


def mobilenetv2():
    from transformers import MobileNetV2Config, MobileNetV2Model

    torch.manual_seed(0)
    return trained_like(Tensor(MobileNetV2Model(MobileNetV2Config()), "pixel_values", "last_hidden_state"))


def efficientnet():
    from transformers import EfficientNetConfig, EfficientNetModel

    torch.manual_seed(0)
    return trained_like(Tensor(EfficientNetModel(EfficientNetConfig()), "pixel_values", "pooler_output"))


def images():
    """int8's calibration samples for the image models: 4 random batches, as the convolutions' ranges."""
    generator = torch.Generator().manual_seed(2)
    return [torch.rand(1, 3, 224, 224, generator=generator) for _ in range(4)]
