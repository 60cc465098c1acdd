"""Deterministic Qwen tokenizer test prompts (tools/make_qwen_goldens.py, tests/test_qwen_tokenizer.py).

1,200 prompts: every third the English/Unicode/whitespace mix of tests/t5_prompt_gen.py (the T5
special strings swapped for Qwen's), the others Chinese-heavy: Chinese words and phrases, full-width
punctuation, numbers (split digit by digit), English mixed in, contractions in any case ('S, 'LL),
newline runs, Qwen's special tokens (<|im_start|>, <think>, ...), compatibility and decomposed
characters that NFC changes. Only `random.Random(int)` with `randrange`, whose sequences Python
keeps stable, and fixed word lists.
"""
from __future__ import annotations

import random

from t5_prompt_gen import t5_prompts

ZH = ("一只 可爱的 猫 坐在 窗台 上 阳光 明媚 的 早晨 古老 城堡 雪山 湖泊 倒影 赛博朋克 城市 夜景 霓虹灯 雨 "
      "水墨画 风格 油画 高清 细节 丰富 电影 光效 少女 穿着 汉服 站在 桃花 树下 宇航员 骑马 月球 表面 "
      "长城 故宫 熊猫 吃 竹子 龙 凤凰 山水 画卷 江南 水乡 小桥 流水 人家 红灯笼 春节 烟花 书法 "
      "“你好，世界” 文字 写着 招牌 上 的 字 咖啡店 菜单 價格 繁體 中文 測試 臺灣 香港 澳門 "
      "日本語 テキスト カタカナ ひらがな 한국어 텍스트").split()
ZH_PUNCT = ["，", "。", "！", "？", "、", "；", "：", "「", "」", "『", "』", "《", "》", "（", "）", "【", "】",
            "……", "——", "·", "～", "“", "”", "‘", "’", "％", "＃", "＠"]
EN = ("a photo of the cat dog It's I'M they'LL we've she'D You'RE don't CAN'T 8k HDR 35mm f/1.8 "
      "ultra-detailed masterpiece, best quality").split()
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<|vision_start|>",
           "<|image_pad|>", "<tool_call>", "<|im_start", "im_end|>", "< think >"]
ODD = ["e\u0301", "a\u0308", "\u212b", "\uf900", "\uff21\uff22", "ﬁ", "①", "²", "😀", "🐱‍👤", "\u200b",
       "\u3000", "\u00a0", "\t", "\r\n", "\n\n\n", "  ", "\x00", "\ufeff"]


def _zh_piece(r: random.Random) -> str:
    x = r.randrange(100)
    if x < 55:
        return ZH[r.randrange(len(ZH))]
    if x < 68:
        return ZH_PUNCT[r.randrange(len(ZH_PUNCT))]
    if x < 78:
        return str(r.randrange(10 ** r.randrange(1, 10)))
    if x < 88:
        return EN[r.randrange(len(EN))]
    if x < 93:
        return SPECIAL[r.randrange(len(SPECIAL))]
    return ODD[r.randrange(len(ODD))]


def qwen_prompts(n: int = 1200) -> list[str]:
    out = ["", " ", "a", "a cat", "一只猫", "中文提示词：一只可爱的猫，坐在窗台上。", "<|im_start|>user\n你好<|im_end|>\n",
           "Hello, 世界! 123456789", "I'M HERE, YOU'LL SEE", "caf\u00e9 vs cafe\u0301", "\n\n  \n", "🐱🐶🦊 派对 🎉",
           "  leading and trailing  ", "x" * 300, "<think>\n\n</think>\n\n", "a (red:1.2) cat"]
    en = t5_prompts(n)
    for i in range(len(out), n):
        if i % 3 == 0:
            p = en[i]
            for a, b in (("</s>", "<|im_end|>"), ("<extra_id_0>", "<|im_start|>"), ("<pad>", "<|endoftext|>")):
                p = p.replace(a, b)
            out.append(p)
            continue
        r = random.Random(5000 + i)
        length = r.randrange(200, 500) if i % 40 == 1 else r.randrange(1, 60)
        parts = []
        for _ in range(length):
            parts.append(_zh_piece(r))
            k = r.randrange(10)
            parts.append(" " if k < 3 else "\n" if k == 3 else "")
        out.append("".join(parts))
    return out
