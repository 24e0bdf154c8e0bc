"""A file's spoken language, detected once, for models that detect it (Whisper, --language auto).

OpenAI's `transcribe` and faster-whisper detect the language once per file, from its first
30 s, and decode every window in it. Our pieces of a file decode in parallel, so detecting per
piece came free, but it let a long monolingual file flip language mid-way: whisper-base misreads
the language of about 1 % of English pieces (2 of our 235 English files), one or two pieces in
an hour of speech, each then transcribed in, or translated into, another language.

`FileLanguages` keeps the pipeline to OpenAI's rule. A file's first piece is batched at once
and detects; the file's later pieces are held (in their slab slots) until it is decoded, then
batched with its language. A first piece that decides nothing (silent, or no text: music, noise)
passes the choice to the next piece. A held piece waits one batch per deciding piece: that
piece is already in the batcher, and the main loop runs a batch whenever the batcher holds
one. That relies on a file's pieces arriving in order, which they do: one worker cuts a file
front to back and its events keep their order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from transcribe.preprocess import Piece
from transcribe.results import Result


@dataclass
class _Deciding:
    probe: int = 0  # the piece whose result decides the language, until one does
    language: str | None = None
    held: dict[int, Piece] = field(default_factory=dict)  # index -> piece waiting for the language


class FileLanguages:
    """Per file: which pieces may be batched now, and in which language."""

    def __init__(self) -> None:
        self.files: dict[int, _Deciding] = {}

    def admit(self, piece: Piece) -> bool:
        """True: batch `piece` now (the language is known, or it is the one to detect it);
        False: it is held until `decided` returns it."""
        st = self.files.setdefault(piece.fid, _Deciding())
        if st.language is not None or piece.index == st.probe:
            return True
        st.held[piece.index] = piece
        return False

    def language(self, piece: Piece) -> str | None:
        """The language to decode `piece` in; None: detect it."""
        st = self.files.get(piece.fid)
        return st.language if st is not None else None

    def decided(self, piece: Piece, result: Result | str) -> list[Piece]:
        """`piece` was decoded (`result`: its Result, or the error it failed with): the held
        pieces to batch now, in file order."""
        st = self.files.get(piece.fid)
        if st is None or st.language is not None or piece.index != st.probe or isinstance(result, str):
            return []  # an error fails the file: `forget` gives its held pieces back
        if result.language and result.text:
            st.language = result.language
            held, st.held = st.held, {}
            return [held[k] for k in sorted(held)]
        st.probe += 1  # nothing said: the next piece detects
        return [st.held.pop(st.probe)] if st.probe in st.held else []

    def forget(self, fid: int) -> list[Piece]:
        """The file is finished or failed: its held pieces (none once it is finished), whose
        slots the caller releases."""
        st = self.files.pop(fid, None)
        return list(st.held.values()) if st is not None else []
