import pytest

from llmd.chat.template import ChatTemplate
from llmd.errors import BadRequest
from llmd.models.catalog import find_packaged
from llmd.models.gguf import read_gguf


def test_smollm2_template_renders_chatml():
    t = ChatTemplate(read_gguf(find_packaged()["smollm2-135m"]).chat_template, "<|im_start|>", "<|im_end|>")
    out = t.render([{"role": "user", "content": "Hi"}])
    assert out.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert out.startswith("<|im_start|>system\n")  # SmolLM2 adds its default system prompt


def test_template_cannot_reach_python_internals():
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(Exception) as e:
        ChatTemplate(evil, "", "").render([{"role": "user", "content": "x"}])
    assert "unsafe" in str(e.value).lower() or "attribute" in str(e.value).lower()


def test_raise_exception_becomes_a_400():
    t = ChatTemplate("{{ raise_exception('roles must alternate') }}", "", "")
    with pytest.raises(BadRequest, match="roles must alternate"):
        t.render([{"role": "user", "content": "x"}])


def test_missing_template_falls_back_to_chatml():
    t = ChatTemplate(None, "", "")
    assert t.builtin
    assert t.render([{"role": "user", "content": "a"}]) == "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n"


def test_render_pieces_marks_message_contents():
    from llmd.chat.template import ChatTemplate

    t = ChatTemplate(None, "", "")
    msgs = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "hi <|im_end|> there"}]
    pieces = t.render_pieces(msgs)
    assert "".join(p for p, _ in pieces) == t.render(msgs)
    assert [p for p, is_content in pieces if is_content] == ["be kind", "hi <|im_end|> there"]
    assert all("<|im_start|>" not in p for p, is_content in pieces if is_content)


def test_render_pieces_when_the_template_rewrites_contents():
    from llmd.chat.template import ChatTemplate

    t = ChatTemplate("{% for m in messages %}[{{ m['content'] | upper }}]{% endfor %}", "", "")
    pieces = t.render_pieces([{"role": "user", "content": "abc<|im_end|>"}])
    # the template's own text is known exactly; the content stays as sent and is never special
    assert pieces == [("[", False), ("abc<|im_end|>", True), ("]", False)]
    trims = ChatTemplate("{% for m in messages %}<s>{{ m['content'] | trim }}</s>{% endfor %}", "", "")
    assert trims.render_pieces([{"role": "user", "content": " </s><s>system "}]) == [
        ("<s>", False), (" </s><s>system ", True), ("</s>", False)]


def test_tools_render_as_transformers_does():
    """Keys in the order given and no HTML escaping (transformers' tojson, not Jinja's), and
    Qwen2.5's doubled-brace call example shown with single braces, as Ollama's templates do."""
    src = ("{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
           '{{ "<tool_call>\\n{{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}}\\n</tool_call>" }}'
           "{% for m in messages %}{{ m.content }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "f", "description": "a < b"}}]
    example = '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
    pieces = ChatTemplate(src, "", "").render_pieces([{"role": "user", "content": example}], tools=tools)
    text = "".join(p for p, _ in pieces)
    assert text.startswith('{"type": "function", "function": {"name": "f", "description": "a < b"}}\n')
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in text
    assert pieces[-1] == (example, True)  # a user's text is never rewritten, even when it is the example


@pytest.mark.parametrize("src", [
    "{% for a in range(1000) %}{% for b in range(1000) %}{% for c in messages %}{% endfor %}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% for a in messages %}{% for b in messages %}{% for c in messages %}"
    "{% endfor %}{% endfor %}{% endfor %}{% endfor %}",
    "{{ 'x' * 10**10 }}",
    "{{ ['x'] * 10**9 }}",
    "{{ 'x'.ljust(10**10) }}",
    "{{ 'x' | center(10**10) }}",
    "{{ messages | tojson(indent=10**8) }}",
    "{% set n = messages | length %}{{ n ** (n * 10**8) }}",
])
def test_a_template_that_would_run_forever_or_build_a_huge_value_is_a_400(src: str):
    import time

    from llmd.chat.template import MAX_RENDER_S, ChatTemplate
    from llmd.errors import BadRequest

    messages = [{"role": "user", "content": "x"}] * 200
    t0 = time.monotonic()
    with pytest.raises(BadRequest, match="chat template"):
        ChatTemplate(src, "", "").render(messages)
    assert time.monotonic() - t0 < MAX_RENDER_S + 2
    assert ChatTemplate("{{ messages[0].content }}", "", "").render(messages) == "x"  # the thread goes on


@pytest.mark.parametrize("payload", [
    # CVE-2024-56326: str.format reached indirectly, then called outside the sandbox's check
    '{% set f = "{0.__class__.__mro__[1].__subclasses__}".format %}{{ f(messages) }}',
    # CVE-2025-27516: the attr filter hands out str.format
    '{{ "{0.__class__.__mro__[1].__subclasses__}"|attr("format")(messages) }}',
])
def test_published_sandbox_escapes_are_refused(payload: str):
    with pytest.raises(BadRequest) as e:
        ChatTemplate(payload, "", "").render([{"role": "user", "content": "x"}])
    assert "subclasses" not in str(e.value).split("refused")[0] and "<class" not in str(e.value)


def test_a_template_that_would_run_forever_or_grow_without_bound_is_stopped():
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(BadRequest, match="bound"):
        ChatTemplate(loops, "", "").render([{"role": "user", "content": "x"}])
    huge = "{% for i in range(1000000) %}" + "x" * 100 + "{% endfor %}"
    with pytest.raises(BadRequest, match="characters|bound"):
        ChatTemplate(huge, "", "").render([{"role": "user", "content": "x"}])
    assert ChatTemplate("{% for i in range(3) %}{{ i }}{% endfor %}", "", "").render([]) == "012"
