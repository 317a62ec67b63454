"""memplan.torch on a zoo of real architectures, each at a small size with
its library's default configuration (dropout and stochastic depth
included): captured, planned, run in memplan's order and in its arena, and
equal to eager PyTorch (the :class:`test_torch.Harness` checks: losses,
parameters and buffers within ``rtol=1e-6, atol=1e-7``, tracked bytes equal
to the plan's, the arena's contents, the generator's state).

Hugging Face decoders (Mistral, Qwen2, Gemma, Phi, OPT, BLOOM, Falcon,
GPT-J, GPT-NeoX, Mixtral's mixture of experts) and encoders (BERT, RoBERTa,
DistilBERT, T5, ViT), torchvision's MobileNetV3, EfficientNet, Swin,
ShuffleNet, SqueezeNet, GoogLeNet, RegNet and DenseNet. The test file
``test_torch.py`` covers GPT-2, Llama, ResNet-50, ViT and ConvNeXt.
"""

import unittest

import torch
import torch.nn.functional as F

from test_torch import Harness, classify

TOKENS = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=64)


def lm(m, b):
    return m(input_ids=b, labels=b).loss


def image_classifier(m, b):
    return F.cross_entropy(m(pixel_values=b[0]).logits, b[1])


def decoders():
    import transformers as T

    return {
        "mistral": T.MistralForCausalLM(T.MistralConfig(**TOKENS, num_key_value_heads=2)),
        "qwen2": T.Qwen2ForCausalLM(T.Qwen2Config(**TOKENS, num_key_value_heads=2)),
        "gemma": T.GemmaForCausalLM(T.GemmaConfig(**TOKENS, num_key_value_heads=2, head_dim=16)),
        "phi": T.PhiForCausalLM(T.PhiConfig(**TOKENS)),
        "opt": T.OPTForCausalLM(T.OPTConfig(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                            num_attention_heads=4, max_position_embeddings=64,
                                            word_embed_proj_dim=64)),
        "bloom": T.BloomForCausalLM(T.BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4)),
        "falcon": T.FalconForCausalLM(T.FalconConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                                     num_attention_heads=4)),
        "gptj": T.GPTJForCausalLM(T.GPTJConfig(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                               rotary_dim=8)),
        "gpt-neox": T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**TOKENS)),
        "mixtral": T.MixtralForCausalLM(T.MixtralConfig(**TOKENS, num_key_value_heads=2, num_local_experts=4,
                                                        num_experts_per_tok=2)),
    }


def encoders():
    import transformers as T

    return {
        "bert": T.BertForMaskedLM(T.BertConfig(**TOKENS)),
        "roberta": T.RobertaForMaskedLM(T.RobertaConfig(**TOKENS)),
        "distilbert": T.DistilBertForMaskedLM(T.DistilBertConfig(
            vocab_size=256, dim=64, hidden_dim=128, n_layers=2, n_heads=4, max_position_embeddings=64)),
        "t5": T.T5ForConditionalGeneration(T.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                      num_heads=4, decoder_start_token_id=0, pad_token_id=0)),
    }


def vision():
    import torchvision.models as tvm

    return {
        "mobilenet_v3_small": tvm.mobilenet_v3_small(num_classes=10),
        "efficientnet_b0": tvm.efficientnet_b0(num_classes=10),
        "swin": tvm.SwinTransformer(patch_size=[4, 4], embed_dim=32, depths=[2, 2], num_heads=[2, 4],
                                    window_size=[4, 4], stochastic_depth_prob=0.2, num_classes=10),
        "shufflenet_v2": tvm.shufflenet_v2_x0_5(num_classes=10),
        "squeezenet": tvm.squeezenet1_0(num_classes=10),
        "googlenet": tvm.googlenet(num_classes=10, aux_logits=False, init_weights=True),
        "regnet_y_400mf": tvm.regnet_y_400mf(num_classes=10),
        "densenet": tvm.DenseNet(growth_rate=8, block_config=(2, 2), num_init_features=16, num_classes=10),
    }


class ModelZoo(unittest.TestCase):
    def check(self, models, batch, loss_fn):
        for name, model in models.items():
            with self.subTest(model=name):
                torch.manual_seed(0)
                Harness(self, model, batch, loss_fn).run(steps=1)

    def test_huggingface_decoders(self):
        torch.manual_seed(0)
        self.check(decoders(), torch.randint(0, 256, (2, 32)), lm)

    def test_huggingface_encoders(self):
        torch.manual_seed(0)
        # RoBERTa's position ids start after its padding id 1.
        self.check(encoders(), torch.randint(2, 256, (2, 32)), lm)
        import transformers as T

        torch.manual_seed(0)
        vit = T.ViTForImageClassification(T.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                      intermediate_size=128, image_size=32, patch_size=8,
                                                      num_labels=10, hidden_dropout_prob=0.1))
        self.check({"hf-vit": vit}, (torch.randn(2, 3, 32, 32), torch.tensor([1, 2])), image_classifier)

    def test_torchvision(self):
        torch.manual_seed(0)
        self.check(vision(), (torch.randn(2, 3, 64, 64), torch.tensor([1, 2])), classify)


if __name__ == "__main__":
    unittest.main()
