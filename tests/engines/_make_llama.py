"""A tiny bf16 Llama and its training steps, written as versions a real vLLM engine can load.

Run with the vLLM venv's interpreter (it has transformers and tokenizers; the main .venv does not)::

    .venv-vllm/bin/python tests/engines/_make_llama.py OUT --versions 4

writes ``OUT/v1 .. OUT/vN``, each a directory ``save_pretrained`` wrote (``config.json``,
``model.safetensors``, tokenizer files): v1 is the initial model, each next one the bf16 cast of
fp32 master weights after real AdamW steps on random tokens (the trainer's loop of the demo).
The learning rate is large enough that greedy generation differs between versions (the tests
assert that they do). Deterministic: the same seed gives the same bytes.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 1024
SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: LlamaConfig's bos (1) and eos (2)


def config() -> LlamaConfig:
    """The model of issue 13: the CPU attention backend needs a head size of at least 32."""
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )


def corpus(seed: int, words: int = 40_000) -> list[str]:
    """Pseudo-English lines from a seeded syllable set: enough distinct pairs for 1024 BPE tokens."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
    vocab = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    out = []
    for _ in range(words // 12):
        out.append(" ".join(rng.choice(vocab) for _ in range(12)) + ".")
    return out


def tokenizer(seed: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained offline on :func:`corpus`, wrapped for ``save_pretrained``."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", model_max_length=4096
    )


def save(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, out: Path) -> None:
    """The bf16 cast of the fp32 master weights, as transformers writes a checkpoint."""
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    bf16 = LlamaForCausalLM(model.config).to(torch.bfloat16)
    bf16.load_state_dict(state)
    bf16.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2, help="AdamW steps between two versions")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    tok = tokenizer(args.seed)
    model = LlamaForCausalLM(config()).float()  # fp32 masters, as a trainer keeps them
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed + 1)
    save(model, tok, args.out / "v1")
    for version in range(2, args.versions + 1):
        for _ in range(args.steps):
            ids = torch.randint(3, VOCAB, (4, 64), generator=gen)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        save(model, tok, args.out / f"v{version}")
    print(f"wrote v1..v{args.versions} under {args.out}")


if __name__ == "__main__":
    main()
