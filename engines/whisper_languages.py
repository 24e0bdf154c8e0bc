"""Whisper's languages: code -> English name, and `--language` read as a code or a name.

The table is OpenAI Whisper's (`whisper/tokenizer.py`, MIT), in its vocabulary's order, with
its aliases; `openai-whisper --language German` and `faster-whisper`'s callers pass names as
often as codes, so both are taken, in any case. Whether a model knows the language is its
vocabulary's business (`whisper_tokenizer.Tokenizer.language_token`); this table only spells.
"""
from __future__ import annotations

import difflib
import re

LANGUAGES = {
    "en": "english", "zh": "chinese", "de": "german", "es": "spanish", "ru": "russian",
    "ko": "korean", "fr": "french", "ja": "japanese", "pt": "portuguese", "tr": "turkish",
    "pl": "polish", "ca": "catalan", "nl": "dutch", "ar": "arabic", "sv": "swedish",
    "it": "italian", "id": "indonesian", "hi": "hindi", "fi": "finnish", "vi": "vietnamese",
    "he": "hebrew", "uk": "ukrainian", "el": "greek", "ms": "malay", "cs": "czech",
    "ro": "romanian", "da": "danish", "hu": "hungarian", "ta": "tamil", "no": "norwegian",
    "th": "thai", "ur": "urdu", "hr": "croatian", "bg": "bulgarian", "lt": "lithuanian",
    "la": "latin", "mi": "maori", "ml": "malayalam", "cy": "welsh", "sk": "slovak", "te": "telugu",
    "fa": "persian", "lv": "latvian", "bn": "bengali", "sr": "serbian", "az": "azerbaijani",
    "sl": "slovenian", "kn": "kannada", "et": "estonian", "mk": "macedonian", "br": "breton",
    "eu": "basque", "is": "icelandic", "hy": "armenian", "ne": "nepali", "mn": "mongolian",
    "bs": "bosnian", "kk": "kazakh", "sq": "albanian", "sw": "swahili", "gl": "galician",
    "mr": "marathi", "pa": "punjabi", "si": "sinhala", "km": "khmer", "sn": "shona",
    "yo": "yoruba", "so": "somali", "af": "afrikaans", "oc": "occitan", "ka": "georgian",
    "be": "belarusian", "tg": "tajik", "sd": "sindhi", "gu": "gujarati", "am": "amharic",
    "yi": "yiddish", "lo": "lao", "uz": "uzbek", "fo": "faroese", "ht": "haitian creole",
    "ps": "pashto", "tk": "turkmen", "nn": "nynorsk", "mt": "maltese", "sa": "sanskrit",
    "lb": "luxembourgish", "my": "myanmar", "bo": "tibetan", "tl": "tagalog", "mg": "malagasy",
    "as": "assamese", "tt": "tatar", "haw": "hawaiian", "ln": "lingala", "ha": "hausa",
    "ba": "bashkir", "jw": "javanese", "su": "sundanese", "yue": "cantonese",
}
ALIASES = {
    "burmese": "my", "valencian": "ca", "flemish": "nl", "haitian": "ht", "letzeburgesch": "lb",
    "pushto": "ps", "panjabi": "pa", "moldavian": "ro", "moldovan": "ro", "sinhalese": "si",
    "castilian": "es", "mandarin": "zh",
}
TO_CODE = {**{name: code for code, name in LANGUAGES.items()}, **ALIASES}


def language_code(value: str) -> str:
    """`--language` -> a code (en, de, yue, ...) or "auto". Codes and names in any case and
    spacing ("EN", "German", "haitian  creole"); any other two or three letters pass as a code
    (a later model's language; the vocabulary refuses it at load if it has none such). Else
    ValueError naming the nearest spellings."""
    key = " ".join(value.lower().split())
    if key == "auto" or key in LANGUAGES:
        return key
    if key in TO_CODE:
        return TO_CODE[key]
    if re.fullmatch(r"[a-z]{2,3}", key):  # a code newer than this table: the vocabulary decides
        return key
    near = difflib.get_close_matches(key, [*LANGUAGES, *TO_CODE], n=3, cutoff=0.75)
    hint = f" (did you mean {', '.join(near)}?)" if near else ""
    raise ValueError(f"--language {value!r}: not a Whisper language code or name{hint}; expected "
                     f"a code (en, de, yue, ...), a name (english, german, ...) or auto")
