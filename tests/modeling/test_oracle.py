"""The embedded model and tokenizer equal an independent oracle: transformers' Llama and
tokenizer loaded from the same GGUF file (test-only dependency)."""
import pytest
import torch

from conftest import humaneval_prompts, mtbench_questions
from modeling.sampling import SamplingParams
from modeling.weights import default_gguf_path
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
    greedy = SamplingParams()
    out = [engine.prefill("o", prompt, n, greedy).first_token]
    while len(out) < n:
        out.append(engine.verify("o", [out[-1]], [-1], greedy, return_features=False).bonus_token)
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
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert tokenizer.apply_chat_template(msgs) == hf_tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)


def test_greedy_matches_oracle(oracle, tokenizer, target_model):
    _, hf = oracle
    engine = TargetEngine(target_model, (), max_context=8192, kv_pool_tokens=1 << 16)
    prompts = [tokenizer.encode(p) for p in humaneval_prompts(3)] + [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
        for q in mtbench_questions(2)]
    for ids in prompts:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert engine_greedy(engine, ids, 32) == ref
