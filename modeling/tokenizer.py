"""Tokenizer built from GGUF metadata with the ``tokenizers`` library, the model's chat template
(jinja2), and an incremental detokenizer that never splits a UTF-8 character."""
from __future__ import annotations

import functools
import pathlib

import jinja2.sandbox
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

_CONTROL = 3  # llama.cpp token type CONTROL


class TextTokenizer:
    """Byte-level BPE tokenizer (GPT-2 family, as llama.cpp's ``gpt2`` tokenizer model).

    Special (control) tokens are matched literally in text and skipped when decoding.
    """

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...], chat_template: str | None):
        self.tok = tokenizer
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "TextTokenizer":
        """Build from GGUF fields (``tokenizer.ggml.*``). Raises ValueError for non-BPE models."""
        if meta.get("tokenizer.ggml.model") != "gpt2":
            raise ValueError(f"unsupported tokenizer model {meta.get('tokenizer.ggml.model')!r}")
        tokens = list(meta["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                   ignore_merges=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        tok.decoder = decoders.ByteLevel()
        types = list(meta.get("tokenizer.ggml.token_type", []))
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _CONTROL])
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(tok, (int(eos),) if eos is not None else (), meta.get("tokenizer.chat_template"))

    @classmethod
    def from_file(cls, path: str | pathlib.Path) -> "TextTokenizer":
        """From a GGUF file, or an HF directory holding tokenizer.json (+ tokenizer_config.json)."""
        path = pathlib.Path(path)
        if path.is_dir():
            import json
            conf_path = path / "tokenizer_config.json"
            conf = json.loads(conf_path.read_text()) if conf_path.exists() else {}
            tok = Tokenizer.from_file(str(path / "tokenizer.json"))
            eos = tok.token_to_id(conf.get("eos_token") or "</s>")
            template = conf.get("chat_template")
            if isinstance(template, list):  # named templates ([{name, template}]): the default one
                named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
                template = named.get("default")
            return cls(tok, (eos,) if eos is not None else (), template)
        from modeling.model_files import gguf_metadata
        return cls.from_gguf_metadata(gguf_metadata(path))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render chat messages [{role, content}] with the model's template (compiled once per template
        text; ``raise_exception(msg)`` defined for it, as Hugging Face's templates expect). Raises
        ValueError if the model has no template, a message lacks a field or the template refuses the
        messages (its ``raise_exception``, the sandbox, an undefined name); RuntimeError if the template
        does not compile or fails otherwise (a Python error inside it: its fault, not the messages')."""
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] needs string role and content")
        try:
            template = _compiled(self.chat_template)
        except Exception as e:  # noqa: BLE001 — jinja2's syntax errors, and Python's (nesting past its limits)
            raise RuntimeError(f"the model's chat template does not compile: {type(e).__name__}: {e}") from e
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as e:  # (a template's raise_exception, a sandbox refusal, an undefined name)
            raise ValueError(f"the model's chat template refused these messages: {e}") from e
        except Exception as e:  # noqa: BLE001 — 1/0, a range past the sandbox's limit, recursion
            raise RuntimeError(f"the model's chat template failed: {type(e).__name__}: {e}") from e


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> jinja2.Template:
    """A chat template compiled once per template text (rendering is thread-safe): compiling it per request
    was 2.1 ms here and ~4 % of the orchestrator's Python CPU per round at c = 64 on the H200 (py-spy,
    bench/results/concurrency_h200_s27_gap.json). Keyed by the text, not kept on the tokenizer: a tokenizer
    stays picklable and a changed ``chat_template`` takes effect."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


class IncrementalDetokenizer:
    """Turns a growing token list into stable text: ``text`` is the decoded text of all tokens
    without an incomplete UTF-8 tail (the decoder shows one as U+FFFD), so streamed text never
    splits a character or repeats.

    Incremental: ``add`` decodes only the tokens since the last point where the text ended on a
    whole character (``_start``; usually just the new token), not the whole output (O(1) per
    token instead of O(n)). Exact for the byte-level decoder (``tokenizers.decoders.ByteLevel``,
    every GGUF ``gpt2`` tokenizer): it maps each token to bytes and decodes their concatenation
    left to right, so after a whole character the decoding of what follows does not depend on
    what came before. Other decoders (an HF tokenizer.json's, e.g. Metaspace, which strips a
    leading space) decode the whole output each time, as before.
    """

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""  # the stable text decoded so far
        self._start = 0  # the window's first token: tokens[:_start] decode to text[:_base] exactly
        self._base = 0
        # (a tokenizer without a ``tokenizers`` backend, e.g. a test's duck type: whole decoding)
        backend = getattr(tokenizer, "tok", None)
        self._windowed = isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)

    def add(self, token: int) -> str:
        """Append one token; refresh ``text`` (only up to the last whole character) and return
        what it gained (often "", e.g. for the first bytes of a multi-byte character)."""
        self.tokens.append(token)
        if not self._windowed:
            return self._add_full()
        window = self.tokenizer.decode(self.tokens[self._start:])
        stable = window.rstrip("\ufffd")
        seen = len(self.text) - self._base  # the window's text already in ``text``
        if not stable.startswith(self.text[self._base:]):
            return ""  # (never seen with this decoder; kept as the full-decoding rule)
        new = stable[seen:]
        if new:
            self.text += new
        if len(stable) == len(window):  # ends on a whole character: the next window starts here
            self._start, self._base = len(self.tokens), len(self.text)
        return new

    def _add_full(self) -> str:
        text = self.tokenizer.decode(self.tokens).rstrip("\ufffd")
        if not text.startswith(self.text):
            return ""
        new, self.text = text[len(self.text):], text
        return new

    def full_text(self) -> str:
        """The decoding of every token, an incomplete UTF-8 tail included (as U+FFFD)."""
        if not self._windowed:
            return self.tokenizer.decode(self.tokens)
        return self.text[:self._base] + self.tokenizer.decode(self.tokens[self._start:])
