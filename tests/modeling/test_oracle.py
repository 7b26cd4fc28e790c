"""The embedded model and tokenizer equal an independent oracle: transformers' Llama and
tokenizer loaded from the same GGUF file (test-only dependency)."""
import pytest
import torch

from bench.datasets import humaneval_prompts, mtbench_questions
from modeling.sampling import SamplingParams
from modeling.weights import default_gguf_path
from lossless_reference import teacher_forced_logits
from target_service.engine import TargetEngine

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def oracle():
    path = default_gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    return tok, model


def engine_greedy(engine, prompt, n):
    """Plain greedy decoding on our target engine: prefill, then one-node verifies."""
    out = [engine.prefill("o", prompt, n, SamplingParams()).first_token]
    commit = None
    while len(out) < n:
        out.append(engine.verify("o", [out[-1]], [-1], commit).samples[0])
        commit = [0]
    engine.release(["o"])
    return out


def test_tokenizer_matches_oracle(oracle, tokenizer):
    """transformers' GGUF converter drops the GGUF's pre-tokenizer type ('smollm'); llama.cpp
    (and SmolLM2's own tokenizer.json) split every digit first, then apply the GPT-2 regex.
    The oracle gets that documented rule; everything else (vocab, merges, byte-level, special
    tokens, decode, chat template) is its own."""
    from tokenizers import pre_tokenizers

    hf_tok, _ = oracle
    hf_tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    assert [tokenizer.decode([i]) for i in tokenizer.encode("x = 12345")][-5:] == list("12345")
    texts = humaneval_prompts(3) + mtbench_questions(3) + [
        "naïve café — 日本語 🙂 x²  \t\n  12345.678", "<|im_start|>user\nhi<|im_end|>\n"]
    for t in texts:
        assert tokenizer.encode(t) == hf_tok.encode(t, add_special_tokens=False)
        ids = tokenizer.encode(t)
        assert tokenizer.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    # the template is compiled once and rendered per request: every render must be the oracle's
    for msgs in ([{"role": "user", "content": "What is 2+2?"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "naïve 🙂"},
                  {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}],
                 [{"role": "user", "content": "What is 2+2?"}]):
        for gen in (True, False):
            assert tokenizer.apply_chat_template(msgs, add_generation_prompt=gen) == hf_tok.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=gen)


def test_greedy_matches_oracle(oracle, tokenizer, target_model):
    """Our greedy decoding, checked by one oracle forward over prompt + output (teacher
    forcing; equivalent to the oracle's own greedy ``generate``, which decodes the same
    argmaxes one at a time): every output token is the oracle's argmax after its prefix, and
    the oracle's logits equal ours on the whole sequence."""
    _, hf = oracle
    engine = TargetEngine(target_model, (), max_context=8192, kv_pool_tokens=1 << 16)
    prompts = [tokenizer.encode(p) for p in humaneval_prompts(3)] + [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
        for q in mtbench_questions(2)]
    for ids in prompts:
        out = engine_greedy(engine, ids, 32)
        with torch.no_grad():
            ref = hf(torch.tensor([ids + out[:-1]])).logits[0, len(ids) - 1:]
        assert ref.argmax(-1).tolist() == out
        torch.testing.assert_close(teacher_forced_logits(target_model, ids, out), ref, atol=2e-3, rtol=1e-3)
