"""Output assembly with stops inside multi-token steps.

Tokens of a round are pushed one at a time, so a stop token id (EOS), a stop string or
max_tokens falling inside an accepted path ends the output exactly where plain decoding would.
Conventions (as vLLM): a stop token id is kept in ``token_ids`` and usage but not in the text;
a stop string is cut from the text, and tokens after the one that completed it are dropped.
Streamed text holds back an incomplete UTF-8 tail and any tail that could begin a stop
string, so deltas never split a character, never repeat, and never show stop text.
"""
from __future__ import annotations

from modeling.tokenizer import IncrementalDetokenizer, TextTokenizer


class OutputStream:
    """Accumulates emitted tokens; ``push`` returns True once the output is finished."""

    def __init__(self, tokenizer: TextTokenizer, stop: list[str], stop_token_ids: set[int], max_tokens: int):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = [s for s in stop if s]
        self.stop_token_ids = set(stop_token_ids)
        self.max_tokens = max_tokens
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self._final_text: str | None = None
        self._sent_text = 0
        self._sent_ids = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, token: int) -> bool:
        if self.finished:
            raise RuntimeError("output already finished")
        self.token_ids.append(token)
        if token in self.stop_token_ids:
            self._finish("stop", self.detok.tokenizer.decode(self.detok.tokens))
            return True
        self.detok.add(token)
        if self.stop:
            text = self.detok.text
            start = self._sent_text  # an unfinished stop string is always held back
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self._finish("stop", text[:min(hits)])
                return True
        if len(self.token_ids) >= self.max_tokens:
            self._finish("length", self.detok.tokenizer.decode(self.detok.tokens))
        return self.finished

    def ends_within(self, tokens: list[int]) -> bool:
        """True when pushing ``tokens`` surely finishes the output (max_tokens reached, or a stop
        token id among them); stop strings are not looked for (``push`` decides)."""
        return self.finished or len(self.token_ids) + len(tokens) >= self.max_tokens or \
            any(t in self.stop_token_ids for t in tokens)

    def _finish(self, reason: str, text: str) -> None:
        self.finish_reason = reason
        self._final_text = text

    def _visible(self) -> str:
        if self._final_text is not None:
            return self._final_text
        text = self.detok.text
        hold = 0
        for s in self.stop:  # longest tail of text that is a proper prefix of a stop string
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:n]):
                    hold = n
                    break
        return text[:len(text) - hold]

    def take_delta(self) -> tuple[str, list[int]]:
        """Text and token ids not yet handed out."""
        visible = self._visible()
        text, ids = visible[self._sent_text:], self.token_ids[self._sent_ids:]
        self._sent_text, self._sent_ids = len(visible), len(self.token_ids)
        return text, ids

    @property
    def text(self) -> str:
        return self._visible()
