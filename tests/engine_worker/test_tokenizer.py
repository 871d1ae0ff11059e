"""The tokenizer (SmolLM2's, rebuilt from GGUF metadata) and the chat template renderer.

Comparisons against transformers' tokenizer live in ``test_model_smollm2.py``
(slow); these tests check behaviour a caller relies on: round trips,
special tokens, streaming detokenization, HF-directory loading, errors.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFWriter

from engine_worker.chat_template import ChatTemplate, ChatTemplateError
from engine_worker.tokenizer import Tokenizer, TokenizerError, load_tokenizer

TEXTS = [
    "Hello, world!",
    "naïve café — “quotes” 日本語のテキスト",
    "emoji 🙂👍🏽🧑‍💻 family 👨‍👩‍👧",
    "def f(x):\n    return x**2  # comment\n\n",
    "tabs\tand   runs of    spaces\r\n",
    "numbers 12345 and 3.14159, a  1",
    "",
]


@pytest.fixture(scope="session")
def smol() -> Tokenizer:
    return load_tokenizer("smollm2")


def test_router_side_tokenizing_never_imports_torch() -> None:
    """Importing, loading the tokenizer and rendering a chat prompt stay torch-free."""
    code = (
        "import sys, engine_worker.tokenizer, engine_worker.chat_template\n"
        "assert 'torch' not in sys.modules, 'import pulled torch in'\n"
        "from engine_worker.tokenizer import load_tokenizer\n"
        "from engine_worker.chat_template import ChatTemplate\n"
        "tok = load_tokenizer('tiny')\n"
        "tok.encode(ChatTemplate.for_tokenizer(tok).render([{'role': 'user', 'content': 'hi'}]))\n"
        "assert 'torch' not in sys.modules, 'loading pulled torch in'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(smol: Tokenizer, text: str) -> None:
    ids = smol.encode(text)
    assert all(0 <= i < smol.vocab_size for i in ids)
    assert smol.decode(ids, skip_special_tokens=False) == text


def test_special_tokens(smol: Tokenizer) -> None:
    assert smol.vocab_size == 49152
    assert (smol.bos_token, smol.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (smol.bos_token_id, smol.eos_token_ids) == (1, (2,))
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>")
    assert (ids[0], ids[-1]) == (1, 2)
    assert smol.encode("hi") == smol.encode("hi", add_special_tokens=False)  # SmolLM2 adds none
    assert smol.decode(ids) == "user\nhi"
    assert "<|im_start|>" in (smol.chat_template or "")


def test_digits_are_split_one_by_one_like_llama_cpp(smol: Tokenizer) -> None:
    """``tokenizer.ggml.pre = smollm``: digits are isolated before byte-level BPE."""
    tokens = [smol.backend.id_to_token(i) for i in smol.encode("a  1 2024")]
    assert tokens == ["a", "ĠĠ", "1", "Ġ", "2", "0", "2", "4"]


def test_specs_share_one_cached_tokenizer(smol: Tokenizer) -> None:
    assert load_tokenizer("tiny") is smol


def test_incremental_decoder_never_splits_a_character(smol: Tokenizer) -> None:
    text = "Rare: 龘靐齉 and 🧑‍🔬, done."
    ids = smol.encode(text)
    decoder = smol.incremental_decoder(prompt_ids=smol.encode("Say it:"))
    deltas = [decoder.push(i) for i in ids]
    assert "" in deltas  # some token ended mid-character and was held back
    assert all("\ufffd" not in d for d in deltas)
    assert decoder.finish() == ""
    assert "".join(deltas) == decoder.text == text


def test_incremental_decoder_flushes_a_truncated_character(smol: Tokenizer) -> None:
    ids = smol.encode("龘")
    assert len(ids) > 1
    decoder = smol.incremental_decoder()
    assert [decoder.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert decoder.finish() == "\ufffd"


def test_bad_input(smol: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="outside vocab"):
        smol.decode([5, 49152])
    with pytest.raises(TokenizerError, match="can only encode str"):
        smol.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_gguf(tmp_path / "absent.gguf")
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        Tokenizer.from_hf_dir(tmp_path)


def write_tokenizer_gguf(path: Path, **fields: object) -> None:
    """A tensor-free GGUF carrying only tokenizer metadata."""
    writer = GGUFWriter(str(path), "llama")
    for key, value in fields.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_without_a_usable_tokenizer(tmp_path: Path) -> None:
    write_tokenizer_gguf(tmp_path / "none.gguf")
    with pytest.raises(TokenizerError, match="carries no tokenizer"):
        Tokenizer.from_gguf(tmp_path / "none.gguf")
    write_tokenizer_gguf(tmp_path / "spm.gguf", tokenizer_model="llama", token_list=["a", "b"])
    with pytest.raises(TokenizerError, match="'llama' is not supported"):
        Tokenizer.from_gguf(tmp_path / "spm.gguf")
    write_tokenizer_gguf(
        tmp_path / "pre.gguf", tokenizer_model="gpt2", tokenizer_pre="exotic", token_list=["a"]
    )
    with pytest.raises(TokenizerError, match="pre-tokenizer 'exotic'"):
        Tokenizer.from_gguf(tmp_path / "pre.gguf")


def test_gguf_add_bos_flag_prepends_bos(tmp_path: Path) -> None:
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = ["<s>", "</s>", *letters, "Ġ", "he", "hel", "hell", "hello"]
    write_tokenizer_gguf(
        tmp_path / "bos.gguf",
        tokenizer_model="gpt2",
        token_list=tokens,
        token_types=[3, 3] + [1] * (len(tokens) - 2),
        token_merges=["h e", "he l", "hel l", "hell o"],
        bos_token_id=0,
        eos_token_id=1,
        add_bos_token=True,
    )
    tok = Tokenizer.from_gguf(tmp_path / "bos.gguf")
    assert tok.encode("hello") == [0, tokens.index("hello")]
    assert tok.encode("hello", add_special_tokens=False) == [tokens.index("hello")]
    assert tok.decode(tok.encode("hello")) == "hello"


def test_hf_directory_tokenizer(smol: Tokenizer, tmp_path: Path) -> None:
    smol.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>"})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    tok = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS:
        assert tok.encode(text) == smol.encode(text)
    assert tok.eos_token_ids == (2, 0)
    assert tok.bos_token_id == 1
    assert ChatTemplate.for_tokenizer(tok).render([{"role": "user", "content": "hey"}]) == "hey!"


# --- chat template -----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smol_chat(smol: Tokenizer) -> ChatTemplate:
    return ChatTemplate.for_tokenizer(smol)


def test_chat_prompt_ends_with_the_assistant_header(smol_chat: ChatTemplate) -> None:
    prompt = smol_chat.render([{"role": "user", "content": "What is 2+2?"}])
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.startswith("<|im_start|>system\n")  # SmolLM2 inserts its default system turn
    closed = smol_chat.render([{"role": "user", "content": "x"}], add_generation_prompt=False)
    assert not closed.endswith("assistant\n")


def test_text_parts_render_like_a_string(smol_chat: ChatTemplate) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    as_parts = smol_chat.render(
        [{"role": "system", "content": "S"}, {"role": "user", "content": parts}]
    )
    as_text = smol_chat.render(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "first\nsecond"}]
    )
    assert as_parts == as_text


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ([{"role": "wizard", "content": "x"}], "role must be one of"),
        ([{"role": "user"}], "has no content"),
        ([{"role": "user", "content": 5}], "string or a list of parts"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "'image_url'"),
        (["hello"], r"messages\[0\] must be an object"),
    ],
)
def test_bad_messages_are_refused(
    smol_chat: ChatTemplate, messages: list[dict[str, object]], match: str
) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        smol_chat.render(messages)


def test_assistant_tool_call_without_content_is_accepted() -> None:
    template = ChatTemplate(
        "{% for m in messages %}[{{ m.role }}:{{ m.content }}:"
        "{{ m.tool_calls | default(none) | tojson }}]{% endfor %}"
    )
    calls = [{"id": "c1", "function": {"name": "f", "arguments": '{"q": "é"}'}}]
    out = template.render(
        [
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ]
    )
    assert out.startswith('[assistant::[{"id": "c1"')
    assert '"{\\"q\\": \\"é\\"}"' in out  # tojson keeps non-ASCII
    assert out.endswith("[tool:42:null]")


def test_template_errors_are_chat_template_errors() -> None:
    refusing = ChatTemplate("{{ raise_exception('system messages are not allowed') }}")
    with pytest.raises(ChatTemplateError, match="system messages are not allowed"):
        refusing.render([{"role": "system", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    escaping = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        escaping.render([{"role": "user", "content": "x"}])
    tokens = ChatTemplate(
        "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}", bos_token="<s>", eos_token="</s>"
    )
    assert tokens.render([{"role": "user", "content": "x"}]) == "<s>x</s>"
