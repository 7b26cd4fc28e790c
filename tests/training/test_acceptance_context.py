"""The prompt file of ``bench.acceptance_context`` (issue 9 item 4): every language has its
windows of the longest length, each ending at a line start of its source (so every shorter
prompt, a suffix of the same window, continues at the same point), with provenance; the
Chinese windows are Chinese text and the code windows Python."""
from __future__ import annotations

from bench.acceptance_context import LENGTHS, load_prompts


def test_prompt_windows_end_at_line_starts_with_provenance(tokenizer):
    prompts, meta = load_prompts()
    assert sorted(prompts) == ["code", "en", "zh"] and meta["longest"] == max(LENGTHS)
    for lang, windows in prompts.items():
        prov = meta["langs"][lang]
        assert windows.shape == (8, max(LENGTHS)) and len(prov) == 8, lang
        assert len({p["cut_char"] for p in prov}) == len(prov) or lang == "code"  # distinct cuts
        for row, p in zip(windows, prov):
            tail = tokenizer.decode([int(t) for t in row[-48:]])
            assert tail.endswith("\n") and p["next_line"].strip(), (lang, p)
    zh = tokenizer.decode([int(t) for t in prompts["zh"][0][-256:]])
    assert sum("\u4e00" <= ch <= "\u9fff" for ch in zh) > 40  # CJK text, not the English tutor
    assert all(p["source"].startswith("python3.") for p in meta["langs"]["code"])
    assert len({p["source"] for p in meta["langs"]["code"]}) == 8  # one cut per stdlib module
