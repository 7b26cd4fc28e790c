"""Chat prompts: the model's template compiled once and rendered per request, and a template that cannot
render a request ends it with a status naming why (INVALID_ARGUMENT: the messages; FAILED_PRECONDITION:
the model's template), not UNKNOWN."""
import copy
import pickle
from concurrent.futures import ThreadPoolExecutor

import jinja2.sandbox
import pytest

from orchestrator.servicer import Limits, build_request
from protocol.types import FailedPrecondition, InvalidRequest
from specdec_client.client import build_request as sdk_request

LIM = Limits(max_context=2048, max_tokens=256, max_tree_budget=64, default_tree_budget=16, vocab_size=49152,
             eos_token_ids=(2,))
# a template that refuses a system turn, as many models' templates do (raise_exception: Hugging Face's helper)
STRICT = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns') }}"
          "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")


def _fresh(template: str, messages, gen: bool) -> str:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=gen)


def test_renders_equal_a_fresh_compile_from_many_threads(tokenizer):
    convs = [[{"role": "user", "content": f"question {i} ünïcode 🙂"}] if i % 3 else
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": str(i)},
              {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}] for i in range(96)]

    def render(i):
        return tokenizer.apply_chat_template(convs[i], add_generation_prompt=bool(i % 2))

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(render, range(len(convs))))
    assert got == [_fresh(tokenizer.chat_template, c, bool(i % 2)) for i, c in enumerate(convs)]


def test_tokenizer_stays_picklable_and_follows_its_template(tokenizer):
    tok = copy.copy(tokenizer)
    msgs = [{"role": "user", "content": "hi"}]
    first = tok.apply_chat_template(msgs)
    assert pickle.loads(pickle.dumps(tok)).apply_chat_template(msgs) == first
    tok.chat_template = "{{ messages | length }} message(s)"
    assert tok.apply_chat_template(msgs) == "1 message(s)"


def test_a_template_that_cannot_render_a_request_names_why(tokenizer):
    user, system = sdk_request(messages=[{"role": "user", "content": "hi"}]), sdk_request(
        messages=[{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}])
    strict = copy.copy(tokenizer)
    strict.chat_template = STRICT
    assert build_request(user, strict, LIM).prompt_tokens == tokenizer.encode("user: hi\n")
    with pytest.raises(InvalidRequest, match="chat.messages: the model's chat template refused these messages: "
                                             "no system turns"):
        build_request(system, strict, LIM)
    broken = copy.copy(tokenizer)
    for template, why in (("{% for m in messages %}{{ m['content'] }", "does not compile"),
                          ("{% for m in messages %}" * 25 + "x" + "{% endfor %}" * 25, "does not compile"),
                          ("{{ 1 / 0 }}", "failed: ZeroDivisionError"),
                          ("{% for i in range(10 ** 6) %}{% endfor %}", "failed: OverflowError"),
                          ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "failed: RecursionError")):
        broken.chat_template = template  # the model's template is at fault: FAILED_PRECONDITION, never UNKNOWN
        with pytest.raises(FailedPrecondition, match=why):
            build_request(user, broken, LIM)
    none = copy.copy(tokenizer)
    none.chat_template = None
    with pytest.raises(FailedPrecondition, match="no chat template"):
        build_request(user, none, LIM)
    assert build_request(sdk_request("hi"), none, LIM).prompt_tokens == tokenizer.encode("hi")  # text still works


def test_named_templates_of_a_tokenizer_directory_take_the_default(tokenizer, tmp_path):
    import json

    from modeling.tokenizer import TextTokenizer

    tokenizer.tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ messages[0]['content'] }}!"}]}))
    tok = TextTokenizer.from_file(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"
