"""Build a tiny, randomly initialised Stable Diffusion pipeline and save it like a real one.

    python scripts/make_tiny_sd_pipeline.py OUT_DIR [--seed 0] [--single-file OUT.safetensors]

A small UNet, VAE and CLIP text encoder made from configs (weights from ``torch.manual_seed``,
so the same seed gives the same files), a CLIP tokenizer written from a small vocabulary, and a
DDIM scheduler; no safety checker. About 5 MB; it generates a 64x64 image in a few steps on a
CPU in well under a second. The images are noise: it exists to test the real ``diffusers``
code path (loading from disk, schedulers, text and image conditioning), not to look good.

``--single-file`` also writes the same weights as one checkpoint in the original Stable
Diffusion (LDM / Automatic1111) key layout, the inverse of diffusers' ``convert_ldm_*`` functions
for UNets and VAEs built like these (and CLIP text encoders). Loaded back with
``from_single_file(..., config=OUT_DIR)`` it gives the same pipeline, bit for bit.

Needs the image extra: ``pip install 'shoal[image]'`` (and a torch).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

VOCAB_WORDS = [
    "a",
    "photo",
    "of",
    "the",
    "cat",
    "dog",
    "red",
    "blue",
    "green",
    "sky",
    "sea",
    "tree",
    "house",
    "car",
    "man",
    "woman",
    "small",
    "big",
    "on",
    "in",
    "with",
    "and",
    "at",
    "night",
    "day",
]


def _write_tokenizer_files(folder: Path) -> None:
    """A CLIP BPE vocabulary of single characters, whole words and the special tokens."""
    chars = list("abcdefghijklmnopqrstuvwxyz")
    tokens = ["<|startoftext|>", "<|endoftext|>", "!"]
    tokens += chars + [c + "</w>" for c in chars[:10]] + [w + "</w>" for w in VOCAB_WORDS]
    vocab = {token: i for i, token in enumerate(dict.fromkeys(tokens))}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")


def build(out: Path, seed: int = 0) -> Path:
    """Write the pipeline to ``out`` (created) and return it."""
    import torch
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=32,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )
    vae = AutoencoderKL(
        block_out_channels=(16, 32),
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        latent_channels=4,
        norm_num_groups=8,
        sample_size=64,
    )
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
            hidden_size=32,
            intermediate_size=37,
            num_attention_heads=4,
            num_hidden_layers=2,
            vocab_size=1000,
            max_position_embeddings=77,
            projection_dim=32,
        )
    )
    with tempfile.TemporaryDirectory() as tmp:
        _write_tokenizer_files(Path(tmp))
        tokenizer = CLIPTokenizer(
            str(Path(tmp) / "vocab.json"), str(Path(tmp) / "merges.txt"), model_max_length=77
        )
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    pipe = StableDiffusionPipeline(
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    return out


UNET_RESNET = (
    ("norm1.", "in_layers.0."),
    ("conv1.", "in_layers.2."),
    ("norm2.", "out_layers.0."),
    ("conv2.", "out_layers.3."),
    ("time_emb_proj.", "emb_layers.1."),
    ("conv_shortcut.", "skip_connection."),
)
UNET_TOP = {
    "time_embedding.linear_1.": "time_embed.0.",
    "time_embedding.linear_2.": "time_embed.2.",
    "conv_in.": "input_blocks.0.0.",
    "conv_norm_out.": "out.0.",
    "conv_out.": "out.2.",
}
VAE_ATTENTION = (
    ("group_norm.", "norm."),
    ("to_q.", "q."),
    ("to_k.", "k."),
    ("to_v.", "v."),
    ("to_out.0.", "proj_out."),
)


Prefixes = list[tuple[str, str, tuple[tuple[str, str], ...]]]
"""(diffusers prefix, LDM prefix, renames right after the prefix) triples."""


def _unet_prefixes(config: dict[str, Any]) -> Prefixes:
    """(diffusers prefix, LDM prefix, renames inside) for a ``UNet2DConditionModel`` config."""
    per = int(config["layers_per_block"])
    res = UNET_RESNET
    pairs: Prefixes = [(k, v, ()) for k, v in UNET_TOP.items()]
    pairs += [("mid_block.attentions.0.", "middle_block.1.", ())]
    pairs += [(f"mid_block.resnets.{j}.", f"middle_block.{2 * j}.", res) for j in range(2)]
    for b, up_type in enumerate(config["up_block_types"]):
        for j in range(per):
            ldm = f"input_blocks.{1 + b * (per + 1) + j}"
            pairs += [(f"down_blocks.{b}.resnets.{j}.", f"{ldm}.0.", res)]
            pairs += [(f"down_blocks.{b}.attentions.{j}.", f"{ldm}.1.", ())]
        down = f"input_blocks.{1 + b * (per + 1) + per}.0.op."
        pairs += [(f"down_blocks.{b}.downsamplers.0.conv.", down, ())]
        for j in range(per + 1):
            ldm = f"output_blocks.{b * (per + 1) + j}"
            pairs += [(f"up_blocks.{b}.resnets.{j}.", f"{ldm}.0.", res)]
            pairs += [(f"up_blocks.{b}.attentions.{j}.", f"{ldm}.1.", ())]
        up = f"output_blocks.{b * (per + 1) + per}.{2 if 'CrossAttn' in up_type else 1}.conv."
        pairs += [(f"up_blocks.{b}.upsamplers.0.conv.", up, ())]
    return pairs


def _vae_prefixes(config: dict[str, Any]) -> Prefixes:
    """(diffusers prefix, LDM prefix, renames inside) for an ``AutoencoderKL`` config."""
    res = (("conv_shortcut.", "nin_shortcut."),)
    pairs: Prefixes = []
    for part in ("encoder", "decoder"):
        pairs += [(f"{part}.conv_norm_out.", f"{part}.norm_out.", ())]
        pairs += [(f"{part}.mid_block.attentions.0.", f"{part}.mid.attn_1.", VAE_ATTENTION)]
        pairs += [
            (f"{part}.mid_block.resnets.{j}.", f"{part}.mid.block_{j + 1}.", res) for j in (0, 1)
        ]
    blocks = len(config["down_block_types"])
    for i in range(blocks):
        for j in range(int(config["layers_per_block"]) + 1):
            pairs += [
                (f"encoder.down_blocks.{i}.resnets.{j}.", f"encoder.down.{i}.block.{j}.", res)
            ]
            up = f"decoder.up.{blocks - 1 - i}.block.{j}."
            pairs += [(f"decoder.up_blocks.{i}.resnets.{j}.", up, res)]
        down = f"encoder.down.{i}.downsample.conv."
        pairs += [(f"encoder.down_blocks.{i}.downsamplers.0.conv.", down, ())]
        up = f"decoder.up.{blocks - 1 - i}.upsample.conv."
        pairs += [(f"decoder.up_blocks.{i}.upsamplers.0.conv.", up, ())]
    return pairs


def _rename(state: dict[str, Any], pairs: Prefixes, head: str) -> dict[str, Any]:
    """``state`` with each key's diffusers prefix (and names inside it) in LDM form."""
    out = {}
    for key, tensor in state.items():
        new = key
        for ours, theirs, inside in pairs:
            if key.startswith(ours):
                rest = key.removeprefix(ours)
                for a, b in inside:
                    rest = b + rest.removeprefix(a) if rest.startswith(a) else rest
                new = theirs + rest
                break
        out[head + new] = tensor
    return out


def to_single_file(folder: Path, out: Path) -> Path:
    """The pipeline in ``folder`` as one LDM-layout ``.safetensors`` checkpoint at ``out``."""
    from safetensors.torch import load_file, save_file

    def part(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
        (weights,) = (folder / name).glob("*.safetensors")
        config = json.loads((folder / name / "config.json").read_text())
        return load_file(weights), config

    unet, unet_config = part("unet")
    vae, vae_config = part("vae")
    text, _ = part("text_encoder")
    checkpoint = _rename(unet, _unet_prefixes(unet_config), "model.diffusion_model.")
    for key, tensor in _rename(vae, _vae_prefixes(vae_config), "first_stage_model.").items():
        is_linear = ".mid.attn_1." in key and key.endswith("weight") and tensor.ndim == 2
        checkpoint[key] = tensor[:, :, None, None] if is_linear else tensor  # 1x1 convs in LDM
    text_head = "cond_stage_model.transformer.text_model."
    checkpoint |= {text_head + k.removeprefix("text_model."): v for k, v in text.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in checkpoint.items()}, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write the pipeline to")
    parser.add_argument("--seed", type=int, default=0, help="torch seed for the weights")
    parser.add_argument(
        "--single-file", type=Path, help="also write it as one original-layout .safetensors"
    )
    args = parser.parse_args(argv)
    path = build(args.out, args.seed)
    if args.single_file is not None:
        to_single_file(path, args.single_file)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    sys.stdout.write(f"tiny Stable Diffusion pipeline in {path} ({size / 1e6:.1f} MB)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
