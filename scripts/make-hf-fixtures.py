#!/usr/bin/env python3
"""Regenerates the Hugging Face fixtures of tessera-models' tests.

For each of GPT-2, Llama (grouped-query attention) and Mixtral (top-2 of 4
experts, tied embeddings) this builds a tiny randomly initialised model with
a fixed seed and writes, under models/tests/fixtures/<name>/:

  config.json, model.safetensors   what `save_pretrained` writes (f32)
  reference.safetensors            `input_ids` (i32, [2, 7]) and the model's
                                   `logits` for them (f32, [2, 7, vocab])

The Rust tests load each checkpoint and compare their logits with these.
The fixtures are committed; CI does not run Python. To regenerate them:

    pip install torch transformers safetensors
    python scripts/make-hf-fixtures.py

To check that Hugging Face reads a checkpoint Tessera exported
(`tessera_models::hf::save_pretrained`) of one of the fixtures, and computes
the fixture's logits from it:

    python scripts/make-hf-fixtures.py --check-export DIR

Every parameter is drawn again from wider distributions than Hugging Face's
initialisation (which leaves biases at zero and norm gains at one), so that
every tensor, every bias and every gain changes the logits the tests compare.
"""

import argparse
import json
import os
import pathlib

import torch
from safetensors.torch import save_file
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
)

SEED = 1234
VOCAB = 64
BATCH, SEQ = 2, 7
ROOT = pathlib.Path(__file__).resolve().parent.parent / "models" / "tests" / "fixtures"


def randomize(model: torch.nn.Module) -> None:
    """Draws every parameter again: matrices N(0, 0.15), vectors (biases,
    norm gains) around their usual values with a visible spread."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
            elif ("norm" in name or "ln_" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)


def gpt2() -> torch.nn.Module:
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def llama() -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    return LlamaForCausalLM(config)


def mixtral() -> torch.nn.Module:
    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
    )
    return MixtralForCausalLM(config)


def routing_margin(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """The smallest gap, over tokens and layers, between the router logit of
    the last chosen expert and the best unchosen one: a near tie could route
    differently under rounding and make the reference fragile."""
    out = model(ids, output_router_logits=True)
    k = model.config.num_experts_per_tok
    gaps = []
    for logits in out.router_logits:
        top = torch.topk(logits.float(), k + 1, dim=-1).values
        gaps.append((top[:, k - 1] - top[:, k]).min().item())
    return min(gaps)


def write(name: str, build) -> None:
    torch.manual_seed(SEED)
    model = build()
    randomize(model)
    model.eval()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    with torch.no_grad():
        logits = model(ids).logits.float()
        if name == "mixtral":
            margin = routing_margin(model, ids)
            assert margin > 1e-3, f"router near tie ({margin}); change SEED"
    out = ROOT / name
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    # Only the config and the weights matter to the tests.
    (out / "generation_config.json").unlink(missing_ok=True)
    save_file(
        {"input_ids": ids.to(torch.int32).contiguous(), "logits": logits.contiguous()},
        str(out / "reference.safetensors"),
    )
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{name}: {size / 1024:.0f} KiB, logits in [{logits.min():.3f}, {logits.max():.3f}]")


def check_export(directory: str) -> None:
    """Loads an exported fixture with transformers and compares its logits
    with the fixture's reference (the fixture named by its model type)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    reference = load_file(str(ROOT / model.config.model_type / "reference.safetensors"))
    with torch.no_grad():
        logits = model(reference["input_ids"].long()).logits.float()
    error = (logits - reference["logits"]).abs().max().item()
    print(f"{directory}: {type(model).__name__}, max abs error {error:.3g} against the fixture's logits")
    if error > 1e-4:
        raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check-export", metavar="DIR", help="check an exported fixture instead of writing the fixtures")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    if args.check_export:
        check_export(args.check_export)
        return
    for name, build in [("gpt2", gpt2), ("llama", llama), ("mixtral", mixtral)]:
        write(name, build)


if __name__ == "__main__":
    main()
