"""Incremental detokenization (a window of recent tokens per push) equals full decoding for
every prefix, on the real SmolLM2 tokenizer: random token ids mixing multi-byte text (Chinese,
emoji, accents), single-byte tokens (incomplete UTF-8 on their own), control tokens (skipped)
and random vocabulary ids; and ``OutputStream`` streams exactly what the full-decoding stream
(session 5's, kept here as the reference) streamed: deltas, finish reason, token ids, with stop
strings spanning rounds."""
from hypothesis import HealthCheck, given, settings, strategies as st

from modeling.tokenizer import IncrementalDetokenizer
from orchestrator.stopping import OutputStream

EOS = 2
TEXTS = ["中文测试，你好世界。", "emoji 🙂🎉👍🏽 end", "naïve café — Ω≈ç√",
         "plain words and 1234 digits\n", "日本語のテキスト", "<|im_end|> mixed", "stop here STOP now"]
STOPS = ["STOP", "。", "🎉", "wor", "\n\n", "好世"]


class FullDecodeStream:
    """The reference: session 5's OutputStream, decoding the whole output on every push."""

    def __init__(self, tokenizer, stop, stop_token_ids, max_tokens):
        self.tok, self.stop, self.stop_ids = tokenizer, [s for s in stop if s], stop_token_ids
        self.max_tokens = max_tokens
        self.tokens, self.token_ids, self.text, self.finish_reason, self.final = [], [], "", None, None
        self.sent_text = self.sent_ids = 0

    def push(self, token):
        self.token_ids.append(token)
        if token in self.stop_ids:
            self.finish_reason, self.final = "stop", self.tok.decode(self.tokens)
            return True
        self.tokens.append(token)
        text = self.tok.decode(self.tokens).rstrip("\ufffd")
        if text.startswith(self.text):
            self.text = text
        hits = [i for i in (self.text.find(s, self.sent_text) for s in self.stop) if i >= 0]
        if hits:
            self.finish_reason, self.final = "stop", self.text[:min(hits)]
            return True
        if len(self.token_ids) >= self.max_tokens:
            self.finish_reason, self.final = "length", self.tok.decode(self.tokens)
        return self.finish_reason is not None

    def visible(self):
        if self.final is not None:
            return self.final
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:n]):
                    hold = n
                    break
        return self.text[:len(self.text) - hold]

    def take_delta(self):
        v = self.visible()
        out = v[self.sent_text:], self.token_ids[self.sent_ids:]
        self.sent_text, self.sent_ids = len(v), len(self.token_ids)
        return out


def pieces(tokenizer):
    """Strategy: a token id list built from chunks of the kinds above."""
    single = [i for t, i in tokenizer.tok.get_vocab().items() if len(t) == 1]  # one byte each
    encoded = [tokenizer.encode(t) for t in TEXTS]
    chunk = st.one_of(
        st.sampled_from(encoded).flatmap(lambda ids: st.integers(0, len(ids) - 1).map(lambda k: ids[k:])),
        st.lists(st.sampled_from(single), min_size=1, max_size=4),
        st.lists(st.integers(0, 20), min_size=1, max_size=2),  # control tokens and punctuation
        st.lists(st.integers(0, tokenizer.vocab_size - 1), min_size=1, max_size=3),
        st.text(min_size=1, max_size=6).map(tokenizer.encode).filter(bool))
    return st.lists(chunk, min_size=1, max_size=8).map(lambda cs: [t for c in cs for t in c])


def test_detokenizer_equals_full_decoding_every_prefix(tokenizer):
    @settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(ids=pieces(tokenizer))
    def check(ids):
        detok, ref = IncrementalDetokenizer(tokenizer), ""
        for n, t in enumerate(ids, 1):
            before = detok.text
            new = detok.add(t)
            full = tokenizer.decode(ids[:n])
            if full.rstrip("\ufffd").startswith(ref):
                ref = full.rstrip("\ufffd")
            assert detok.text == ref and before + new == ref
            assert detok.full_text() == full
    check()


def test_output_stream_equals_full_decoding_stream(tokenizer):
    @settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(ids=pieces(tokenizer), cuts=st.lists(st.integers(1, 5), min_size=1, max_size=40),
           stop=st.lists(st.sampled_from(STOPS), max_size=3), max_tokens=st.integers(1, 80),
           eos=st.booleans())
    def check(ids, cuts, stop, max_tokens, eos):
        if eos:
            ids = ids[:len(ids) // 2] + [EOS] + ids[len(ids) // 2:]
        out = OutputStream(tokenizer, stop, {EOS}, max_tokens)
        ref = FullDecodeStream(tokenizer, stop, {EOS}, max_tokens)
        i, k = 0, 0
        while i < len(ids) and not out.finished:
            step = ids[i:i + cuts[k % len(cuts)]]
            i, k = i + len(step), k + 1
            for t in step:  # pushed as the round loop does: until one ends the output
                assert out.push(t) == ref.push(t)
                if out.finished:
                    break
            assert out.take_delta() == ref.take_delta()
            assert out.text == ref.visible()
        assert (out.finish_reason, out.token_ids) == (ref.finish_reason, ref.token_ids)
    check()


def test_stop_string_spanning_rounds_is_cut(tokenizer):
    """A stop string whose characters arrive over three rounds: nothing of it is ever streamed."""
    ids = tokenizer.encode("我们说好世界")
    out, deltas = OutputStream(tokenizer, ["好世"], {EOS}, 100), []
    for t in ids:
        done = out.push(t)
        deltas.append(out.take_delta()[0])
        if done:
            break
    assert out.finish_reason == "stop" and "".join(deltas) == "我们说"
