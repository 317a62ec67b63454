"""memplan.torch on a zoo of real architectures, each at a small size with
its library's default configuration (dropout and stochastic depth
included): captured, planned, run in memplan's order and in its arena, and
equal to eager PyTorch (the :class:`test_torch.Harness` checks: losses,
parameters, buffers and optimizer state within ``rtol=1e-6, atol=1e-7``,
tracked bytes equal to the plan's, the arena's contents, the generator's
state), in float32 and again under bf16 autocast.

Hugging Face decoders (Mistral, Qwen2/3 and Qwen3's mixture of experts,
Gemma 1-3, Phi and Phi-3, OPT, BLOOM, Falcon, GPT-J, GPT-NeoX, Mixtral,
DeepSeek-V3, StableLM, Starcoder2, OLMo 2, Cohere, GPT-BigCode, CodeGen,
MPT, Mamba 1-2, Llama with Llama 3's RoPE scaling), encoders and
encoder-decoders (BERT, RoBERTa, DistilBERT, ALBERT, ELECTRA, DeBERTa-v2,
ModernBERT, T5, BART, Whisper, CLIP), vision models (Hugging Face ViT,
DINOv2, BEiT, ConvNeXt, Swin V2, SegFormer; torchvision's MobileNetV3,
EfficientNet, Swin, ShuffleNet, SqueezeNet, GoogLeNet, RegNet and
DenseNet), and the loops around a model (:class:`TrainingLoops`). The test
file ``test_torch.py`` covers GPT-2, Llama, ResNet-50, ViT and ConvNeXt.
"""

import unittest

import torch
import torch.nn as nn
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
        "llama3-rope-scaling": T.LlamaForCausalLM(T.LlamaConfig(**TOKENS, num_key_value_heads=2, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})),
        "gemma2": T.Gemma2ForCausalLM(T.Gemma2Config(**TOKENS, num_key_value_heads=2, head_dim=16,
                                                     sliding_window=8)),
        "gemma3": T.Gemma3ForCausalLM(T.Gemma3TextConfig(**TOKENS, num_key_value_heads=2, head_dim=16,
                                                         sliding_window=8)),
        "qwen3": T.Qwen3ForCausalLM(T.Qwen3Config(**TOKENS, num_key_value_heads=2, head_dim=16)),
        "qwen3-moe": T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**TOKENS, num_key_value_heads=2, head_dim=16,
                                                            num_experts=4, num_experts_per_tok=2,
                                                            moe_intermediate_size=32)),
        "deepseek-v3": T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
            **TOKENS, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, n_group=1, topk_group=1)),
        "phi3": T.Phi3ForCausalLM(T.Phi3Config(**TOKENS, num_key_value_heads=2, pad_token_id=0)),
        "stablelm": T.StableLmForCausalLM(T.StableLmConfig(**TOKENS, num_key_value_heads=4)),
        "starcoder2": T.Starcoder2ForCausalLM(T.Starcoder2Config(**TOKENS, num_key_value_heads=2)),
        "olmo2": T.Olmo2ForCausalLM(T.Olmo2Config(**TOKENS, pad_token_id=0)),
        "cohere": T.CohereForCausalLM(T.CohereConfig(**TOKENS, pad_token_id=0)),
        "gpt-bigcode": T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(vocab_size=256, n_embd=64, n_layer=2, n_head=4,
                                                                  n_positions=64)),
        "codegen": T.CodeGenForCausalLM(T.CodeGenConfig(vocab_size=256, n_embd=64, n_layer=2, n_head=4,
                                                        n_positions=64, rotary_dim=8)),
        "mpt-alibi": T.MptForCausalLM(T.MptConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4,
                                                  max_seq_len=64)),
        "mamba": T.MambaForCausalLM(T.MambaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                                  state_size=8)),
        "mamba2": T.Mamba2ForCausalLM(T.Mamba2Config(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                                     state_size=8, num_heads=4, head_dim=32, n_groups=1,
                                                     chunk_size=16)),
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
        "bart": T.BartForConditionalGeneration(T.BartConfig(
            vocab_size=256, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64)),
        "electra": T.ElectraForMaskedLM(T.ElectraConfig(**TOKENS, embedding_size=32)),
        "albert": T.AlbertForMaskedLM(T.AlbertConfig(**TOKENS, embedding_size=32)),
        "deberta-v2": T.DebertaV2ForMaskedLM(T.DebertaV2Config(**TOKENS)),
        "modernbert": T.ModernBertForMaskedLM(T.ModernBertConfig(**TOKENS, pad_token_id=0, local_attention=16)),
    }


def hf_vision():
    import transformers as T

    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32,
                 patch_size=8, num_labels=10)
    return {
        "hf-vit": T.ViTForImageClassification(T.ViTConfig(**small, hidden_dropout_prob=0.1)),
        "dinov2": T.Dinov2ForImageClassification(T.Dinov2Config(**small)),
        "beit": T.BeitForImageClassification(T.BeitConfig(**small)),
        "hf-convnext": T.ConvNextForImageClassification(T.ConvNextConfig(
            hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, num_labels=10, image_size=32)),
        "swinv2": T.Swinv2ForImageClassification(T.Swinv2Config(
            image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
            num_labels=10)),
        "segformer": T.SegformerForImageClassification(T.SegformerConfig(
            num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
            num_attention_heads=[1, 2], decoder_hidden_size=32, num_labels=10)),
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

    def test_huggingface_vision(self):
        torch.manual_seed(0)
        self.check(hf_vision(), (torch.randn(2, 3, 32, 32), torch.tensor([1, 2])), image_classifier)

    def test_huggingface_speech_and_contrastive(self):
        import transformers as T

        torch.manual_seed(0)
        whisper = T.WhisperForConditionalGeneration(T.WhisperConfig(
            vocab_size=256, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
            max_source_positions=32, max_target_positions=32, decoder_start_token_id=1, pad_token_id=0))
        self.check({"whisper": whisper}, (torch.randn(2, 16, 64), torch.randint(2, 256, (2, 8))),
                   lambda m, b: m(input_features=b[0], labels=b[1]).loss)
        torch.manual_seed(0)
        clip = T.CLIPModel(T.CLIPConfig(
            text_config=dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, max_position_embeddings=16),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               image_size=32, patch_size=8),
            projection_dim=16))
        self.check({"clip": clip}, (torch.randint(1, 256, (4, 8)), torch.randn(4, 3, 32, 32)),
                   lambda m, b: m(input_ids=b[0], pixel_values=b[1], return_loss=True).loss)

    def test_torchvision(self):
        torch.manual_seed(0)
        self.check(vision(), (torch.randn(2, 3, 64, 64), torch.tensor([1, 2])), classify)

    def test_every_family_under_bf16_autocast(self):
        # Mixed precision as it is written on the CPU: the forward under
        # bf16 autocast over f32 weights. Normalisations then see bf16
        # inputs with f32 weights; before the capture recorded the real
        # (f32) statistics, 16 of these 48 models planned fewer bytes than
        # their steps held.
        def bf16(loss_fn):
            def under_autocast(m, b):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return loss_fn(m, b)
            return under_autocast

        torch.manual_seed(0)
        self.check(decoders(), torch.randint(0, 256, (2, 32)), bf16(lm))
        self.check(encoders(), torch.randint(2, 256, (2, 32)), bf16(lm))
        self.check(hf_vision(), (torch.randn(2, 3, 32, 32), torch.tensor([1, 2])), bf16(image_classifier))
        self.check(vision(), (torch.randn(2, 3, 64, 64), torch.tensor([1, 2])), bf16(classify))

    def test_torchvision_in_float16_with_a_gradient_scaler(self):
        # Batch norms under float16 autocast, the loss scaled: updates
        # skipped on overflow and taken, against eager's scaler.
        def fp16(m, b):
            with torch.autocast("cpu", dtype=torch.float16):
                return classify(m, b)

        torch.manual_seed(0)
        for name, model in vision().items():
            with self.subTest(model=name):
                torch.manual_seed(0)
                Harness(self, model, (torch.randn(2, 3, 64, 64), torch.tensor([1, 2])), fp16,
                        scaler=dict(init_scale=2.0**16, growth_interval=1)).run(steps=1)


def llama():
    import transformers as T

    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(**TOKENS, num_key_value_heads=2))


class LowRankAdapter(nn.Module):
    """LoRA without peft: a frozen linear layer plus a trainable product."""

    def __init__(self, base: nn.Linear, rank: int = 4):
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.01)
        self.b = nn.Parameter(torch.randn(base.out_features, rank) * 0.01)

    def forward(self, x):
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


class TrainingLoops(unittest.TestCase):
    """What fine-tuning and pre-training loops do around the model: padded
    batches, bf16 autocast or bf16 weights, frozen weights, adapters."""

    TOKENS = torch.randint(1, 256, (2, 16), generator=torch.Generator().manual_seed(0))

    def test_padded_batch_with_attention_mask(self):
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[0, :5] = 0  # left padding
        Harness(self, llama(), (self.TOKENS, mask),
                lambda m, b: m(input_ids=b[0], attention_mask=b[1], labels=b[0]).loss).run()

    def test_bf16_autocast_and_bf16_weights(self):
        def autocast_lm(m, b):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return lm(m, b)

        Harness(self, llama(), self.TOKENS, autocast_lm).run()
        Harness(self, llama().to(torch.bfloat16), self.TOKENS, lm).run()

    def test_frozen_weights_and_adapters(self):
        model = llama()
        model.model.embed_tokens.weight.requires_grad_(False)
        h = Harness(self, model, self.TOKENS, lm)
        frozen = "param:model.embed_tokens.weight"
        self.assertIn(frozen, {t["id"] for t in h.step.graph["tensors"]})
        self.assertNotIn(frozen, {t for op in h.step.graph["ops"] for t in op.get("updates", [])})
        h.run()
        model = llama()
        for p in model.parameters():
            p.requires_grad_(False)
        for layer in model.model.layers:
            layer.self_attn.q_proj = LowRankAdapter(layer.self_attn.q_proj)
            layer.self_attn.v_proj = LowRankAdapter(layer.self_attn.v_proj)
        Harness(self, model, self.TOKENS, lm).run()

    def test_recurrent_layers(self):
        class Recurrent(nn.Module):
            def __init__(self, core):
                super().__init__()
                self.core = core
                self.head = nn.Linear(16, 3)

            def forward(self, s):
                return self.head(self.core(s)[0].mean(1))

        batch = (torch.randn(8, 10, 16), torch.randint(0, 3, (8,)))
        torch.manual_seed(0)
        Harness(self, Recurrent(nn.GRU(16, 16, num_layers=2, batch_first=True)), batch, classify).run()
        # oneDNN's LSTM returns its backward's workspace only while
        # autograd records; the step replays without autograd.
        import memplan.torch as mt

        lstm = Recurrent(nn.LSTM(16, 16, num_layers=2, batch_first=True))
        with self.assertRaisesRegex(mt.UnsupportedStep, r"mkldnn_rnn_layer.*mkldnn\.flags\(enabled=False\)"):
            mt.capture(lstm, torch.optim.AdamW(lstm.parameters()), batch, classify)
        # As the message says: plain ops, the same on both sides.
        with torch.backends.mkldnn.flags(enabled=False):
            Harness(self, lstm, batch, classify).run()

    def test_rotary_embeddings_through_complex_numbers(self):
        # Meta's Llama reference code rotates queries as complex numbers;
        # the backward multiplies by the conjugate (a lazily conjugated
        # view, which PyTorch materialises before an out= kernel; no output
        # takes a conjugated view's bytes). Its clone is written into its
        # place by copy_, which resolves the conjugate bit: nothing of it
        # outside the arena (clone.out made the copy elsewhere first).
        class Rotary(nn.Module):
            def __init__(self):
                super().__init__()
                self.q = nn.Linear(16, 16)
                self.head = nn.Linear(16, 3)
                freqs = 1.0 / (10000 ** (torch.arange(0, 8).float() / 8))
                angles = torch.outer(torch.arange(10).float(), freqs)
                self.register_buffer("cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

            def forward(self, x):
                q = self.q(x)
                qc = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
                return self.head(torch.view_as_real(qc * self.cis).flatten(2).mean(1))

        torch.manual_seed(0)
        h = Harness(self, Rotary(), (torch.randn(8, 10, 16), torch.randint(0, 3, (8,))), classify)
        h.run()
        fallbacks = {str(h.step._planning.calls[k].func) for k in h.step.place().fallbacks}
        self.assertNotIn("aten.clone.default", fallbacks)

    def test_a_data_dependent_loss_is_refused_by_name(self):
        # Wav2Vec2's CTC loss selects the labels that are not padding, a
        # shape only the data knows.
        import transformers as T

        import memplan.torch as mt

        torch.manual_seed(0)
        model = T.Wav2Vec2ForCTC(T.Wav2Vec2Config(
            vocab_size=32, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
            conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4, pad_token_id=0, mask_time_prob=0.0))
        batch = (torch.randn(2, 2000), torch.randint(1, 32, (2, 10)))
        with self.assertRaisesRegex(mt.UnsupportedStep, r"aten\._local_scalar_dense.*\.item\(\)"):
            mt.capture(model, torch.optim.AdamW(model.parameters()), batch,
                       lambda m, b: m(input_values=b[0], labels=b[1]).loss)


if __name__ == "__main__":
    unittest.main()
