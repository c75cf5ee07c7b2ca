"""Training text and a minimal BERT (uncased) WordPiece tokenizer.

The tokenizer follows BERT's two stages:

1. basic tokenization: lowercase, strip accents (NFD, drop combining marks), drop control characters,
   split on whitespace, and split every punctuation character (and CJK ideograph) into its own token;
2. WordPiece: per word, greedy longest-match-first against the vocabulary, continuation pieces
   prefixed with ``##``; a word with no full segmentation (or longer than ``max_chars``) becomes ``[UNK]``.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"


def _is_punct(ch: str) -> bool:
    cp = ord(ch)
    # BERT treats all non-alphanumeric ASCII as punctuation, plus the Unicode P* categories.
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B73F
        or 0x2B740 <= cp <= 0x2B81F
        or 0x2B820 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


def basic_tokenize(text: str) -> list[str]:
    """Lowercase, strip accents, split on whitespace and punctuation (punctuation kept as tokens)."""
    text = unicodedata.normalize("NFD", text.lower())
    out: list[str] = []
    cur: list[str] = []

    def flush() -> None:
        if cur:
            out.append("".join(cur))
            cur.clear()

    for ch in text:
        cat = unicodedata.category(ch)
        if cat == "Mn":  # combining mark (accent)
            continue
        if ch in "\t\n\r " or cat == "Zs":
            flush()
        elif cat in ("Cc", "Cf") or ord(ch) in (0, 0xFFFD):
            continue
        elif _is_punct(ch) or _is_cjk(ord(ch)):
            flush()
            out.append(ch)
        else:
            cur.append(ch)
    flush()
    return out


class WordPiece:
    """Greedy longest-match-first WordPiece over a BERT ``vocab.txt`` (one token per line, id = line number)."""

    def __init__(self, vocab: dict[str, int], max_chars: int = 100):
        self.vocab = vocab
        self.inv = {i: t for t, i in vocab.items()}
        self.max_chars = max_chars
        for special in (PAD, UNK, CLS, SEP, MASK):
            if special not in vocab:
                raise ValueError(f"vocabulary lacks {special}")
        self.pad_id, self.unk_id = vocab[PAD], vocab[UNK]
        self.cls_id, self.sep_id, self.mask_id = vocab[CLS], vocab[SEP], vocab[MASK]

    @classmethod
    def from_file(cls, path: str | Path) -> WordPiece:
        lines = Path(path).read_text(encoding="utf-8").split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        return cls({tok: i for i, tok in enumerate(lines)})

    def word_pieces(self, word: str) -> list[str]:
        if len(word) > self.max_chars:
            return [UNK]
        pieces: list[str] = []
        start = 0
        while start < len(word):
            end = len(word)
            found = None
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.vocab:
                    found = piece
                    break
                end -= 1
            if found is None:
                return [UNK]
            pieces.append(found)
            start = end
        return pieces

    def tokenize(self, text: str) -> list[str]:
        return [p for w in basic_tokenize(text) for p in self.word_pieces(w)]

    def encode(self, text: str) -> list[int]:
        return [self.vocab[p] for p in self.tokenize(text)]

    def decode(self, ids: list[int]) -> str:
        toks = [self.inv[i] for i in ids]
        out = ""
        for t in toks:
            out += t[2:] if t.startswith("##") else (" " + t if out else t)
        return out


def training_text(readme: str) -> str:
    """Text of the model card: YAML front matter, URLs and markdown markup removed (code examples kept)."""
    text = re.sub(r"\A---\n.*?\n---\n", "", readme, flags=re.S)
    text = text.replace("```python", " ").replace("```", " ")
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # [label](url) -> label
    text = re.sub(r"https?://\S+", " ", text)
    text = re.sub(r"[*`]+", "", text)
    text = re.sub(r"[#|>]+|-{3,}|={3,}", " ", text)
    return re.sub(r"\s+", " ", text).strip()
