"""Whisper's byte-level BPE vocabulary: special token ids, decoding, encoding (prompts), and the
suppress list.

Decoding and encoding need only the vocab of `tokenizer.json` (or CTranslate2's `vocabulary.txt`, one token
per line in id order): each token is a string of "printable" stand-ins for bytes (GPT-2's
bytes_to_unicode map), so text = utf-8 decode of the mapped-back bytes. Special tokens
(<|endoftext|>, <|startoftranscript|>, languages, tasks, <|notimestamps|>) come from the
added tokens; timestamp tokens <|0.00|> .. <|30.00|> follow <|notimestamps|> in 0.02 s steps,
whether or not the file lists them. Multilingual (51865/51866 ids) and English-only (51864 ids)
vocabularies differ only in where these ids sit, which reading them by name takes care of.
Encoding merges byte pairs by the ids of the tokens they make (tiktoken's ranks), so it needs no
merges list either.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import regex

TIME_PRECISION = 0.02  # seconds per timestamp token step
# GPT-2's pre-tokenizer (tiktoken's pattern for Whisper's encodings): contractions, letters,
# numbers and other symbols each with an optional leading space, and runs of whitespace.
PRETOKEN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (256 entries)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


class LanguageTaskError(ValueError):
    """A language or task this model's vocabulary cannot take (--language xx, --task translate
    on an English-only model): the user's to change, a usage error."""


@dataclass(frozen=True)
class WhisperTokenizer:
    """Id <-> token tables plus the special ids decoding needs.

    tokens: token string per id (byte-level alphabet for text tokens, "<|...|>" for specials).
    """

    tokens: tuple[str, ...]
    ids: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Built once: the token -> id table is read on every lookup by name.
        object.__setattr__(self, "ids", {t: i for i, t in enumerate(self.tokens)})
        for name in ("<|endoftext|>", "<|startoftranscript|>", "<|transcribe|>", "<|notimestamps|>"):
            if name not in self.ids:
                raise ValueError(f"tokenizer has no special token {name!r}")

    @property
    def eot(self) -> int:
        return self.ids["<|endoftext|>"]

    @property
    def sot(self) -> int:
        return self.ids["<|startoftranscript|>"]

    @property
    def transcribe(self) -> int:
        return self.ids["<|transcribe|>"]

    @property
    def translate(self) -> int:
        return self.ids["<|translate|>"]

    @property
    def no_timestamps(self) -> int:
        return self.ids["<|notimestamps|>"]

    @property
    def timestamp_begin(self) -> int:
        """Id of <|0.00|>: the token right after <|notimestamps|> in every Whisper vocab."""
        return self.no_timestamps + 1

    @property
    def no_speech(self) -> int:
        """<|nospeech|> in newer vocabs, <|nocaptions|> in the original ones."""
        ids = self.ids
        return ids.get("<|nospeech|>", ids.get("<|nocaptions|>", -1))

    @property
    def languages(self) -> dict[str, int]:
        """Language code -> token id, for the tokens between sot and <|translate|>."""
        return {self.tokens[i][2:-2]: i for i in range(self.sot + 1, self.ids.get("<|translate|>", self.sot + 1))}

    @property
    def is_multilingual(self) -> bool:
        return len(self.languages) > 0

    def language_token(self, code: str) -> int:
        langs = self.languages
        if code not in langs:
            raise LanguageTaskError(f"language={code!r} is not in this vocabulary ({len(langs)} languages)")
        return langs[code]

    def sot_sequence(self, language: str | None = "en", timestamps: bool = True, task: str = "transcribe") -> list[int]:
        """The decoder prompt: sot [lang task] [notimestamps]; task: transcribe, or translate
        (into English; multilingual models only)."""
        if task not in ("transcribe", "translate"):
            raise ValueError(f"task must be transcribe or translate, got {task!r}")
        seq = [self.sot]
        if self.is_multilingual:
            seq += [self.language_token(language or "en"), self.transcribe if task == "transcribe" else self.translate]
        elif task == "translate":
            raise LanguageTaskError("an English-only model cannot translate: use a multilingual one")
        if not timestamps:
            seq.append(self.no_timestamps)
        return seq

    def decode(self, ids: list[int]) -> str:
        """Text of the text tokens in `ids`; specials and timestamps are dropped."""
        dec = _byte_decoder()
        limit = self.eot
        data = bytearray()
        for i in ids:
            if 0 <= i < limit:
                data.extend(dec[c] for c in self.tokens[i])
        return data.decode("utf-8", errors="replace")

    @property
    def blank(self) -> int:
        """The id of " " alone (220), which OpenAI's SuppressBlank bans as a first token; 220 in
        a vocabulary without single-byte tokens (the tests' small random one)."""
        return self.ids.get(bytes_to_unicode()[ord(" ")], 220)

    @property
    def sot_prev(self) -> int:
        """<|startofprev|>: what precedes a prompt of earlier text (-1 when the vocab lacks it)."""
        return self.ids.get("<|startofprev|>", -1)

    def encode(self, text: str) -> list[int]:
        """BPE ids of `text`: GPT-2's pre-token split, then each pre-token's merges, as
        tiktoken encodes (special token names in `text` are plain text here). Lone surrogates
        (bytes of an argument that is not UTF-8, as Python decodes argv) become U+FFFD first,
        as tiktoken makes them: UTF-8 cannot encode them."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        return [i for piece in PRETOKEN.findall(text) for i in self.encode_pretoken(piece)]

    def encode_pretoken(self, text: str) -> list[int]:
        """BPE ids of one GPT-2 pre-token (no regex split), as tiktoken merges: the adjacent pair
        whose joined token has the lowest id joins first, until no joined pair is a token. The
        ids are the merge ranks, so no merges list is needed (tokenizer.json's list for
        Whisper lacks the first merge, "Ġ t", which left " the" as [" ", "the"])."""
        enc, ids, limit = bytes_to_unicode(), self.ids, self.eot
        word = [enc[b] for b in text.encode("utf-8")]
        while len(word) > 1:
            rank, j = min((ids.get(a + b, limit), j) for j, (a, b) in enumerate(zip(word, word[1:])))
            if rank >= limit:
                break
            word[j:j + 2] = [word[j] + word[j + 1]]
        return [ids[w] for w in word]

    def non_speech_tokens(self) -> list[int]:
        """OpenAI's `non_speech_tokens`: symbols and speaker tags that should never be spoken."""
        symbols = list('"#()*+/:;<=>@[\\]^_`{|}~「」『』')
        symbols += "<< >> <<< >>> -- --- -( -[ (' (\" (( )) ((( ))) [[ ]] {{ }} ♪♪ ♪♪♪".split()
        misc = set("♩♪♫♬♭♮♯")
        out = {self.encode_pretoken(" -")[0], self.encode_pretoken(" '")[0]}
        for s in symbols + sorted(misc):
            for ids in (self.encode_pretoken(s), self.encode_pretoken(" " + s)):
                if len(ids) == 1 or s in misc:
                    out.add(ids[0])
        return sorted(out)

    def suppress_tokens(self) -> list[int]:
        """OpenAI's default suppress_tokens="-1": non-speech symbols plus task/control tokens."""
        ids = self.ids
        extra = [ids.get(n, -1) for n in ("<|translate|>", "<|transcribe|>", "<|startoftranscript|>",
                                            "<|startofprev|>", "<|startoflm|>")]
        return sorted(set(self.non_speech_tokens()) | {i for i in extra + [self.no_speech] if i >= 0})


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def load_tokenizer(path: str | Path, n_vocab: int | None = None) -> WhisperTokenizer:
    """Read a HF `tokenizer.json` or a CTranslate2 `vocabulary.txt`.

    n_vocab: the model's embedding rows; ids past the file's last token are filled with
    timestamp names "<|x.xx|>" (tokenizer.json files often omit the 1501 timestamp tokens).
    """
    path = Path(path)
    if path.suffix == ".json":
        spec = json.loads(path.read_text(encoding="utf-8"))
        vocab = dict(spec["model"]["vocab"])
        vocab.update({t["content"]: t["id"] for t in spec.get("added_tokens", [])})
        tokens = [""] * (max(vocab.values()) + 1)
        for tok, i in vocab.items():
            tokens[i] = tok
    else:
        tokens = path.read_text(encoding="utf-8").split("\n")
        if tokens and tokens[-1] == "":
            tokens.pop()
    ts_begin = tokens.index("<|notimestamps|>") + 1
    target = max(n_vocab or 0, len(tokens))
    for i in range(len(tokens), target):
        tokens.append(f"<|{(i - ts_begin) * TIME_PRECISION:.2f}|>")
    return WhisperTokenizer(tuple(tokens))
