"""Deterministic T5 tokenizer test prompts (tools/make_t5_goldens.py and tests/test_t5_tokenizer.py).

1,200 prompts from seeded random.Random streams: diffusion-style prompts, numbers and units,
punctuation and brackets, whitespace runs (spaces, tabs, newlines, NBSP, ideographic space;
leading/trailing), Unicode (accents, Greek, Cyrillic, CJK, Arabic, emoji, full-width forms,
ligatures, combining marks, control characters), special-token strings (`</s>`, `<extra_id_5>`),
and long prompts (> 512 tokens). Only `random.Random(int)` with `random()`/`randrange`, whose
sequences Python keeps stable, and fixed word lists.
"""
from __future__ import annotations

import random

WORDS = ("a photo of an astronaut riding a horse on the moon cat dog portrait landscape cinematic "
         "lighting highly detailed 8k masterpiece watercolor oil painting by greg rutkowski trending "
         "on artstation sharp focus octane render unreal engine bokeh golden hour cyberpunk city "
         "neon rain reflections medieval castle dragon fantasy sci-fi spaceship nebula stars vintage "
         "film grain kodak portra 35mm f/1.8 close-up wide-angle isometric low-poly pixel art "
         "anime manga studio ghibli don't it's we're they've i'll she'd you're mother-in-law "
         "state-of-the-art e-mail U.S.A. Dr. Mr. etc. vs. réalisme naïve café Zürich São Paulo "
         "Ærøskøbing straße crème brûlée").split()
UNICODE = ["é", "ñ", "ü", "ø", "ß", "Ω", "λ", "Ж", "я", "中", "文", "日本語", "한국어", "العربية", "עברית",
           "हिन्दी", "ไทย", "😀", "🐱", "👩‍🚀", "🇫🇷", "❤️", "★", "→", "∞", "±", "°C", "µm", "²", "½",
           "Ａ", "ｂ", "１", "２", "！", "？", "ﬁ", "ﬂ", "Ⅻ", "①", "™", "©", "e\u0301", "a\u0308",
           "\u200b", "\u200d", "\u00ad", "\x07", "\x00", "\ufeff", "…", "–", "—", "“", "”", "‘", "’",
           "«", "»", "¿", "¡", "€", "£", "¥", "₹", "ℕ", "𝔸", "𝐁", "\U0001F600\U0001F3FD"]
PUNCT = list(".,;:!?-_'\"()[]{}<>/\\|@#$%^&*+=~`") + ["...", "--", "!!", "?!", "(((", ")))",
                                                       "(cat:1.2)", "[dog]", "{x}", "<lora:abc:0.8>"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\r\n", " \t ", "\u00a0", "\u3000", "\u2009", "\u2002", "\n\n", "\x0b", "\x0c"]
SPECIAL = ["</s>", "<pad>", "<unk>", "<extra_id_0>", "<extra_id_5>", "<extra_id_99>", "<s>", "</S>"]


def _number(r: random.Random) -> str:
    k = r.randrange(8)
    if k == 0:
        return str(r.randrange(10 ** r.randrange(1, 12)))
    if k == 1:
        return f"{r.random() * 10 ** r.randrange(-3, 6):.{r.randrange(0, 5)}f}"
    if k == 2:
        return f"{r.randrange(1, 4096)}x{r.randrange(1, 4096)}"
    if k == 3:
        return f"{r.randrange(1900, 2100)}-{r.randrange(1, 13):02d}-{r.randrange(1, 29):02d}"
    if k == 4:
        return f"{r.randrange(100)}%"
    if k == 5:
        return f"${r.randrange(100000):,}"
    if k == 6:
        return f"{r.random():.3e}"
    return f"v{r.randrange(10)}.{r.randrange(10)}.{r.randrange(100)}"


def _piece(r: random.Random, mix: int) -> str:
    x = r.randrange(100)
    if x < 55 - 10 * mix:
        w = WORDS[r.randrange(len(WORDS))]
        return w.upper() if r.randrange(12) == 0 else (w.capitalize() if r.randrange(6) == 0 else w)
    if x < 65:
        return _number(r)
    if x < 75:
        return PUNCT[r.randrange(len(PUNCT))]
    if x < 78:
        return SPECIAL[r.randrange(len(SPECIAL))]
    return UNICODE[r.randrange(len(UNICODE))]


def _sep(r: random.Random) -> str:
    x = r.randrange(100)
    if x < 70:
        return " "
    if x < 80:
        return ""
    if x < 88:
        return ", "
    return SPACES[r.randrange(len(SPACES))]


def t5_prompts(n: int = 1200) -> list[str]:
    out = ["", " ", "a", "a cat", "  leading and trailing  ", "\t\ttabs\tand\nnewlines\n",
           "multiple     spaces    inside", "a lovely cat", "A (lovely:1.3) cat, [blurry]", "1234567890",
           "ＦＵＬＬ ｗｉｄｔｈ", "ﬁne ﬂower", "caf\u00e9 vs cafe\u0301", "emoji 🐱🐶🦊 party 🎉",
           "中文提示词：一只可爱的猫", "</s> inside </s>", "<extra_id_0> sentinel", "x" * 300,
           "supercalifragilisticexpialidocious antidisestablishmentarianism", "\u00a0nbsp\u00a0 \u3000ideographic"]
    for i in range(len(out), n):
        r = random.Random(1000 + i)
        mix = i % 3                                   # 0 mostly words ... 2 more symbols
        if i % 25 == 0:
            length = r.randrange(450, 900)            # > 512 tokens
        elif i % 5 == 0:
            length = r.randrange(40, 160)
        else:
            length = r.randrange(1, 40)
        parts = [SPACES[r.randrange(len(SPACES))]] if r.randrange(10) == 0 else []
        for _ in range(length):
            parts.append(_piece(r, mix))
            parts.append(_sep(r))
        if r.randrange(3):
            parts.pop()                               # usually no trailing separator
        out.append("".join(parts))
    return out
