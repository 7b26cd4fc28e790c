"""Stops inside multi-token steps and streamed text, on the real tokenizer."""
from orchestrator.stopping import OutputStream

EOS = 2


def run(tokenizer, tokens, stop=(), max_tokens=1000, steps=None):
    """Push ``tokens`` in steps (lists), collecting deltas after each step as the loop does."""
    out = OutputStream(tokenizer, list(stop), {EOS}, max_tokens)
    deltas = []
    steps = steps or [[t] for t in tokens]
    for step in steps:
        done = False
        for t in step:
            if out.push(t):
                done = True
                break
        deltas.append(out.take_delta())
        if done:
            break
    return out, deltas


def joined(deltas):
    return "".join(t for t, _ in deltas), [i for _, ids in deltas for i in ids]


def test_eos_inside_step_ends_output(tokenizer):
    ids = tokenizer.encode("Hello there, friend")
    seq = ids[:2] + [EOS] + ids[2:]
    out, deltas = run(tokenizer, seq, steps=[seq])
    text, got = joined(deltas)
    assert out.finish_reason == "stop"
    assert got == ids[:2] + [EOS]
    assert text == tokenizer.decode(ids[:2])


def test_stop_string_split_across_steps(tokenizer):
    text = "The answer is forty two. Then more words follow here."
    ids = tokenizer.encode(text)
    # A stop string that begins in one step and ends in the next.
    stop = "forty two"
    steps = [ids[:4], ids[4:6], ids[6:]]
    assert stop not in tokenizer.decode(ids[:4]) and stop in tokenizer.decode(ids[:5])
    out, deltas = run(tokenizer, ids, stop=[stop], steps=steps)
    text_out, got = joined(deltas)
    assert out.finish_reason == "stop"
    assert text_out == "The answer is "
    n = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))
    assert got == ids[:n]  # tokens through the one completing the stop string
    assert all(stop not in t for t, _ in deltas)


def test_max_tokens_inside_step(tokenizer):
    ids = tokenizer.encode("one two three four five six seven")
    out, deltas = run(tokenizer, ids, max_tokens=3, steps=[ids[:2], ids[2:]])
    text, got = joined(deltas)
    assert out.finish_reason == "length" and got == ids[:3]
    assert text == tokenizer.decode(ids[:3])


def test_stream_never_splits_utf8_or_repeats(tokenizer):
    text = "Émoji 🙂🙃 and 日本語 text ✓"
    ids = tokenizer.encode(text)
    out, deltas = run(tokenizer, ids)
    assert all("\ufffd" not in t for t, _ in deltas)
    assert joined(deltas)[0] == text
    assert out.finish_reason is None or out.finish_reason == "length"


def test_stop_prefix_held_back_then_released(tokenizer):
    text = "abc STOP! but not quite"
    ids = tokenizer.encode(text)
    k = next(k for k in range(len(ids)) if tokenizer.decode(ids[:k + 1]).endswith("STOP!"))
    out, deltas = run(tokenizer, ids, stop=["STOP!!"], max_tokens=len(ids))
    # While "STOP!" could still begin the stop string it is held back ...
    assert "STOP" not in joined(deltas[:k + 1])[0]
    # ... and released once it cannot; the whole text arrives exactly once.
    assert out.finish_reason == "length" and joined(deltas)[0] == text
