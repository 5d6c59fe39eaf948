"""Byte-level BPE tokenizer trained on the corpus's train split.

Ids 0-3 are the special tokens, in Gemma's order for the first three:
`<pad>`=0, `<eos>`=1, `<bos>`=2, and `<mask>`=3, which DFlash fills its draft blocks with.
Byte-level means every string round-trips exactly (no unknown token), which a code model needs.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from minispec.targets import corpus

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<mask>"]
VOCAB_SIZE = 4096


def train_tokenizer(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    texts = [f.text for f in corpus.iter_files("train")]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def save_tokenizer(tok: Tokenizer, folder: Path) -> None:
    """Save in the layout `AutoTokenizer.from_pretrained(folder)` reads."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        mask_token="<mask>",
        model_max_length=4096,
    )
    fast.save_pretrained(folder)


def load_shipped_tokenizer():
    """The tokenizer every shipped toy model uses (`minispec/checkpoints/tokenizer`), its SHA256SUMS checked."""
    from transformers import AutoTokenizer

    from minispec.manifest import check_manifest

    folder = Path(__file__).resolve().parents[1] / "checkpoints" / "tokenizer"
    check_manifest(folder, rebuild="python -m minispec.targets.tokenizer minispec/checkpoints/tokenizer")
    return AutoTokenizer.from_pretrained(folder)


if __name__ == "__main__":
    import sys

    from minispec import training
    from minispec.files import cache_dir

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else cache_dir() / "tokenizer"
    training.save_atomically(out, lambda tmp: save_tokenizer(train_tokenizer(), tmp))
    print(f"saved to {out}")
